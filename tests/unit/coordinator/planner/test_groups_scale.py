"""Planner version 2 at scale: a 64-device x 200-unit problem, and the warm-started re-plan.

The problems are ``bench/planner.py``'s random 64 x 200 instances (catalogue
devices, skewed unit costs, ``pin_first``) as version 2. The full search has an
8 s budget; the re-plan after a device of the plan leaves starts from the plan
and has 0.8 s. These tests assert measured times, so they are ``serial``.
"""

from __future__ import annotations

import time

import pytest
from support.bench import load_bench

from coordinator.planner.group_search import plan_groups, replan
from coordinator.planner.solve import plan_problem

pytestmark = [pytest.mark.serial, pytest.mark.slow]


@pytest.mark.parametrize("seed", [0, 1])
def test_full_search_and_warm_replan_at_64_by_200(seed: int) -> None:
    problem = load_bench("planner").random_large(seed).as_version(2)
    started = time.perf_counter()
    full = plan_groups(problem)
    assert time.perf_counter() - started < 10.0
    assert full.score is not None and not full.exact
    v1 = plan_problem(problem.as_version(1))
    assert v1.score is not None
    assert full.score.step_time_s <= v1.score.step_time_s * (1 + 1e-9)
    # A device of the plan leaves: the one on the middle stage.
    stages = full.score.plan.stages
    gone = stages[len(stages) // 2].device
    left = problem.model_copy(update={"devices": [d for d in problem.devices if d.id != gone]})
    started = time.perf_counter()
    warm = replan(left, full.score.plan)
    wall = time.perf_counter() - started
    again = plan_groups(left)
    assert warm.score is not None and again.score is not None
    assert gone not in warm.score.plan.devices
    print(
        f"seed {seed}: full {full.score.step_time_s:.4f} s/step, re-plan without {gone} "
        f"{warm.score.step_time_s:.4f} in {wall:.2f} s, full again {again.score.step_time_s:.4f}"
    )
    assert wall < 1.0
    assert warm.score.step_time_s <= again.score.step_time_s * 1.05
