"""Jobs the planner puts on device groups, end to end, over MQTT.

Four agents announce the same slow catalogue device (``rpi4-4gb``) and the model is
cnn-digits at twice its width, whose compute outweighs its links there: the planner's
best plan, with nothing asked of it but the model, is two stages, the first on a group
of three devices (data-parallel), and beats every plan of one-device stages by the score
(the service's agents here announce the catalogue figures and no fixed costs; through
``train`` they emulate the Pis and measure theirs, and the job is sized so that a group
still wins). Through ``edgetrain train`` and through the REST API the job runs that plan
on real agent processes and a real Mosquitto, and its losses and weights equal a plain
PyTorch loop's within 1e-5 (:mod:`support.reference`). On a fleet of unequal devices
(two Pi 4s and a Pi 5) the job engine hands the agents the plan's shares, and each
member runs its own rows of every microbatch (:mod:`support.shares`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
from fastapi.testclient import TestClient
from support.markers import needs_mosquitto
from support.mosquitto import mosquitto_broker
from support.reference import ReferenceRun, assert_matches, train_reference
from support.shares import assert_ran_planned_shares
from support.waiting import until

from coordinator.engine.spec import JobSpec
from coordinator.local.fleet import AgentRoles, LocalFleet
from coordinator.local.options import LocalTraining
from coordinator.local.train import train_on_local_fleet
from coordinator.service.app import create_app
from coordinator.service.settings import Settings

pytestmark = [*needs_mosquitto, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
PI = "rpi4-4gb"
JOB: dict[str, Any] = {
    "model": "cnn-digits",
    "model_options": {"width": 32},
    "steps": 3,
    "batch_size": 16,
    "microbatches": 2,
    "seed": 1,
}


def _reference() -> ReferenceRun:
    return train_reference(
        "cnn-digits", steps=3, batch_size=16, seed=1, model_options={"width": 32}, microbatches=2
    )


def _grouped(stages: list[dict[str, Any]]) -> None:
    """The plan is a hybrid: a group of three Pis trains the first units data-parallel and
    feeds the fourth Pi's stage; every stage lists its members and their shares."""
    assert [len(st["devices"]) for st in stages] == [3, 1], stages
    for st in stages:
        assert len(st["devices"]) == len(st["shares"]) and sum(st["shares"]) == pytest.approx(1)
    assert stages[0]["layers"][0] == 0 and stages[-1]["layers"][1] == 4


def test_train_runs_the_planners_group_plan(tmp_path: Path) -> None:
    """Through ``train`` the agents emulate the Pis and measure their fixed costs, so the
    internal model chooses (Planning: the cost model): at four times the width and 128
    samples a microbatch, compute outweighs moving the gradients by a clear margin (a
    group of four predicted 2.5x faster than one device here, so a loaded machine's
    dearer gradient sums do not flip the choice, as they did at 32 samples) and the
    planner trains on a group."""
    out = tmp_path / "trained.safetensors"
    args = ["--model", "cnn-digits", "-o", "width=64", "--steps", "3", "--batch-size", "256"]
    args += ["--microbatches", "2", "--seed", "1", "--threads", "1", "--json"]
    args += ["--devices", ",".join([PI] * 4), "--save-weights", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "edgetrain.cli", "train", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout)
    assert got["transport"] == "mqtt"
    stages = got["plan"]["stages"]
    assert max(len(st["devices"]) for st in stages) >= 2, stages  # a group, not a chain
    for st in stages:
        assert len(st["devices"]) == len(st["shares"]) and sum(st["shares"]) == pytest.approx(1)
    reference = train_reference(
        "cnn-digits", steps=3, batch_size=256, seed=1, model_options={"width": 64}, microbatches=2
    )
    assert_matches(got["losses"], safetensors.torch.load_file(str(out)), reference)


def test_a_rest_job_runs_the_planners_group_plan(tmp_path: Path) -> None:
    with mosquitto_broker() as broker:
        settings = Settings(
            broker_url=broker.url, data_dir=tmp_path / "coord", allowed_hosts=["testserver"]
        )
        with (
            TestClient(create_app(settings)) as client,
            LocalFleet(4, broker.url, threads=1, roles=AgentRoles(profiles=[PI] * 4)) as fleet,
        ):

            def online() -> int:
                devices = client.get("/api/v1/devices").json()["data"]
                return sum(d["state"] == "online" for d in devices)

            assert until(lambda: online() == 4, 90)
            created = client.post("/api/v1/jobs", json=JOB)
            assert created.status_code == 201, created.text
            job = created.json()["id"]
            assert until(
                lambda: (
                    client.get(f"/api/v1/jobs/{job}").json()["state"] in ("completed", "failed")
                ),
                240,
            )
            record = client.get(f"/api/v1/jobs/{job}").json()
            assert record["state"] == "completed", record["reason"]
            stages = record["plan"]["stages"]
            _grouped(stages)
            assert {d for st in stages for d in st["devices"]} <= set(fleet.ids)
            assert (
                record["plan"]["baselines"]["pipeline-only"]["throughput_sps"]
                < (record["plan"]["throughput_sps"])
            )
            metrics = client.get(f"/api/v1/jobs/{job}/metrics").json()["steps"]
            losses = [m["loss"] for m in metrics]
            weights = safetensors.torch.load(client.get(f"/api/v1/jobs/{job}/model").content)
            assert_matches(losses, weights, _reference())


def test_the_engine_hands_real_agents_the_plans_unequal_shares() -> None:
    """Two Pi 4s and a Pi 5, emulated by agent processes that measure their fixed costs,
    driven by the job engine as ``train`` and the service drive them: the planner groups
    them, the Pi 5 taking about three times a Pi 4's rows, and the agents run exactly the
    planned rows (equal ones would still train exactly, only slower)."""
    options = {"width": 64}
    spec = JobSpec(
        model="cnn-digits",
        model_options=options,
        steps=2,
        batch_size=256,
        microbatches=2,
        seed=1,
    )
    run = train_on_local_fleet(
        LocalTraining(spec=spec, devices=3, threads=1, profiles=["rpi4", "rpi4", "rpi5"])
    )
    assert_ran_planned_shares(run.result, run.score.shares, spec.batch_size, spec.microbatches)
    reference = train_reference(
        "cnn-digits", steps=2, batch_size=256, seed=1, model_options=options, microbatches=2
    )
    assert_matches(run.result.losses, run.result.weights, reference)
