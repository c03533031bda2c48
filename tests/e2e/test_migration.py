"""Jobs migrate to a faster plan and still train exactly (coordinator/engine/rebalance.py).

- A faster device that joins mid-job (``join:laptop@2``) is taken in: the job
  engine's rebalancer weighs the measured stage times against a plan that uses
  it, moves units onto it, and the job ends with the weights of a run that never
  moved.
- A job submitted through the REST API migrates exactly as an ``edgetrain
  train`` job does (tests/e2e/test_fault_tolerance.py has that one): with
  ``replicate_every`` and ``slow:1@4:4`` (stage 1's device computes 4x slower
  from step 4) the engine moves units off the slowed device, and the job still
  ends with the weights and losses of training without the fault (the
  independent plain-PyTorch reference, 1e-4).

Real agent processes and a real Mosquitto in both.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import safetensors.torch
from fastapi.testclient import TestClient
from support.faults import (
    HEARTBEAT_S,
    assert_same_training,
    derived_rollback,
    even_plan,
    events_of,
    flops_of,
)
from support.markers import needs_mosquitto
from support.mosquitto import Broker
from support.reference import assert_matches, train_reference
from support.waiting import until

from coordinator.engine.faults import FaultInjector, parse_fault
from coordinator.engine.options import RunOptions
from coordinator.engine.rebalance import Rebalancer
from coordinator.engine.resilient import Resilience, ResilientRun
from coordinator.engine.spec import JobSpec
from coordinator.local.fleet import AgentRoles, LocalFleet
from coordinator.planner.build import build_problem
from coordinator.service.app import create_app
from coordinator.service.settings import Settings
from edge.problem import PlanningProblem
from edge.transport.mqtt import MqttSettings, MqttTransport

pytestmark = [pytest.mark.slow, *needs_mosquitto]
# The service job: enough steps left after the fault for a move to pay twice over by the
# rebalancer's own figures (at 30 it was break-even, about 1.9 s saved against 1.8 s of
# moving, so whether it moved was a coin toss).
STEPS = 60


@pytest.fixture
def broker(mosquitto: Broker) -> str:
    return mosquitto.url


def test_a_faster_device_that_joins_is_taken_in(broker: str) -> None:
    # The join takes seconds, and under load 30 steps or more go by before the laptop is
    # online. At batch 16 the move saved about 0.02 s a step (the devices' own seconds,
    # the same on a busy host) against about 1.1 s of moving: break-even by then. Batch
    # 32 doubles the saving, so the move pays twice over even after a slow join (more
    # steps would do too, but rounding past 80 steps outgrows the tolerance below).
    model, steps, batch = "gpt-mini", 80, 32
    spec = JobSpec(model=model, steps=steps, batch_size=batch, microbatches=4, seed=5)
    control = MqttTransport(MqttSettings(url=broker))
    control.connect(10)
    try:
        # Two agents announcing a Raspberry Pi 4; a laptop (30x the Pi) joins at step 2.
        with LocalFleet(2, broker, threads=1, roles=AgentRoles(profiles=["rpi4-4gb"] * 2)) as fleet:
            profiles = fleet.wait_online(control, timeout=90)
            members = list(fleet.ids)

            def problem_for(alive: list[str]) -> PlanningProblem:
                return build_problem(
                    model,
                    [profiles[d] for d in alive],
                    batch_size=batch,
                    microbatches=4,
                    pin_first=alive[0],
                )

            def join() -> None:  # its own connection: one callback per topic filter
                device = fleet.add("laptop")
                watcher = MqttTransport(MqttSettings(url=broker))
                watcher.connect(10)
                try:
                    profiles.update(fleet.wait_online(watcher, timeout=60))
                finally:
                    watcher.close()
                members.append(device)

            injector = FaultInjector(
                [parse_fault("join:laptop@2")],
                lambda _f, _d: threading.Thread(target=join, daemon=True).start(),
            )
            got = ResilientRun(
                spec,
                control,
                lambda alive: even_plan(alive, 6),
                members,
                resilience=Resilience(
                    replicate_every=2,
                    faults=injector,
                    rebalance=Rebalancer(problem_for, replicate_every=2),
                ),
                options=RunOptions(timeout_s=300, heartbeat_timeout_s=HEARTBEAT_S),
            ).run(even_plan(members, 6))
    finally:
        control.close()
    attempts = events_of(got.events, "attempt")
    assert len(attempts[0]["plan"]) == 2
    assert [(e["fault"], e["step"]) for e in events_of(got.events, "fault")] == [
        ("join:laptop@2", 2)
    ]
    migrations = events_of(got.events, "migration")
    assert migrations, got.events
    assert any(st["device"] == fleet.ids[2] for st in migrations[-1]["plan"])
    assert len(migrations[-1]["plan"]) >= 2  # stage 0 is pinned to the first Pi
    assert got.rolled_back_steps == derived_rollback(got.events)
    assert got.steps_completed == steps
    # Rounding grows past 1e-7 on embedding rows near zero (3e-7 measured over 80 steps),
    # so 1e-6 absolute; still 1e-5 relative.
    assert_same_training(
        got.result.losses, got.result.weights, model, steps, atol=1e-6, batch_size=batch
    )


def test_a_service_job_with_a_slowed_device_migrates_with_the_same_result(
    broker: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="coordinator.engine.rebalance")  # shown on failure
    body = {
        "model": "gpt-mini",
        "steps": STEPS,
        "batch_size": 16,
        "microbatches": 4,
        "seed": 0,
        "partition": "even",
        "stages": 3,
        "replicate_every": 2,
        "faults": ["slow:1@4:4"],
    }
    settings = Settings(
        broker_url=broker, data_dir=tmp_path / "coord", allowed_hosts=["testserver"]
    )
    with (
        TestClient(create_app(settings)) as client,
        LocalFleet(3, broker, threads=1),
    ):

        def online() -> int:
            devices = client.get("/api/v1/devices").json()["data"]
            return sum(d["state"] == "online" for d in devices)

        def state(job: str) -> str:
            return str(client.get(f"/api/v1/jobs/{job}").json()["state"])

        assert until(lambda: online() == 3, 60)
        created = client.post("/api/v1/jobs", json=body)
        assert created.status_code == 201, created.text
        job = created.json()["id"]
        assert until(lambda: state(job) in ("completed", "failed", "cancelled"), 300)
        record = client.get(f"/api/v1/jobs/{job}").json()
        assert record["state"] == "completed", record["reason"]
        events = client.get(f"/api/v1/jobs/{job}/events").json()["events"]
        trained = safetensors.torch.load(client.get(f"/api/v1/jobs/{job}/model").content)
        steps = client.get(f"/api/v1/jobs/{job}/metrics").json()["steps"]
    kinds = [e["kind"] for e in events]
    assert "failure" not in kinds and "recovery" not in kinds, kinds  # nothing died
    first = record["plan"]["stages"]
    assert len(first) == 3
    slowed = first[1]["device"]
    fired = [e["detail"] for e in events if e["kind"] == "fault"]
    assert [(f["fault"], f["device"], f["fired"]) for f in fired] == [("slow:1@4:4", slowed, True)]
    migrations = [e["detail"] for e in events if e["kind"] == "migration"]
    assert migrations, kinds
    move = migrations[0]
    # It moved after the fault, because the slowed device measured slowest, and it moved
    # work off it.
    assert kinds.index("fault") < kinds.index("migration"), kinds
    assert max(move["compute_s"], key=move["compute_s"].get) == slowed
    assert flops_of(move["plan"], slowed, "gpt-mini") < flops_of(first, slowed, "gpt-mini")
    attempts = [e["detail"] for e in events if e["kind"] == "attempt"]
    assert len(attempts) >= 2 and attempts[1]["first_step"] == move["rollback_to"]
    # Every step's loss (the last report of a step redone after the move) and the weights.
    losses = {s["step"]: s["loss"] for s in steps if s["loss"] is not None}
    assert sorted(losses) == list(range(STEPS))
    reference = train_reference("gpt-mini", steps=STEPS, batch_size=16, seed=0, microbatches=4)
    assert_matches([losses[t] for t in range(STEPS)], trained, reference, rtol=1e-4, atol=1e-6)
