"""A job's ``partition`` and ``stages``: the planner's best plan of exactly N stages, even splits.

Claims under test:

- ``plan_problem(problem, stages=N)`` on small fleets is exact among plans of
  exactly ``N`` stages: checked against every such plan scored with ``score_plan``
  (the literal brute force of ``support.planning``, restricted to ``N`` stages);
- on big fleets it returns a valid, feasible ``N``-stage plan within its time
  budget, and the best one where that is known (free links, ample memory: any
  ``N`` fastest devices, cut well);
- :func:`coordinator.planner.partition.plan_job` turns ``partition``/``stages``
  into plans as documented, and refuses what cannot work with one line.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from support.planning import (
    REGIMES,
    Reference,
    all_plans,
    make_problem,
    plan_errors,
    problems,
    random_problem,
)

from coordinator.engine.rebalance import Rebalancer
from coordinator.planner.partition import PartitionOptions, even_devices, plan_job
from coordinator.planner.score import Plan, score_plan
from coordinator.planner.solve import plan_problem
from edge.errors import UserError
from edge.problem import PlanningProblem

REL = 1e-9


def _dump(problem: PlanningProblem) -> str:
    return json.dumps(problem.to_json())


def brute_force_of(problem: PlanningProblem, stages: int) -> Reference | None:
    """The least step time over every plan of exactly ``stages`` stages, each scored by
    :func:`score_plan` (``support.planning.brute_force_literal``, one stage count)."""
    best: Reference | None = None
    for plan in all_plans(problem):
        if len(plan.stages) != stages:
            continue
        sc = score_plan(problem, plan)
        if sc.feasible and (best is None or sc.step_time_s < best.step_time_s):
            best = Reference(sc.step_time_s, plan)
    return best


def _assert_n_stage_plan(problem: PlanningProblem, plan: Plan | None, stages: int) -> float:
    assert plan is not None
    assert len(plan.stages) == stages, (plan, _dump(problem))
    assert plan_errors(problem, plan) == [], _dump(problem)
    score = score_plan(problem, plan)
    assert score.feasible, (score.reasons, _dump(problem))
    return score.step_time_s


@pytest.mark.parametrize("regime", REGIMES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_exact_with_a_stage_count_matches_brute_force_over_those_plans(
    regime: str, data: st.DataObject
) -> None:
    problem = data.draw(problems(regime, max_devices=5, max_units=7), label="problem")
    most = min(len(problem.devices), len(problem.layers))
    stages = data.draw(st.integers(1, most), label="stages")
    ref = brute_force_of(problem, stages)
    result = plan_problem(problem, stages=stages)
    event(f"{stages} stages: {'infeasible' if ref is None else 'feasible'}")
    assert result.exact
    if ref is None:
        assert result.plan is None and f"no {stages}-stage plan" in result.reason, _dump(problem)
        return
    step = _assert_n_stage_plan(problem, result.plan, stages)
    assert result.score is not None and result.score.step_time_s == step
    assert ref.step_time_s * (1 - REL) <= step <= ref.step_time_s * (1 + REL), (
        step,
        ref,
        result.plan,
        _dump(problem),
    )


def test_a_stage_count_the_problem_cannot_have_gives_no_plan() -> None:
    problem = random_problem(1, n_devices=3, n_units=4, memory_fraction=(2.0, 3.0))
    for stages in (0, 4, 5):
        result = plan_problem(problem, stages=stages)
        assert result.plan is None and f"no plan has {stages} stages" in result.reason
    assert len(plan_problem(problem, stages=3).plan.stages) == 3  # type: ignore[union-attr]


@pytest.mark.parametrize("stages", [1, 2, 8, 40])
def test_big_fleets_get_a_valid_plan_of_that_many_stages_in_bounded_time(stages: int) -> None:
    problem = random_problem(3, n_devices=64, n_units=200, memory_fraction=(0.05, 0.5))
    started = time.perf_counter()
    result = plan_problem(problem, stages=stages, time_budget_s=2.0)
    took = time.perf_counter() - started
    assert not result.exact
    assert took < 2.0 + 6.0, took  # the budget, plus the last evaluation in flight
    if stages == 1:  # every device alone is short of memory here
        assert result.plan is None and "no 1-stage plan" in result.reason
        return
    _assert_n_stage_plan(problem, result.plan, stages)


def test_big_fleet_with_free_links_and_ample_memory_gets_the_best_n_stage_plan() -> None:
    """With links free and memory ample only the set of devices matters, and the N
    fastest are best: the brute force over them alone is the optimum of the whole fleet."""
    n_dev, n_units, stages = 12, 30, 3
    layers = [
        {"fwd_flops": 1e8 * (1 + (7 * j) % 5), "param_bytes": 1e3, "out_bytes": 0.0}
        for j in range(n_units)
    ]
    devices: list[dict[str, Any]] = [
        {
            "id": f"d{j:02d}",
            "gflops": 1.0 + (5 * j) % 12,
            "memory_bytes": 1e15,
            "bandwidth_mbps": 100.0,
            "latency_ms": 0.0,
        }
        for j in range(n_dev)
    ]
    problem = make_problem(layers, devices)
    result = plan_problem(problem, stages=stages)
    assert not result.exact  # the heuristic path
    fastest = sorted(devices, key=lambda d: -d["gflops"])[:stages]
    ref = brute_force_of(make_problem(layers, fastest), stages)
    assert ref is not None
    step = _assert_n_stage_plan(problem, result.plan, stages)
    assert step == pytest.approx(ref.step_time_s, rel=REL)


# --- plan_job: the options as a job gives them -----------------------------------------


def _fleet(*gflops: float, memory: float = 1e15) -> list[dict[str, Any]]:
    return [
        {
            "id": f"d{j}",
            "gflops": g,
            "memory_bytes": memory,
            "bandwidth_mbps": 1000.0,
            "latency_ms": 1.0,
        }
        for j, g in enumerate(gflops)
    ]


LAYERS = [{"fwd_flops": 1e7, "param_bytes": 1e6, "out_bytes": 1e3}] * 6


def test_even_uses_every_device_in_order_and_shares_the_units_out() -> None:
    problem = make_problem(LAYERS, _fleet(1, 5, 3, 2), pin_first="d2")
    got = plan_job(problem, PartitionOptions(partition="even"))
    assert [(s.device, s.start, s.end) for s in got.plan.stages] == [
        ("d2", 0, 2),
        ("d0", 2, 3),
        ("d1", 3, 4),
        ("d3", 4, 6),
    ]
    assert got.method == "even split over 4 devices" and not got.exact


def test_even_with_stages_takes_the_fastest_devices_with_the_pin_first() -> None:
    problem = make_problem(LAYERS, _fleet(1, 5, 3, 2, 5))
    assert even_devices(problem, 2) == ["d1", "d4"]  # a tie: both fastest
    got = plan_job(problem, PartitionOptions(partition="even", stages=3))
    assert [(s.device, s.start, s.end) for s in got.plan.stages] == [
        ("d1", 0, 2),
        ("d2", 2, 4),
        ("d4", 4, 6),
    ]
    pinned = make_problem(LAYERS, _fleet(1, 5, 3, 2, 5), pin_first="d0")
    got = plan_job(pinned, PartitionOptions(partition="even", stages=2))
    assert [s.device for s in got.plan.stages] == ["d0", "d1"]


def test_plan_with_stages_is_the_planners_best_plan_of_that_many() -> None:
    problem = make_problem(LAYERS, _fleet(1, 5, 3, 2))
    free = plan_job(problem)
    for stages in (1, 2, 3, 4):
        got = plan_job(problem, PartitionOptions(stages=stages))
        assert len(got.plan.stages) == stages and got.exact
        assert got.score == plan_problem(problem, stages=stages).score
        assert got.score.step_time_s >= free.score.step_time_s * (1 - REL)
    auto = plan_job(problem, PartitionOptions(stages=3, codec="auto"))
    assert len(auto.plan.stages) == 3


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"stages": 7}, "stages=7 is more than the model's 6 units"),
        ({"stages": 5}, "stages=5 is more than the devices (4)"),
        ({"stages": 0}, "stages=0: a plan has at least 1 stage"),
        ({"partition": "random"}, "partition 'random' is not one of plan, even"),
    ],
)
def test_what_cannot_work_is_one_line(options: dict[str, Any], message: str) -> None:
    problem = make_problem(LAYERS, _fleet(1, 5, 3, 2))
    with pytest.raises(UserError) as info:
        plan_job(problem, PartitionOptions(**options))
    assert info.value.message == message


def test_nothing_that_fits_memory_is_refused_with_the_reason() -> None:
    # Each device holds 4 * 2e6 = 8 MB of parameters at most: two units' worth.
    problem = make_problem(LAYERS, _fleet(1, 5, 3, 2, memory=8.5e6), microbatches=1)
    assert len(plan_job(problem, PartitionOptions(stages=3)).plan.stages) == 3
    with pytest.raises(UserError, match="no plan fits the online devices: no 2-stage plan fits"):
        plan_job(problem, PartitionOptions(stages=2), where="the online devices")
    with pytest.raises(UserError, match="the even split over 2 devices does not fit the devices"):
        plan_job(problem, PartitionOptions(partition="even", stages=2))


def test_a_rebalancer_keeps_the_stage_count() -> None:
    """A device measured 50x slower than announced is moved off, into as many stages."""
    problem = make_problem(LAYERS, _fleet(1, 5, 3, 2))
    plan = plan_job(problem, PartitionOptions(stages=3)).plan
    predicted = score_plan(problem, plan).compute_s
    slow = plan.stages[0].device
    measured = {
        st.device: predicted[s] * problem.microbatches * (50.0 if s == 0 else 1.0)
        for s, st in enumerate(plan.stages)
    }
    ids = [d.id for d in problem.devices]
    for stages in (3, 2):
        rebalance = Rebalancer(lambda _alive: problem, replicate_every=1, stages=stages)
        better = rebalance(plan, ids, measured, steps_left=10_000)
        assert better is not None and len(better.stages) == stages, rebalance.decisions
        assert slow not in {st.device for st in better.stages}


@pytest.mark.slow
def test_a_replan_on_a_large_fleet_warm_starts_from_the_previous_plan() -> None:
    """64 devices: beyond the exact search. A re-plan after a device of the plan left
    starts from the previous plan (one-device stages, as the runtime trains), and is as
    good as the full search within 5%; without ``previous`` the full search runs."""
    problem = random_problem(3, 64, 60, memory_fraction=(0.3, 1.5))
    first = plan_job(problem)
    assert first.method != "warm start from the current plan"
    stages = first.plan.stages
    assert len(stages) >= 2
    gone = stages[len(stages) // 2].device
    left = problem.model_copy(update={"devices": [d for d in problem.devices if d.id != gone]})
    warm = plan_job(left, previous=first.plan)
    assert warm.method == "warm start from the current plan"
    assert gone not in warm.plan.devices and not warm.plan.grouped
    assert warm.score == score_plan(left, warm.plan) and warm.score.version == 1
    full = plan_job(left)
    assert warm.score.step_time_s <= full.score.step_time_s * 1.05
    # Options that need the full search keep it.
    assert plan_job(left, PartitionOptions(stages=2), previous=first.plan).method != warm.method
