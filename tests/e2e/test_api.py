"""The REST API over a real broker and real agents: submit, run, fetch metrics, model and ONNX.

Every job that runs asks for ``stages`` and is checked to run that many: the
planner alone would put these small models on one device.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
import safetensors.torch
from fastapi.testclient import TestClient
from pydantic import SecretStr
from support.markers import needs_mosquitto
from support.mosquitto import mosquitto_broker
from support.reference import assert_matches, train_reference
from support.waiting import until

from coordinator.local.fleet import LocalFleet
from coordinator.service.app import create_app
from coordinator.service.export import check_onnx
from coordinator.service.settings import Settings
from edge import __version__

pytestmark = needs_mosquitto
TOKEN = "s3cret-token-for-the-tests"
IN_PROCESS = ["testserver"]
"""The Host of FastAPI's TestClient, which the app must be told to answer."""


@pytest.mark.slow
def test_job_over_http_runs_a_three_stage_pipeline(tmp_path: Path) -> None:
    """A 3-stage job on three agents, through the API from submission to ONNX; its weights
    are the independent reference's (a plain PyTorch loop, 1e-5)."""
    with mosquitto_broker() as broker:
        settings = Settings(
            broker_url=broker.url,
            data_dir=tmp_path / "coord",
            api_token=SecretStr(TOKEN),
            allowed_hosts=IN_PROCESS,
        )
        auth = {"Authorization": f"Bearer {TOKEN}"}
        with (
            TestClient(create_app(settings)) as client,
            LocalFleet(3, broker.url, threads=1) as fleet,
        ):
            assert client.get("/healthz").json()["status"] == "ok"

            def online() -> int:
                return sum(
                    d["state"] == "online" for d in client.get("/api/v1/devices").json()["data"]
                )

            assert until(lambda: online() == 3, 60)
            body = {
                "model": "cnn-digits",
                "steps": 6,
                "batch_size": 16,
                "microbatches": 4,
                "stages": 3,
            }
            assert client.post("/api/v1/jobs", json=body).status_code == 401
            bad = client.post("/api/v1/jobs", json={**body, "microbatches": 5}, headers=auth)
            assert bad.status_code == 422
            assert (
                client.post(
                    "/api/v1/jobs", json={**body, "model": "nope"}, headers=auth
                ).status_code
                == 422
            )
            for extra, why in (
                ({"stages": 5}, "stages=5 is more than the 4 units of cnn-digits"),
                ({"stages": 0}, "greater than or equal to 1"),
                ({"stages": 3, "devices": ["a", "b"]}, "stages=3 is more than the 2 devices"),
                ({"partition": "random"}, "'plan' or 'even'"),
            ):
                refused = client.post("/api/v1/jobs", json={**body, **extra}, headers=auth)
                assert refused.status_code == 422, refused.text
                (detail,) = refused.json()["detail"]
                assert detail["loc"][:2] == ["body", next(iter(extra))], detail
                assert why in detail["msg"], detail
            assert client.get("/api/v1/jobs/doesnotexist").status_code == 404
            created = client.post("/api/v1/jobs", json=body, headers=auth)
            assert created.status_code == 201, created.text
            job = created.json()["id"]
            assert until(
                lambda: (
                    client.get(f"/api/v1/jobs/{job}").json()["state"] in ("completed", "failed")
                ),
                120,
            )
            record = client.get(f"/api/v1/jobs/{job}").json()
            assert record["state"] == "completed", record["reason"]
            assert record["plan"]["feasible"] is True
            stages = record["plan"]["stages"]
            assert len(stages) == 3 and {s["device"] for s in stages} == set(fleet.ids)
            assert all(s["devices"] == [s["device"]] and s["shares"] == [1.0] for s in stages)
            assert record["plan"]["stages_asked"] == 3 and record["plan"]["partition"] == "plan"
            spec_step = record["plan"].get("spec", record["plan"])["step_time_s"]
            assert 0 < record["plan"]["lower_bound_step_s"] <= spec_step  # its certificate
            metrics = client.get(f"/api/v1/jobs/{job}/metrics").json()["steps"]
            assert [m["step"] for m in metrics] == list(range(6))
            assert all(m["loss"] is not None for m in metrics)
            # Every stage reported every step, each from its own device.
            assert all(
                sorted((r["stage"], r["device"]) for r in m["stages"])
                == [(s, stages[s]["device"]) for s in range(3)]
                for m in metrics
            )
            # Where its steps went: the plan's predicted parts, and the measured ones over
            # the steps between the first (warm-up) and the last (no next start).
            parts = client.get(f"/api/v1/jobs/{job}/anatomy").json()
            devices = [s["device"] for s in stages]
            for side in ("predicted", "measured"):
                got = parts[side]
                assert [m["device"] for m in got["members"]] == devices, side
                for m in got["members"]:
                    total = sum(m[p] for p in got["parts"])
                    assert total == pytest.approx(got["step_time_s"], rel=0.25), (side, m)
            assert parts["predicted"]["step_time_s"] == pytest.approx(
                record["plan"]["step_time_s"], rel=1e-9
            )
            assert parts["measured"]["steps"] == 6 - 2
            assert client.get("/api/v1/jobs/doesnotexist/anatomy").status_code == 404
            weights = client.get(f"/api/v1/jobs/{job}/model")
            assert weights.status_code == 200
            tensors = safetensors.torch.load(weights.content)
            losses = [m["loss"] for m in metrics]
            assert_matches(losses, tensors, train_reference("cnn-digits", steps=6, batch_size=16))
            exported = client.get(f"/api/v1/jobs/{job}/model.onnx")
            assert exported.status_code == 200
            onnx.checker.check_model(onnx.load_from_string(exported.content))
            assert check_onnx(exported.content, "cnn-digits", tensors) < 1e-4
            prom = client.get("/metrics").text
            assert "edgetrain_devices_online 3.0" in prom
            assert f'edgetrain_build_info{{version="{__version__}"}} 1.0' in prom
            assert "\nprocess_cpu_seconds_total " in prom
            assert client.get("/openapi.json").status_code == 200

            # Four stages on three devices: the job fails at planning, saying why.
            even = client.post(
                "/api/v1/jobs", json={**body, "stages": 4, "partition": "even"}, headers=auth
            ).json()["id"]
            assert until(lambda: client.get(f"/api/v1/jobs/{even}").json()["state"] == "failed", 60)
            refused = client.get(f"/api/v1/jobs/{even}").json()
            assert refused["state"] == "failed" and refused["plan"] is None
            assert refused["reason"].startswith("stages=4 needs 4 devices; "), refused["reason"]


def test_what_if_plan_needs_no_devices_online(tmp_path: Path) -> None:
    with mosquitto_broker() as broker:
        settings = Settings(
            broker_url=broker.url, data_dir=tmp_path / "coord", allowed_hosts=IN_PROCESS
        )
        with TestClient(create_app(settings)) as client:
            body = {
                "model": "vgg11",
                "devices": ["rpi4-4gb:2", "jetson-nano", "laptop"],
                "batch_size": 64,
                "microbatches": 8,
            }
            plan = client.post("/api/v1/plans", json=body)
            assert plan.status_code == 200, plan.text
            out = plan.json()
            assert out["feasible"] is True and out["throughput_sps"] > 0
            assert set(out["baselines"]) == {"single", "even", "pipedream", "ftpipehd"}
            assert all(
                out["step_time_s"] <= b["step_time_s"] * (1 + 1e-9)
                for b in out["baselines"].values()
                if b["feasible"]
            )
            assert out["simulation"]["timeline"]
            bad = client.post("/api/v1/plans", json={**body, "devices": ["rpi9"]})
            assert bad.status_code == 422 and "rpi9" in bad.text
            assert client.post("/api/v1/plans", json={**body, "batch_size": -1}).status_code == 422


@pytest.mark.slow
def test_restart_keeps_devices_jobs_and_metrics_and_fails_the_interrupted_job(
    tmp_path: Path,
) -> None:
    data = tmp_path / "coord"
    with mosquitto_broker() as broker, LocalFleet(2, broker.url, threads=1) as fleet:
        settings = Settings(broker_url=broker.url, data_dir=data, allowed_hosts=IN_PROCESS)
        with TestClient(create_app(settings)) as client:
            assert until(lambda: client.get("/api/v1/devices").json()["count"] == 2, 60)
            assert until(
                lambda: client.get(f"/api/v1/devices/{fleet.ids[0]}").json()["state"] == "online",
                30,
            )
            assert until(
                lambda: client.get(f"/api/v1/devices/{fleet.ids[1]}").json()["state"] == "online",
                30,
            )
            short = {"model": "mlp", "steps": 3, "batch_size": 8, "microbatches": 2, "stages": 2}
            done = client.post("/api/v1/jobs", json=short).json()["id"]
            assert until(
                lambda: client.get(f"/api/v1/jobs/{done}").json()["state"] == "completed", 60
            )
            assert len(client.get(f"/api/v1/jobs/{done}").json()["plan"]["stages"]) == 2
            long = {
                "model": "gpt-mini",
                "steps": 5000,
                "batch_size": 8,
                "microbatches": 2,
                "stages": 2,
            }
            running = client.post("/api/v1/jobs", json=long).json()["id"]
            assert until(
                lambda: client.get(f"/api/v1/jobs/{running}").json()["steps_done"] >= 2, 90
            )
            assert len(client.get(f"/api/v1/jobs/{running}").json()["plan"]["stages"]) == 2
        # The coordinator is gone mid-job; a new one opens the same data directory.
        with TestClient(create_app(settings)) as client:
            interrupted = client.get(f"/api/v1/jobs/{running}").json()
            assert interrupted["state"] == "failed"
            assert interrupted["reason"] == "coordinator restarted"
            assert client.get(f"/api/v1/jobs/{done}").json()["state"] == "completed"
            steps = client.get(f"/api/v1/jobs/{done}/metrics").json()["steps"]
            assert len(steps) == 3
            assert client.get(f"/api/v1/devices/{fleet.ids[0]}").status_code == 200
