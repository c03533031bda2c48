"""Faults in a job posted to the API: which are refused (422, one line naming the fault) and why.

A real coordinator app over a real Mosquitto, no agents: the checks happen when
the job is submitted. A plain coordinator takes only ``slow`` faults; one given a
testbed's state directory also takes ``kill``, and ``join`` when that testbed
uses the software method. No job runs here (there are no agents), so no plan has
stages to count: a fault's stage is checked against the job's ``stages`` instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from support.mosquitto import Broker

from coordinator.service.app import create_app
from coordinator.service.settings import Settings
from coordinator.testbed.state import State

pytestmark = pytest.mark.broker

BODY: dict[str, Any] = {"model": "mlp", "steps": 20, "batch_size": 8, "microbatches": 2}


def _refusal(client: TestClient, **extra: Any) -> tuple[list[Any], str]:
    response = client.post("/api/v1/jobs", json={**BODY, **extra})
    assert response.status_code == 422, response.text
    (detail,) = response.json()["detail"]
    return detail["loc"], detail["msg"]


def test_a_plain_coordinator_refuses_bad_kill_and_join_faults(
    mosquitto: Broker, tmp_path: Path
) -> None:
    settings = Settings(
        broker_url=mosquitto.url, data_dir=tmp_path / "coord", allowed_hosts=["testserver"]
    )
    with TestClient(create_app(settings)) as client:
        loc, msg = _refusal(client, faults=["kill:1@4", "kill:x@2"])
        assert (
            loc == ["body", "faults", 1]
            and "fault 'kill:x@2': expected kill:STAGE[.MEMBER]@STEP" in msg
        )
        loc, msg = _refusal(client, faults=["slow:0@4:0.5"])
        assert "FACTOR must be between 1 and 1000" in msg
        loc, msg = _refusal(client, faults=["kill:1@20"])
        assert loc == ["body", "faults", 0] and "step 20 is not below the job's 20 steps" in msg
        loc, msg = _refusal(client, faults=["slow:2@3:2"], devices=["a", "b"])
        assert "stage 2 is not below the 2 devices allowed" in msg
        loc, msg = _refusal(client, faults=["slow:2@3:2"], stages=2)
        assert loc == ["body", "faults", 0] and "stage 2 is not below the job's 2 stages" in msg
        loc, msg = _refusal(client, stages=4, faults=["slow:0@3:2"])
        assert loc == ["body", "stages"] and msg == "stages=4 is more than the 3 units of mlp"
        _, msg = _refusal(client, faults=["slow:0@3:2"], replicate_every=0)
        assert "faults need fault tolerance" in msg
        for fault in ("kill:1@4", "join:laptop@4"):
            loc, msg = _refusal(client, faults=["slow:0@2:3", fault])
            assert loc == ["body", "faults", 1], msg
            kind = fault.split(":")[0]
            assert f"fault {fault!r}: {kind} faults need a testbed coordinator" in msg
            assert "--testbed-state" in msg and "\n" not in msg
        assert client.get("/api/v1/jobs").json()["count"] == 0  # nothing was queued

        created = client.post("/api/v1/jobs", json={**BODY, "faults": ["slow:0@3:2.5"]})
        assert created.status_code == 201, created.text
        spec = created.json()["spec"]
        assert spec["faults"] == ["slow:0@3:2.5"] and spec["replicate_every"] == 2  # 20 // 10
        plain = client.post("/api/v1/jobs", json=BODY).json()["spec"]
        assert plain["faults"] == [] and plain["replicate_every"] == 0


def test_a_testbed_coordinator_takes_kill_and_join_faults(
    mosquitto: Broker, tmp_path: Path
) -> None:
    bed = tmp_path / "testbed"
    settings = Settings(
        broker_url=mosquitto.url,
        data_dir=tmp_path / "coord",
        testbed_state=bed,
        allowed_hosts=["testserver"],  # the TestClient's Host
    )
    with TestClient(create_app(settings)) as client:
        _, msg = _refusal(client, faults=["kill:1@4"])
        assert msg == f"fault 'kill:1@4': kill faults: no running testbed in {bed.resolve()}"
        state = State(dir=bed, id="ab12", token="t0k3n", phase="up", method="kernel")
        state.save()
        _, msg = _refusal(client, faults=["join:laptop@4"])
        assert "join faults need a software-method testbed" in msg
        state.method = "software"
        state.save()
        _, msg = _refusal(client, faults=["join:toaster@4"])
        assert "unknown device profile 'toaster'" in msg
        body = {**BODY, "faults": ["kill:1@4", "join:laptop@6"], "replicate_every": 3}
        created = client.post("/api/v1/jobs", json=body)
        assert created.status_code == 201, created.text
        assert created.json()["spec"]["faults"] == ["kill:1@4", "join:laptop@6"]
