"""A group member dies mid-run: its co-members hand over, nothing rolls back.

Real agent processes, one SIGKILLed, and a real Mosquitto. The stage groups' survivors
hold the dead member's units ([Note: a group member dies] in
:mod:`coordinator.engine.handover`), so the coordinator re-plans over the survivors
and resumes from the state of the step every stage reached: the run ends with the
weights and losses of a run without faults, and no step every stage had finished is
run again. The runs replicate nothing (``replicate_every=0``): a rollback could only
go back to step 0, so a hand-over that did not happen shows.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
from support.faults import assert_same_training, even_groups, events_of, job_spec

from coordinator.engine.faults import FaultInjector, parse_fault
from coordinator.engine.options import RunOptions
from coordinator.engine.resilient import Resilience, ResilientRun
from coordinator.local.fleet import LocalFleet
from coordinator.planner.score import Plan, Stage
from edge.models.zoo import get_model
from edge.transport.mqtt import MqttSettings, MqttTransport

pytestmark = pytest.mark.slow

RTOL = 1e-4
"""The issue's bound: the survivors re-split the step in flight, so sums round differently."""


def _survivors(plan: Plan, alive: list[str]) -> Plan:
    """The same stages, each on its members still alive."""
    return Plan(
        tuple(
            Stage.group([d for d in st.devices if d in alive], st.start, st.end)
            for st in plan.stages
        )
    )


def _devices(stage: dict[str, Any]) -> list[str]:
    """A stage object's devices (one device's stage may carry only ``device``)."""
    return list(stage.get("devices", [stage["device"]]))


@pytest.mark.parametrize(
    ("model", "sizes", "fault", "schedule"),
    [
        ("cnn-digits", [1, 2, 1], "kill:1.0@5", "gpipe"),  # the 2,1 case: through train below
    ],
)
def test_a_killed_member_is_survived_without_rollback(
    module_broker: str, model: str, sizes: list[int], fault: str, schedule: str
) -> None:
    n_units = get_model(model).num_units
    spec = job_spec(model).model_copy(update={"schedule": schedule})
    control = MqttTransport(MqttSettings(url=module_broker))
    control.connect(10)
    try:
        with LocalFleet(sum(sizes), module_broker, threads=1) as fleet:
            fleet.wait_online(control, timeout=90)
            plan = even_groups(list(fleet.ids), sizes, n_units)
            injector = FaultInjector([parse_fault(fault)], lambda _f, device: fleet.kill(device))
            got = ResilientRun(
                spec,
                control,
                lambda alive: _survivors(plan, alive),
                list(fleet.ids),
                resilience=Resilience(replicate_every=0, faults=injector),
                options=RunOptions(heartbeat_timeout_s=3.0, timeout_s=300),
            ).run(plan)
    finally:
        control.close()

    # The fault fired once, on the member it names, and that device is the one that died.
    f = parse_fault(fault)
    killed = plan.stages[f.stage].devices[f.member]
    assert [(e["fault"], e["device"]) for e in events_of(got.events, "fault")] == [(str(f), killed)]
    assert [e["device"] for e in events_of(got.events, "failure")] == [killed]
    # One recovery, by hand-over: the next attempt runs without the dead member and
    # starts at the step after the newest one every surviving stage member finished.
    (recovery,) = events_of(got.events, "recovery")
    assert recovery["handed_over"] is True and recovery["redo_steps"] == 0
    first, second = events_of(got.events, "attempt")
    assert killed not in {d for st in second["plan"] for d in _devices(st)}
    survivors = [d for d in plan.devices if d != killed]
    finished = [
        max(
            (r.step for r in got.result.reports if r.job == first["job"] and r.device == d),
            default=-1,
        )
        for d in survivors
    ]
    assert second["first_step"] == recovery["rollback_to"] == min(finished) + 1 >= f.step
    assert got.rolled_back_steps == 0
    assert got.steps_completed == spec.steps
    # ... and the run is the run without faults.
    assert_same_training(got.result.losses, got.result.weights, model, rtol=RTOL)


def test_train_cli_survives_a_group_member_without_rollback(
    module_broker: str, tmp_path: Path
) -> None:
    """``edgetrain train --group-sizes 2,1 --fault kill:0.1@3``: the job engine's path (the
    service's), re-planned over the survivors with the groups less the dead member."""
    steps, weights = 8, tmp_path / "w.safetensors"
    cmd = [
        sys.executable,
        "-m",
        "edgetrain.cli",
        "train",
        "--model",
        "cnn-digits",
        "--devices",
        "3",
        "--steps",
        str(steps),
        "--batch-size",
        "16",
        "--microbatches",
        "4",
        "--broker",
        module_broker,
        "--partition",
        "even",
        "--group-sizes",
        "2,1",
        "--threads",
        "1",
        "--fault",
        "kill:0.1@3",
        "--json",
        "--save-weights",
        str(weights),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    events = got["events"]
    first, second = events_of(events, "attempt")
    killed = first["plan"][0]["devices"][1]
    assert [e["device"] for e in events_of(events, "failure")] == [killed]
    (recovery,) = events_of(events, "recovery")
    assert recovery["handed_over"] is True
    assert [_devices(st) for st in second["plan"]] == [
        [first["plan"][0]["devices"][0]],
        _devices(first["plan"][1]),
    ]
    assert second["first_step"] >= 3 and got["rolled_back_steps"] == 0
    assert got["steps_completed"] == steps
    trained = safetensors.torch.load_file(str(weights))
    assert_same_training(got["losses"], trained, "cnn-digits", steps, seed=0, rtol=RTOL)
