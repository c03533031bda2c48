"""The coordinator as its own process: ``edgetrain coordinator``, a real Mosquitto, two agents.

The job is an even split over both agents (``partition="even"``): a real 2-stage pipeline.
The process's standard error is JSON lines: uvicorn's, the job's end, and an agent
killed afterwards going offline.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import onnx
import pytest
import safetensors.torch
from support.coordinator import coordinator_process
from support.markers import needs_mosquitto
from support.mosquitto import mosquitto_broker
from support.waiting import until

from coordinator.local.broker import free_port
from coordinator.local.fleet import LocalFleet
from coordinator.service.export import check_onnx

pytestmark = needs_mosquitto
TOKEN = "another-long-test-token-123"


def _json_lines(path: Path) -> list[dict[str, Any]]:
    """The complete lines written so far, each parsed (a line that is not JSON fails)."""
    text = path.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


@pytest.mark.slow
def test_job_submitted_over_http_to_a_coordinator_process(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "coordinator.log"
    with (
        mosquitto_broker() as broker,
        LocalFleet(2, broker.url, threads=1) as fleet,
        log.open("wb") as stderr,
        coordinator_process(port, broker.url, tmp_path / "coord", token=TOKEN, stderr=stderr),
    ):
        api = httpx.Client(
            base_url=f"http://127.0.0.1:{port}",
            timeout=30,
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        try:

            def ready() -> bool:
                try:
                    return api.get("/healthz").status_code == 200
                except httpx.TransportError:
                    return False

            assert until(ready, 60), log.read_text()[-3000:]

            def online() -> int:
                return sum(
                    d["state"] == "online" for d in api.get("/api/v1/devices").json()["data"]
                )

            assert until(lambda: online() == 2, 60)
            body = {
                "model": "mlp",
                "steps": 5,
                "batch_size": 16,
                "microbatches": 4,
                "partition": "even",
            }
            job = api.post("/api/v1/jobs", json=body).json()["id"]
            assert until(
                lambda: api.get(f"/api/v1/jobs/{job}").json()["state"] in ("completed", "failed"),
                120,
            )
            record = api.get(f"/api/v1/jobs/{job}").json()
            assert record["state"] == "completed", record["reason"]
            plan = record["plan"]
            assert [st["layers"] for st in plan["stages"]] == [[0, 2], [2, 3]], plan
            assert plan["method"] == "even split over 2 devices"
            steps = api.get(f"/api/v1/jobs/{job}/metrics").json()["steps"]
            assert [s["step"] for s in steps] == list(range(5))
            assert all(sorted(r["stage"] for r in s["stages"]) == [0, 1] for s in steps)
            weights = safetensors.torch.load(api.get(f"/api/v1/jobs/{job}/model").content)
            exported = api.get(f"/api/v1/jobs/{job}/model.onnx").content
            onnx.checker.check_model(onnx.load_from_string(exported))
            assert check_onnx(exported, "mlp", weights) < 1e-4

            # Its logs: JSON lines, uvicorn's too, with the job's end and a device lost.
            fleet.kill(fleet.ids[0])

            def offline() -> bool:
                return any(
                    line.get("device") == fleet.ids[0] and line["msg"].endswith("-> offline")
                    for line in _json_lines(log)
                )

            assert until(offline, 30), log.read_text()[-3000:]
            lines = _json_lines(log)
            assert {"ts", "level", "logger", "msg"} <= set(lines[0]), lines[0]
            ended = [line for line in lines if line.get("job") == job]
            assert ended[-1]["msg"] == f"job {job} completed", ended
            assert ended[-1]["logger"] == "coordinator.service.manager"
            assert any(
                (line["logger"], line["msg"]) == ("uvicorn.error", "Application startup complete.")
                for line in lines
            )
        finally:
            api.close()
