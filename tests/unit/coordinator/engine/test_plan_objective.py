"""A job's planning objective (coordinator/engine/engine.py plan_over, job_problem).

Catalogue devices with their datasheet power figures. With ``objective="energy"``
the plan is the least-energy plan, device groups included (the planner places
them in jobs), checked against every plan; with a deadline, the least-energy plan
among those that meet it; an impossible deadline or an energy objective without
power figures is a one-line error.
"""

from __future__ import annotations

import pytest

from coordinator.engine.engine import job_problem, plan_over
from coordinator.engine.spec import JobSpec
from coordinator.planner.build import parse_fleet
from coordinator.planner.score import Plan, PlanScore, Stage, score_plan
from edge.errors import UserError
from edge.wire.groups import split_samples

FLEET = "rpi4-4gb,nuc"  # the NUC helps the Pi for cnn-digits, at a cost in joules


def _spec(**extra: object) -> JobSpec:
    return JobSpec.model_validate(
        {"model": "cnn-digits", "steps": 1, "batch_size": 32, "microbatches": 4, **extra}
    )


def _every_plan(spec: JobSpec) -> list[PlanScore]:
    """Every plan the runtime can train over the fleet (stages on disjoint groups of
    devices, the first holding the first device; a group only where each member gets a
    sample of every microbatch), scored for ``spec``'s objective."""
    import itertools

    devices = parse_fleet(FLEET, power=True)
    problem = job_problem(spec, devices, devices[0].id, groups=True)
    n = len(problem.layers)
    out = []
    ids = [d.id for d in devices]
    for k in range(1, min(len(ids), n) + 1):
        for where in itertools.product(range(-1, k), repeat=len(ids)):
            groups = [[d for d, w in zip(ids, where, strict=True) if w == s] for s in range(k)]
            if not all(groups) or ids[0] not in groups[0]:
                continue
            for cuts in itertools.combinations(range(1, n), k - 1):
                bounds = [0, *cuts, n]
                stages = zip(groups, bounds, bounds[1:], strict=False)
                plan = Plan(tuple(Stage.group(g, a, b) for g, a, b in stages))
                out.append(score_plan(problem, plan))
    b = spec.batch_size // spec.microbatches
    return [s for s in out if s.feasible and all(_splits(b, shares) for shares in s.shares)]


def _splits(samples: int, shares: list[float]) -> bool:
    try:
        split_samples(samples, shares)
    except ValueError:
        return False
    return True


def test_the_energy_objective_takes_the_least_energy_plan() -> None:
    devices = parse_fleet(FLEET, power=True)
    fast = plan_over(_spec(), devices, pin_first=devices[0].id).score
    frugal = plan_over(_spec(objective="energy"), devices, pin_first=devices[0].id).score
    assert fast.version == 2 and frugal.version == 2
    every = _every_plan(_spec(objective="energy"))
    least = min(s.energy_j_per_step for s in every)
    assert frugal.energy_j_per_step == pytest.approx(least, rel=1e-9)
    fast_energy = score_plan(
        job_problem(_spec(objective="energy"), devices, devices[0].id, groups=True), fast.plan
    )
    assert least < fast_energy.energy_j_per_step  # not degenerate: the objectives differ
    assert fast.step_time_s < frugal.step_time_s


def test_a_deadline_keeps_the_least_energy_plan_that_meets_it() -> None:
    devices = parse_fleet(FLEET, power=True)
    every = _every_plan(_spec(objective="energy"))
    frugal = min(every, key=lambda s: s.energy_j_per_step)
    fastest = min(every, key=lambda s: s.step_time_s)
    deadline = (frugal.step_time_s + fastest.step_time_s) / 2
    spec = _spec(objective="energy", max_step_time_s=deadline)
    got = plan_over(spec, devices, pin_first=devices[0].id).score
    meeting = [s for s in every if s.step_time_s <= deadline]
    assert got.step_time_s <= deadline
    assert got.energy_j_per_step == pytest.approx(
        min(s.energy_j_per_step for s in meeting), rel=1e-9
    )
    with pytest.raises(UserError, match="max_step_time_s"):
        plan_over(
            _spec(max_step_time_s=fastest.step_time_s * 0.9), devices, pin_first=devices[0].id
        )


def test_energy_without_power_figures_is_refused() -> None:
    devices = parse_fleet(FLEET)  # no power figures
    with pytest.raises(UserError, match="no device has power figures"):
        plan_over(_spec(objective="energy"), devices, pin_first=devices[0].id)
