"""The coordinator dies mid-job (SIGKILL) and a new one finishes it, with the same weights.

A real ``edgetrain coordinator`` process, a real Mosquitto and three agents. The
job asks for three stages and for replication (``replicate_every``), so its
replicas are in the coordinator's data directory; the second coordinator, on the
same directory, cancels the attempt the first one left on the agents, waits for
them to be idle, plans the same three stages again, resumes from the newest step
the replicas cover, and ends with the weights of a run without the crash.
"""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest
import safetensors.torch
from support.coordinator import coordinator_process
from support.markers import needs_mosquitto
from support.mosquitto import mosquitto_broker
from support.reference import ReferenceRun, assert_matches, one_thread, train_reference
from support.waiting import until

from coordinator.engine.runners import run_inprocess
from coordinator.engine.spec import JobSpec
from coordinator.local.broker import free_port
from coordinator.local.fleet import LocalFleet
from coordinator.planner.score import Plan
from edge.models.zoo import get_model

pytestmark = [
    pytest.mark.slow,
    *needs_mosquitto,
]
STEPS = 40  # long enough that the kill (after step 8) lands mid-job


def test_a_restarted_coordinator_finishes_the_job(tmp_path: Path) -> None:
    port, data = free_port(), tmp_path / "coord"
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)

    def up() -> bool:
        try:
            return api.get("/healthz").status_code == 200
        except httpx.TransportError:
            return False

    def online() -> int:
        return sum(d["state"] == "online" for d in api.get("/api/v1/devices").json()["data"])

    def job_state(job: str) -> dict:  # type: ignore[type-arg]
        return api.get(f"/api/v1/jobs/{job}").json()  # type: ignore[no-any-return]

    body = {
        "model": "gpt-mini",
        "steps": STEPS,
        "batch_size": 16,
        "microbatches": 4,
        "seed": 2,
        "replicate_every": 2,
        "stages": 3,
    }
    data.mkdir()
    try:
        with (
            (data / "first.log").open("wb") as log,
            mosquitto_broker() as broker,
            LocalFleet(3, broker.url, threads=1),
        ):
            with coordinator_process(port, broker.url, data, stderr=log) as first:
                assert until(up, 60) and until(lambda: online() == 3, 60)
                job = api.post("/api/v1/jobs", json=body).json()["id"]
                assert until(lambda: (job_state(job).get("steps_done") or 0) >= 8, 120), (
                    job_state(job),
                    api.get(f"/api/v1/jobs/{job}/events").json(),
                    (data / "first.log").read_text()[-4000:],
                )
                assert len(job_state(job)["plan"]["stages"]) == 3
                first.send_signal(signal.SIGKILL)
                first.wait(10)
            with coordinator_process(port, broker.url, data):
                assert until(up, 60)
                assert until(lambda: job_state(job)["state"] in ("completed", "failed"), 180)
                record = job_state(job)
                assert record["state"] == "completed", record["reason"]
                trained = safetensors.torch.load(api.get(f"/api/v1/jobs/{job}/model").content)
                steps = api.get(f"/api/v1/jobs/{job}/metrics").json()["steps"]
                assert sorted({s["step"] for s in steps}) == list(range(STEPS))
                events = api.get(f"/api/v1/jobs/{job}/events").json()["events"]
                attempts = [e["detail"] for e in events if e["kind"] == "attempt"]
                assert len(attempts) >= 2 and attempts[-1]["first_step"] >= 6, events  # resumed
                # Before and after the crash: three stages, on the three agents.
                assert all(len(set(a["devices"])) == 3 for a in attempts), attempts
                assert len(record["plan"]["stages"]) == 3, record["plan"]
                assert not [e for e in events if e["kind"] == "replan"], events
                resumed = [s for s in steps if s["step"] >= attempts[-1]["first_step"]]
                assert all({r["stage"] for r in s["stages"]} == {0, 1, 2} for s in resumed)
    finally:
        api.close()
    # Every step's loss (the last report of a step redone after the crash) and the weights:
    # the independent reference's and the one-stage run's (on one thread, as the agents). Over
    # 40 steps rounding grows: the reference accumulates over the job's 4 microbatches, as
    # the stages do, so that it rounds as they do.
    losses = {s["step"]: s["loss"] for s in steps if s["loss"] is not None}
    got = [losses[t] for t in range(STEPS)]
    independent = train_reference("gpt-mini", steps=STEPS, batch_size=16, seed=2, microbatches=4)
    assert_matches(got, trained, independent)
    spec = JobSpec.model_validate(
        {k: v for k, v in body.items() if k not in ("replicate_every", "stages")}
    )
    with one_thread():
        one = run_inprocess(spec, Plan.of(("ref", 0, get_model("gpt-mini").num_units)))
    assert_matches(got, trained, ReferenceRun(one.losses, one.weights))
