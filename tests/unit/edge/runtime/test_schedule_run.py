"""A stage runs the schedule its job names: the order the simulator draws, and no more held.

Parity cannot tell schedules apart: 1F1B and GPipe sum the same gradients in the
same order, so a stage that ran the wrong one would still train exactly. Here a
3-stage pipeline runs in process under every schedule edgetrain knows
(:data:`edge.runtime.schedules.SCHEDULES`, so a schedule added later is checked
too), and for every stage and step two records of what it ran must equal what
:func:`coordinator.planner.simulator.simulate` draws for the same plan and
problem: the stage's own report (its actions, weight passes included, and the most
microbatches it held) and the order of the frames it sent and took
(:mod:`support.schedules`), which shows its forwards and backwards.
"""

from __future__ import annotations

import pytest
from support.schedules import drawn, framed, record_wire

from coordinator.engine.runners import run_inprocess
from coordinator.engine.spec import JobSpec
from coordinator.planner.build import build_problem
from coordinator.planner.score import Plan
from edge.models.zoo import get_model
from edge.problem import DeviceSpec
from edge.runtime.schedules import SCHEDULES

STEPS = 2
DEVICES = [
    DeviceSpec(id=f"d{s}", gflops=10.0, memory_bytes=8 << 30, bandwidth_mbps=100.0, latency_ms=1)
    for s in range(3)
]


def _plan(model: str) -> Plan:
    n = get_model(model).num_units
    cuts = [0, 1, 2, n]
    return Plan.of(*((DEVICES[s].id, cuts[s], cuts[s + 1]) for s in range(3)))


def test_the_schedules_differ_where_this_test_looks() -> None:
    """Otherwise a stage could run the wrong one and match: every pair differs somewhere."""
    problem = build_problem("mlp", DEVICES, batch_size=16, microbatches=4)
    rows = {name: drawn(problem, _plan("mlp"), name) for name in SCHEDULES}
    assert len({str(r) for r in rows.values()}) == len(SCHEDULES) >= 2


@pytest.mark.parametrize("microbatches", [2, 4])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_every_stage_runs_the_schedule_the_simulator_draws(
    monkeypatch: pytest.MonkeyPatch, schedule: str, microbatches: int
) -> None:
    spec = JobSpec(
        model="mlp", steps=STEPS, batch_size=16, microbatches=microbatches, schedule=schedule
    )
    plan = _plan(spec.model)
    problem = build_problem(spec.model, DEVICES, batch_size=16, microbatches=microbatches)
    rows, peaks = drawn(problem, plan, schedule)

    with record_wire(monkeypatch) as wire:
        result = run_inprocess(spec, plan, timeout_s=120)

    assert {(r.stage, r.step) for r in result.reports} == {
        (s, t) for s in range(3) for t in range(STEPS)
    }
    for r in result.reports:
        where = f"stage {r.stage}, step {r.step}"
        assert r.actions == rows[r.stage], f"{where} ran another order than {schedule}'s"
        assert wire.actions(r.stage, r.step) == framed(rows[r.stage]), f"{where}: its frames"
        assert r.peak_held == peaks[r.stage], f"{where} held {r.peak_held} microbatches"
