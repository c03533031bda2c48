"""A job submitted through the REST API migrates exactly as an ``edgetrain train`` job does.

A real Mosquitto, three agent processes and the coordinator app: the job asks for
``replicate_every`` and injects ``slow:1@4:4`` (stage 1's device computes 4x
slower from step 4). The job engine's rebalancer sees the measured stage times
drift from the plan, moves units off the slowed device, and the job still ends
with the weights and losses of training without the fault (the independent
plain-PyTorch reference, 1e-4).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
from fastapi.testclient import TestClient
from support.markers import needs_mosquitto
from support.mosquitto import mosquitto_broker
from support.reference import assert_matches, train_reference
from support.waiting import until

from coordinator.local.fleet import LocalFleet
from coordinator.service.app import create_app
from coordinator.service.settings import Settings

pytestmark = [pytest.mark.slow, *needs_mosquitto]
STEPS = 30  # enough left after the fault for a move to pay


def _units(plan: list[dict[str, Any]], device: str) -> int:
    return sum(st["layers"][1] - st["layers"][0] for st in plan if st["device"] == device)


def test_a_service_job_with_a_slowed_device_migrates_with_the_same_result(
    tmp_path: Path,
) -> None:
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
    with mosquitto_broker() as broker:
        settings = Settings(broker_url=broker.url, data_dir=tmp_path / "coord")
        with (
            TestClient(create_app(settings)) as client,
            LocalFleet(3, broker.url, threads=1),
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
    # It moved because the slowed device measured slowest, and it moved work off it.
    assert max(move["compute_s"], key=move["compute_s"].get) == slowed
    assert _units(move["plan"], slowed) < _units(first, slowed)
    attempts = [e["detail"] for e in events if e["kind"] == "attempt"]
    assert len(attempts) >= 2 and attempts[1]["first_step"] == move["rollback_to"]
    # Every step's loss (the last report of a step redone after the move) and the weights.
    losses = {s["step"]: s["loss"] for s in steps if s["loss"] is not None}
    assert sorted(losses) == list(range(STEPS))
    reference = train_reference("gpt-mini", steps=STEPS, batch_size=16, seed=0, microbatches=4)
    assert_matches([losses[t] for t in range(STEPS)], trained, reference, rtol=1e-4, atol=1e-6)
