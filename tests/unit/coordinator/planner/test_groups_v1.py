"""Planner version 2 is never worse than version 1 on the same problem.

Every version 1 plan is a version 2 plan, and the group search holds version 1's
answer as a candidate ([Note: version 2 holds version 1's answer] in
:mod:`coordinator.planner.group_search`). Checked on ``bench/planner.py``'s
64-device x 200-unit problems (its generator, its seeds), where the structured
search runs, and on the way the answer is asked for: with version 1's own budget
and stage count, exactly as :func:`plan_any` asks version 1.
"""

from __future__ import annotations

from typing import Any

import pytest
from support.bench import load_bench
from support.planning import random_problem

import coordinator.planner.group_search as group_search
from coordinator.planner.group_search import plan_any, plan_groups
from coordinator.planner.solve import plan_problem

LARGE_SEEDS = (0, 1, 2, 21)
"""``bench/planner.py``'s 64 x 200 problems (``--large-seeds`` defaults to 3), and seed 21,
where version 2 once returned a plan 0.165% slower than version 1's (on a loaded machine:
see the second test)."""

BUDGET_S = 30.0
"""The one budget both versions get here: more than version 1 needs on these problems
(2-5 s each on this machine), so that neither search is cut by the clock and both
answers are reproducible on a loaded machine."""


@pytest.mark.parametrize("seed", LARGE_SEEDS)
def test_version_2_is_never_worse_than_version_1_at_64_by_200(seed: int) -> None:
    problem = load_bench("planner").random_large(seed)
    v1 = plan_problem(problem, time_budget_s=BUDGET_S)
    v2 = plan_groups(problem.as_version(2), time_budget_s=BUDGET_S)
    assert v1.score is not None and v2.score is not None and not v2.exact
    assert v2.score.step_time_s <= v1.score.step_time_s, (v2.method, v1.method)


@pytest.mark.parametrize(("exact_limit", "stages"), [(0, None), (0, 2), (10**9, None)])
def test_version_1_is_asked_with_its_own_budget_and_stages(
    monkeypatch: pytest.MonkeyPatch, exact_limit: int, stages: int | None
) -> None:
    """The group search asks version 1 what :func:`plan_any` would ask it, the whole
    budget included (a share of it returned a plan 0.165% slower than version 1's on
    the 64 x 200 seed 21 under load), in the structured and the exact search alike."""
    asked: list[dict[str, Any]] = []

    def spy(problem: Any, **kwargs: Any) -> Any:
        asked.append({"version": problem.version, **kwargs})
        return plan_problem(problem, **kwargs)

    monkeypatch.setattr(group_search, "plan_problem", spy)
    problem = random_problem(5, 4, 6, memory_fraction=(0.6, 2.0)).as_version(2)
    got = plan_groups(problem, time_budget_s=3.5, exact_limit=exact_limit, stages=stages)
    assert got.exact == bool(exact_limit)
    assert asked == [{"version": 1, "time_budget_s": 3.5, "stages": stages}]
    v1 = plan_any(problem.as_version(1), time_budget_s=3.5, stages=stages)
    assert got.score is not None and v1.score is not None
    assert got.score.step_time_s <= v1.score.step_time_s
