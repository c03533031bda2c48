"""Faults through the API on a testbed job: the testbed's coordinator kills an agent mid-job.

A software-method testbed (no root needed): its broker, its coordinator (which
``up`` gives the state directory, so it may kill the testbed's agents) and three
agents. A 3-stage job (``stages=3``) posted with ``faults: ["kill:1@6"]`` has the
agent of stage 1 SIGKILLed once step 6 is reported; the job recovers over the two
survivors (a ``replan`` event says it runs two stages now, one per survivor) and
ends with every step's loss and the weights of a run without the fault: the
independent reference (:mod:`support.reference`) and the one-stage run, 1e-5.
A second, 2-stage job sees a device join. The testbed is downed after the test
and checked clean, the joined-or-not agents too.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import safetensors.torch
from support.markers import needs_mosquitto
from support.reference import ReferenceRun, assert_matches, train_reference

from coordinator.engine.runners import run_inprocess
from coordinator.engine.spec import JobSpec
from coordinator.planner.score import Plan
from coordinator.testbed.state import State, find_marked, proc_alive
from coordinator.testbed.testbed import StartOptions, Testbed, down
from edge.models.zoo import get_model
from edge.problem import DeviceSpec

pytestmark = [
    pytest.mark.slow,
    *needs_mosquitto,
]

STEPS = 14
# 18 MiB each: gpt-mini (batch 16) needs two devices, so the two survivors of the
# kill can still hold the model, but no one alone.
FLEET = [
    DeviceSpec(id=f"dev{i}", gflops=40, memory_bytes=18 * 2**20, bandwidth_mbps=1000, latency_ms=1)
    for i in range(3)
]
BODY: dict[str, Any] = {
    "model": "gpt-mini",
    "steps": STEPS,
    "batch_size": 16,
    "microbatches": 4,
    "seed": 3,
}


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    """A state directory whose testbed is downed (and checked clean) after the test."""
    where = tmp_path / "testbed"
    yield where
    state = State.load(where)
    down(where)
    if state is not None:
        left = [p.name for p in state.processes if proc_alive(p.pid, p.start)]
        assert left + [str(p.pid) for p in find_marked(state.token)] == []


def _finished(api: httpx.Client, job: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        record: dict[str, Any] = api.get(f"/api/v1/jobs/{job}").json()
        if record["state"] in ("completed", "failed", "cancelled"):
            return record
        assert time.monotonic() < deadline, record
        time.sleep(0.3)


def _events(api: httpx.Client, job: str, kind: str) -> list[dict[str, Any]]:
    events = api.get(f"/api/v1/jobs/{job}/events").json()["events"]
    return [e["detail"] for e in events if e["kind"] == kind]


def test_kill_and_join_faults_posted_to_a_testbed_job(state_dir: Path) -> None:
    start = StartOptions(method="software", measure_s=0.3)
    with Testbed.up(FLEET, state_dir=state_dir, start=start) as bed:
        assert bed.coordinator_url is not None and bed.api_token is not None
        auth = {"Authorization": f"Bearer {bed.api_token}"}
        with httpx.Client(base_url=bed.coordinator_url, timeout=30, headers=auth) as api:
            body = {**BODY, "stages": 3, "replicate_every": 2, "faults": ["kill:1@6"]}
            created = api.post("/api/v1/jobs", json=body)
            assert created.status_code == 201, created.text
            job = created.json()["id"]
            record = _finished(api, job, 120)
            assert record["state"] == "completed", record["reason"]
            assert record["steps_done"] == STEPS
            steps = api.get(f"/api/v1/jobs/{job}/metrics").json()["steps"]
            assert [s["step"] for s in steps] == list(range(STEPS))
            assert all(s["loss"] is not None for s in steps)
            # One loss a step: the last stage's report (the redone step 6 is reported twice).
            losses = {s["step"]: s["loss"] for s in steps if s["loss"] is not None}
            trained = safetensors.torch.load(api.get(f"/api/v1/jobs/{job}/model").content)
            faults = _events(api, job, "fault")
            assert len(faults) == 1 and faults[0]["fired"] and "SIGKILL" in faults[0]["done"]
            victim = faults[0]["device"]
            assert [f["device"] for f in _events(api, job, "failure")] == [victim]
            # Killed once step 6 is reported: the first attempt finished step 6 (its losses
            # reach step 6), or under load step 7 too before the kill landed and the death
            # was seen. It rolls back to the newest replica complete by then (every 2 steps:
            # step 6, or 8 if step 7's had all come) and redoes what it finished past it.
            recoveries = _events(api, job, "recovery")
            assert len(recoveries) == 1, recoveries
            back, redo = recoveries[0]["rollback_to"], recoveries[0]["redo_steps"]
            assert back in (6, 8) and back + redo in (7, 8), recoveries
            resumed = _events(api, job, "resumed")
            assert resumed and 0 < resumed[0]["recovery_s"] < 60, resumed
            attempts = _events(api, job, "attempt")
            assert [len(a["devices"]) for a in attempts] == [3, 2], attempts
            assert attempts[0]["devices"][1] == victim
            assert victim not in attempts[1]["devices"]
            replan = _events(api, job, "replan")
            assert [(r["stages_asked"], r["stages"]) for r in replan] == [(3, 2)], replan
            assert len(record["plan"]["stages"]) == 2  # the plan it ended on
            state = State.load(state_dir)
            assert state is not None
            agent = next(p for p in state.processes if p.name == f"agent:{victim}")
            assert not proc_alive(agent.pid, agent.start)  # killed, by the coordinator
            assert all(proc_alive(p.pid, p.start) for p in state.processes if p is not agent)
            survivors = sorted({d.id for d in FLEET} - {victim})
            time.sleep(4)  # past the registry's heartbeat timeout: it still hears the fleet
            fleet = {d["id"]: d["state"] for d in api.get("/api/v1/devices").json()["data"]}
            assert sorted(d for d, s in fleet.items() if s == "online") == survivors, fleet

            # A device joins a second job: the testbed starts it and records it for down.
            body = {**BODY, "stages": 2, "steps": 4, "faults": ["join:laptop@1"]}
            created = api.post("/api/v1/jobs", json=body)
            assert created.status_code == 201, created.text
            job = created.json()["id"]
            assert created.json()["spec"]["replicate_every"] == 1  # implied by the faults
            second = _finished(api, job, 60)
            assert second["state"] == "completed", second["reason"]
            assert len(second["plan"]["stages"]) == 2
            deadline = time.monotonic() + 60
            while not (joined := _events(api, job, "joined")):
                assert time.monotonic() < deadline, _events(api, job, "fault")
                time.sleep(0.3)
            device = joined[0]["device"]  # named after the profile the catalogue resolved
            assert device.startswith("laptop-") and device.endswith("-joined-1"), joined
            assert joined == [{"device": device, "online": True}]
        state = State.load(state_dir)
        assert state is not None
        assert [d["id"] for d in state.devices][-1] == device
        new = next(p for p in state.processes if p.name == f"agent:{device}")
        assert proc_alive(new.pid, new.start)  # until down (the fixture checks it ends)
    got = [losses[t] for t in range(STEPS)]
    assert_matches(got, trained, train_reference("gpt-mini", steps=STEPS, batch_size=16, seed=3))
    one = run_inprocess(JobSpec(**BODY), Plan.of(("ref", 0, get_model("gpt-mini").num_units)))
    assert_matches(got, trained, ReferenceRun(one.losses, one.weights))
