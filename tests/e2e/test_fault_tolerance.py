"""Devices die mid-run and training goes on, with the same result (coordinator/resilient.py).

Real agent processes killed with SIGKILL, a real Mosquitto: the broker sends the
dead agent's last will, the coordinator re-plans over the survivors, every stage
rolls back to the newest step whose replicas cover the model, and the run ends
with the parameters of a run without faults (1e-4 relative) and every step's loss.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import safetensors.torch
import torch
from support.mosquitto import find_mosquitto, mosquitto_broker

from coordinator.broker import start_broker
from coordinator.faults import Fault, FaultInjector, parse_fault
from coordinator.jobs import JobSpec
from coordinator.localfleet import LocalFleet
from coordinator.planner.build import build_problem
from coordinator.planner.score import Plan
from coordinator.rebalance import Rebalancer
from coordinator.resilient import run_resilient
from coordinator.runners import run_inprocess
from edge.errors import UserError
from edge.messages import StepReport
from edge.models.zoo import get_model
from edge.problem import PlanningProblem
from edge.transport.mqtt import MqttSettings, MqttTransport

pytestmark = pytest.mark.slow

STEPS = 12
_REFERENCE: dict[str, tuple[list[float], dict[str, torch.Tensor]]] = {}


def _spec(model: str) -> JobSpec:
    return JobSpec(model=model, steps=STEPS, batch_size=16, microbatches=4, seed=5)


def _reference(model: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The no-fault run: one stage, the same code path without a pipeline."""
    if model not in _REFERENCE:
        n = get_model(model).num_units
        result = run_inprocess(_spec(model), Plan.of(("ref", 0, n)))
        _REFERENCE[model] = (result.losses, result.weights)
    return _REFERENCE[model]


def _even(devices: list[str], n_units: int) -> Plan:
    k = min(len(devices), n_units)
    cuts = [round(i * n_units / k) for i in range(k + 1)]
    return Plan.of(*((devices[i], cuts[i], cuts[i + 1]) for i in range(k)))


@pytest.fixture
def broker() -> Iterator[str]:
    if find_mosquitto() is None:
        pytest.skip("mosquitto binary not found (on PATH or /usr/sbin/mosquitto)")
    with mosquitto_broker() as running:
        yield running.url


def _run(broker: str, model: str, agents: int, faults: list[Fault]):  # type: ignore[no-untyped-def]
    n_units = get_model(model).num_units
    control = MqttTransport(MqttSettings(url=broker))
    control.connect(10)
    try:
        with LocalFleet(agents, broker, threads=1) as fleet:
            fleet.wait_online(control, timeout=90)
            injector = FaultInjector(faults, lambda _f, device: fleet.kill(device))
            return run_resilient(
                _spec(model), _even(fleet.ids, n_units), control,
                lambda alive: _even(alive, n_units), list(fleet.ids),
                replicate_every=2, heartbeat_timeout_s=3.0, faults=injector, timeout_s=300,
            )  # fmt: skip
    finally:
        control.close()


def _assert_same_training(got, model: str) -> None:  # type: ignore[no-untyped-def]
    losses, weights = _reference(model)
    assert got.steps_completed == STEPS
    assert len(got.result.losses) == STEPS
    for a, b in zip(got.result.losses, losses, strict=True):
        assert abs(a - b) <= 1e-4 * max(abs(b), 1e-12)
    assert set(got.result.weights) == set(weights)
    for key, ref in weights.items():
        diff = (got.result.weights[key] - ref).abs().max().item()
        assert diff <= 1e-4 * max(ref.abs().max().item(), 1e-12), key


@pytest.mark.parametrize(
    ("model", "agents", "faults"),
    [
        ("cnn-digits", 3, ["kill:1@4"]),
        ("gpt-mini", 4, ["kill:2@5"]),
        ("cnn-digits", 4, ["kill:1@5", "kill:2@5"]),  # two at once
        ("mlp", 3, ["kill:1@3", "kill:1@8"]),  # the same stage twice
    ],
)
def test_killed_agents_are_survived_with_the_same_result(
    broker: str, model: str, agents: int, faults: list[str]
) -> None:
    got = _run(broker, model, agents, [parse_fault(f) for f in faults])
    _assert_same_training(got, model)
    failures = [e for e in got.events if e["type"] == "failure"]
    assert len(failures) == len(faults)
    assert got.recovery_s and all(0 < s < 60 for s in got.recovery_s)
    assert got.to_json()["recovered"] is True


def test_bad_fault_specs_are_refused() -> None:
    for text in ["kill:1", "kill:x@2", "melt:1@2", ""]:
        with pytest.raises(UserError, match="kill:STAGE@STEP, slow"):
            parse_fault(text)


def test_train_cli_reports_the_recovery(broker: str) -> None:
    cmd = [
        sys.executable, "-m", "edgetrain.cli", "train", "--model", "cnn-digits", "--devices",
        "3", "--steps", "8", "--batch-size", "16", "--microbatches", "4", "--broker", broker,
        "--partition", "even", "--threads", "1", "--fault", "kill:1@3", "--json",
    ]  # fmt: skip
    started = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    assert len(got["losses"]) == 8 and got["steps_completed"] == 8
    assert got["recovered"] is True and got["recovery_s"] > 0
    assert got["rolled_back_steps"] >= 0
    assert any(e["type"] == "failure" for e in got["events"])
    assert time.monotonic() - started < 300


def test_a_slowed_device_makes_the_job_migrate_with_the_same_result(
    broker: str, tmp_path: Path
) -> None:
    steps, weights = 30, tmp_path / "w.safetensors"  # enough left for a move to pay
    cmd = [
        sys.executable, "-m", "edgetrain.cli", "train", "--model", "gpt-mini", "--devices", "3",
        "--steps", str(steps), "--batch-size", "16", "--microbatches", "4", "--broker", broker,
        "--partition", "even", "--threads", "1", "--fault", "slow:1@4:4", "--json",
        "--save-weights", str(weights),
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    assert got["steps_completed"] == steps and len(got["losses"]) == steps
    assert got["recovered"] is False  # nothing died
    assert [e for e in got["events"] if e["type"] == "migration"]
    assert got["migrations"] and got["migrations"][0]["before_sps"] > 0
    spec = JobSpec(model="gpt-mini", steps=steps, batch_size=16, microbatches=4)
    reference = run_inprocess(spec, Plan.of(("ref", 0, get_model("gpt-mini").num_units)))
    trained = safetensors.torch.load_file(str(weights))
    for key, ref in reference.weights.items():
        diff = (trained[key] - ref).abs().max().item()
        assert diff <= 1e-4 * max(ref.abs().max().item(), 1e-12), key


def test_a_broker_restart_is_ridden_out_with_the_same_result() -> None:
    if find_mosquitto() is None:
        pytest.skip("mosquitto binary not found (on PATH or /usr/sbin/mosquitto)")
    model, n_units = "cnn-digits", get_model("cnn-digits").num_units
    first = start_broker("mosquitto")
    brokers = [first]
    restart = threading.Event()

    def restarter() -> None:  # not on paho's thread: it must not wait for its own traffic
        if restart.wait(120):
            first.stop()
            brokers.append(start_broker("mosquitto", first.port))

    thread = threading.Thread(target=restarter, daemon=True)
    thread.start()
    control = MqttTransport(MqttSettings(url=first.url, reconnect_max_s=1.0))
    try:
        control.connect(10)
        with LocalFleet(3, first.url, threads=1) as fleet:
            fleet.wait_online(control, timeout=90)

            def on_step(report: StepReport) -> None:
                if report.step == 5:
                    restart.set()

            got = run_resilient(
                _spec(model), _even(fleet.ids, n_units), control,
                lambda alive: _even(alive, n_units), list(fleet.ids), replicate_every=2,
                heartbeat_timeout_s=3.0, on_step=on_step, timeout_s=300,
            )  # fmt: skip
    finally:
        restart.set()
        thread.join(30)
        control.close()
        for running in brokers:
            running.stop()
    assert [e for e in got.events if e["type"] == "broker-lost"]
    assert not [e for e in got.events if e["type"] == "failure"]
    _assert_same_training(got, model)


def test_a_faster_device_that_joins_is_taken_in(broker: str) -> None:
    model, steps = "gpt-mini", 80  # the join takes seconds: leave steps for it to pay off
    spec = JobSpec(model=model, steps=steps, batch_size=16, microbatches=4, seed=5)
    control = MqttTransport(MqttSettings(url=broker))
    control.connect(10)
    try:
        # Two agents announcing a Raspberry Pi 4; a laptop (30x the Pi) joins at step 2.
        with LocalFleet(2, broker, threads=1, profile="rpi4-4gb") as fleet:
            profiles = fleet.wait_online(control, timeout=90)
            members = list(fleet.ids)

            def problem_for(alive: list[str]) -> PlanningProblem:
                return build_problem(model, [profiles[d] for d in alive], batch_size=16,
                                     microbatches=4, pin_first=alive[0])  # fmt: skip

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
            got = run_resilient(
                spec, _even(members, 6), control, lambda alive: _even(alive, 6), members,
                replicate_every=2, faults=injector, timeout_s=300,
                rebalance=Rebalancer(problem_for, replicate_every=2),
            )  # fmt: skip
    finally:
        control.close()
    migrations = [e for e in got.events if e["type"] == "migration"]
    assert migrations, got.events
    assert any(st["device"] == fleet.ids[2] for st in migrations[-1]["plan"])
    assert got.steps_completed == steps
    reference = run_inprocess(spec, Plan.of(("ref", 0, 6)))
    for key, ref in reference.weights.items():
        diff = (got.result.weights[key] - ref).abs().max().item()
        assert diff <= 1e-4 * max(ref.abs().max().item(), 1e-12), key
