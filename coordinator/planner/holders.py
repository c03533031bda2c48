"""Plans for data that stays home: stage 0 on the devices that hold it, the rest on helpers.

A job whose data lives on devices ([Note: local data] in :mod:`edge.models.local_data`)
trains on the union of every holder's data. The holders are stage 0's group, each
with a share of every microbatch fixed by how much data it holds (its samples cannot
move, so its speed does not choose its share), and they run at least
``min_local_units`` units: only activations after those leave them. What is left to
choose is how many units the holders keep and how helpers run the rest:

- for each ``k`` from ``min_local_units`` up, the helpers' own best plan of units
  ``[k, n)`` (``plan_rest``: the job's planner over the helpers alone, groups
  included), behind stage 0, scored whole with stage 0's shares fixed
  (:func:`~coordinator.planner.score.score_plan`'s ``fixed_shares``);
- ``k = n``: the holders training alone together, data-parallel with no helper
  (the federated alternative).

The fastest feasible plan wins. Beside it, :class:`HolderPlans` keeps the
alternatives the job's constraints allow, each scored the same way: the holders
alone together, and each holder alone on its own data.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from coordinator.planner.score import Plan, PlanScore, Stage, for_plan, score_plan
from edge.problem import PlanningProblem

__all__ = ["HolderPlans", "plan_with_holders"]


@dataclass(frozen=True)
class HolderPlans:
    """The best plan of a job on local data, and the alternatives its constraints allow."""

    best: PlanScore | None
    """The fastest feasible plan, stage 0 on the holders; ``None`` if none fits."""
    holders_alone: PlanScore
    """Every unit on the holders, data-parallel, no helper (may be infeasible)."""
    each_alone: dict[str, PlanScore]
    """Per holder: the whole model on it alone (its samples/s on its own data)."""
    tried: int
    """How many ways to cut (``k``) were scored."""


def plan_with_holders(
    problem: PlanningProblem,
    holders: Sequence[str],
    shares: Sequence[float],
    plan_rest: Callable[[PlanningProblem], PlanScore | None],
    *,
    min_local_units: int = 1,
    solo_units: frozenset[int] = frozenset(),
) -> HolderPlans:
    """The plans of ``problem`` with stage 0 on ``holders`` at ``shares`` (see the module
    docstring). ``solo_units`` are units no group may train (BatchNorm): a cut that
    leaves one on a group of holders is not tried."""
    n = len(problem.layers)
    if not 1 <= min_local_units <= n:
        raise ValueError(f"min_local_units {min_local_units} is not between 1 and {n}")
    helpers = [d for d in problem.devices if d.id not in set(holders)]
    fixed = {0: list(shares)}

    def score(plan: Plan) -> PlanScore:
        return score_plan(for_plan(problem, plan), plan, fixed_shares=fixed)

    alone = score(Plan((Stage.group(list(holders), 0, n),)))
    best: PlanScore | None = None
    tried = 0
    for k in range(min_local_units, n + 1):
        if len(holders) > 1 and any(u in solo_units for u in range(k)):
            break  # every longer cut keeps that unit on the group too
        tried += 1
        if k == n:
            candidate = alone
        elif not helpers:
            continue
        else:
            rest_problem = problem.model_copy(
                update={"layers": problem.layers[k:], "devices": helpers, "pin_first": None}
            )
            rest = plan_rest(rest_problem)
            if rest is None:
                continue
            stages = [Stage.group(list(holders), 0, k)]
            stages += [Stage.group(st.devices, st.start + k, st.end + k) for st in rest.plan.stages]
            candidate = score(Plan(tuple(stages)))
        if candidate.feasible and (best is None or candidate.step_time_s < best.step_time_s):
            best = candidate
    each = {h: score_plan(problem, Plan.of((h, 0, n))) for h in holders}
    return HolderPlans(best=best, holders_alone=alone, each_alone=each, tried=tried)
