"""Jobs planned on device groups (coordinator/engine/engine.py plans_groups, group_limits).

A job with ``partition="plan"`` is planned as a version 2 problem with groups,
within what the runtime can train (no BatchNorm in a group, a sample or more per
member), and never worse than its plan of one-device stages. Fault tolerance,
``codec="auto"``, server-tier devices and ``partition="even"`` keep one-device
stages; fault tolerance through the one switch ``GROUPS_WITH_FAULT_TOLERANCE``.
"""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.engine import engine
from coordinator.engine.assignments import batchnorm_units
from coordinator.engine.engine import job_problem, plan_over, plans_groups
from coordinator.engine.spec import JobSpec
from coordinator.planner.build import parse_fleet
from coordinator.planner.group_search import plan_groups

PIS = "rpi4-4gb:4"
"""Four equal slow devices: vgg11's compute dominates its links, so groups win."""


def _spec(**extra: Any) -> JobSpec:
    return JobSpec.model_validate(
        {"model": "vgg11", "steps": 1, "batch_size": 32, "microbatches": 4, **extra}
    )


def _plan(spec: JobSpec, groups: bool | None = None) -> Any:
    devices = parse_fleet(PIS)
    return plan_over(spec, devices, pin_first=devices[0].id, groups=groups)


def test_a_job_is_planned_on_groups_where_they_win() -> None:
    grouped, one = _plan(_spec()), _plan(_spec(), groups=False)
    assert grouped.problem.version == 2 and grouped.problem.groups is True
    assert grouped.plan.grouped and not one.plan.grouped
    assert grouped.shares == [[0.25] * 4]  # one group of the four: data parallel
    assert grouped.score.step_time_s < one.score.step_time_s / 1.3


def test_fault_tolerance_plans_groups_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """A member of a group that dies is handed over ([Note: a group member dies]), so
    jobs with fault tolerance are planned on groups like any other; the switch still
    turns that off."""
    spec = _spec(replicate_every=2)
    assert plans_groups(spec) and plans_groups(_spec(), resilient=True)
    assert _plan(spec).plan.grouped
    monkeypatch.setattr(engine, "GROUPS_WITH_FAULT_TOLERANCE", False)
    assert not plans_groups(spec) and not _plan(spec).plan.grouped


def test_even_splits_auto_codecs_and_servers_plan_no_groups() -> None:
    assert not plans_groups(_spec(partition="even"))
    assert not plans_groups(_spec(codec="auto"))
    assert not plans_groups(_spec(), servers=True)
    assert not _plan(_spec(codec="auto")).plan.grouped


def test_no_group_trains_batchnorm() -> None:
    """vgg11 with BatchNorm: its eight conv units are solo, so the plan that wins with
    group norm is not made; the classifier alone might be grouped."""
    spec = _spec(model_options={"norm": "batch"})
    assert batchnorm_units(spec) == frozenset(range(8))
    assert batchnorm_units(_spec()) == frozenset()
    got = _plan(spec)
    assert all(st.start >= 8 for st in got.plan.stages if len(st.devices) > 1)
    one = _plan(spec, groups=False)
    assert got.score.step_time_s <= one.score.step_time_s * (1 + 1e-12)


def test_every_member_gets_a_sample() -> None:
    """Microbatches of 2 samples: the score's best plan has a group of three, which the
    runtime cannot split a microbatch over; the job's plan keeps to groups of two."""
    spec = _spec(batch_size=2, microbatches=1)
    devices = parse_fleet(PIS)
    free = plan_groups(job_problem(spec, devices, devices[0].id, groups=True)).score
    assert free is not None and max(len(st.devices) for st in free.plan.stages) == 3
    got = _plan(spec)
    assert max(len(st.devices) for st in got.plan.stages) == 2
