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

With ``labels_local`` the labels stay home too, and the holders also run the last
units and the loss, each on its own samples: the plan is U-shaped, holders, then
helpers, then the holders again, with the same shares at both ends
(:attr:`~coordinator.planner.score.Plan.u_shaped`, scored with both ends on the
holders: two more links, both segments' memory and compute). Then for each ``k``
and each start ``m > k`` of the tail (at least one unit), the helpers' best plan
of units ``[k, m)`` between the two ends; and ``k = n``, the holders alone.

The fastest feasible plan wins. Beside it, :class:`HolderPlans` keeps the
alternatives the job's constraints allow, each scored the same way: the holders
alone together, and each holder alone on its own data.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from coordinator.planner.score import Plan, PlanScore, Stage, for_plan, score_plan
from edge.problem import PlanningProblem

__all__ = ["HolderPlans", "holder_ends", "plan_with_holders"]


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
    """How many ways to cut (``k``, and with labels local ``m``) were scored."""


def holder_ends(plan: Plan, shares: Sequence[float]) -> dict[int, list[float]]:
    """The fixed shares of ``plan``'s stages on the holders (``shares``, by their data):
    stage 0, and a U-shaped plan's last stage too (:func:`score_plan`'s ``fixed_shares``)."""
    last = len(plan.stages) - 1 if plan.u_shaped else 0
    return {0: list(shares), last: list(shares)}


def plan_with_holders(
    problem: PlanningProblem,
    holders: Sequence[str],
    shares: Sequence[float],
    plan_rest: Callable[[PlanningProblem], PlanScore | None],
    *,
    min_local_units: int = 1,
    solo_units: frozenset[int] = frozenset(),
    labels_local: bool = False,
) -> HolderPlans:
    """The plans of ``problem`` with stage 0 on ``holders`` at ``shares`` (see the module
    docstring). ``solo_units`` are units no group may train (BatchNorm): a cut that
    leaves one on a group of holders is not tried. ``labels_local``: U-shaped plans
    only (the holders alone aside)."""
    n = len(problem.layers)
    if not 1 <= min_local_units <= n:
        raise ValueError(f"min_local_units {min_local_units} is not between 1 and {n}")
    helpers = [d for d in problem.devices if d.id not in set(holders)]
    solo = len(holders) > 1 and bool(solo_units)

    def score(plan: Plan) -> PlanScore:
        return score_plan(for_plan(problem, plan), plan, fixed_shares=holder_ends(plan, shares))

    def helped(k: int, m: int) -> PlanScore | None:
        """The plan with the holders on ``[0, k)`` (and with a tail, ``[m, n)``), the
        helpers' own best plan of ``[k, m)`` between; ``None`` if the helpers have none."""
        rest = plan_rest(
            problem.model_copy(
                update={"layers": problem.layers[k:m], "devices": helpers, "pin_first": None}
            )
        )
        if rest is None:
            return None
        stages = [Stage.group(list(holders), 0, k)]
        stages += [Stage.group(st.devices, st.start + k, st.end + k) for st in rest.plan.stages]
        if m < n:
            stages.append(Stage.group(list(holders), m, n))
        return score(Plan(tuple(stages), u_shaped=m < n))

    alone = score(Plan((Stage.group(list(holders), 0, n),)))
    best: PlanScore | None = None
    tried = 0
    for k in range(min_local_units, n + 1):
        if solo and any(u in solo_units for u in range(k)):
            break  # every longer cut keeps that unit on the group too
        tails = [n] if k == n or not labels_local else range(k + 1, n)
        for m in tails:
            if solo and any(u in solo_units for u in range(m, n)):
                continue  # the tail would keep that unit on the group
            tried += 1
            if k == n:
                candidate: PlanScore | None = alone
            elif not helpers:
                continue
            else:
                candidate = helped(k, m)
            if candidate is None or not candidate.feasible:
                continue
            if best is None or candidate.step_time_s < best.step_time_s:
                best = candidate
    each = {h: score_plan(problem, Plan.of((h, 0, n))) for h in holders}
    return HolderPlans(best=best, holders_alone=alone, each_alone=each, tried=tried)
