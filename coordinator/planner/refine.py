"""A job's plan improved under the internal model: a local search by prediction.

The searches (:mod:`coordinator.planner.search`, :mod:`coordinator.planner.group_search`)
find the best plan under the spec's score; the internal model
(:func:`~coordinator.planner.predict.predict`) ranks plans by what they will take on the
job's devices, and its best can be a neighbour of the score's best that no search
returns: a member split off a group into a stage of its own where the units it would
share do not shrink with the rows, a cut one unit over. :func:`refine` walks from a
plan to the neighbour predicted fastest, step by step, while one is faster.

The neighbours of a plan (:func:`neighbours`): each cut one unit either way; each member
of a group moved to the stage before or after; each member split off a group into a
stage of its own before or after the rest, at every cut inside the group's units; two
neighbouring stages merged into one group; a device the plan leaves out added to a
stage, or put in a member's place; a member of a group left out. A neighbour counts
only if it is a valid plan that fits under the spec's score (memory, ``pin_first``, a
deadline) and within the runtime's ``limits``.

Tested in tests/unit/coordinator/planner/test_predict.py.
"""

from __future__ import annotations

from collections.abc import Iterator

from coordinator.planner.group_tables import GroupLimits
from coordinator.planner.predict import Prediction, UnitSeconds, predict
from coordinator.planner.score import Plan, Stage, score_plan
from edge.problem import PlanningProblem

__all__ = ["neighbours", "refine"]

MAX_STEPS = 50
"""At most this many improving steps (each one strictly faster): a bound, not a budget."""


def refine(
    problem: PlanningProblem,
    plan: Plan,
    units: UnitSeconds | None,
    limits: GroupLimits | None = None,
) -> tuple[Plan, Prediction]:
    """The plan reached from ``plan`` (one that fits ``problem``) by moving to the
    neighbour predicted fastest while one is predicted faster, and its prediction; a
    version 2 ``problem`` that allows groups (module docstring)."""
    best, guess = plan, predict(problem, plan, units)
    for _ in range(MAX_STEPS):
        step: tuple[Plan, Prediction] | None = None
        for other in neighbours(problem, best):
            if not _fits(problem, other, limits):
                continue
            got = predict(problem, other, units)
            if got.step_time_s < (step[1] if step else guess).step_time_s * (1 - 1e-9):
                step = (other, got)
        if step is None:
            break
        best, guess = step
    return best, guess


def neighbours(problem: PlanningProblem, plan: Plan) -> Iterator[Plan]:
    """Every plan one move from ``plan`` (module docstring), valid or not."""
    order = {d.id: i for i, d in enumerate(problem.devices)}
    stages = [(list(st.devices), st.start, st.end) for st in plan.stages]
    n = len(stages)

    def made(parts: list[tuple[list[str], int, int]]) -> Plan:
        return Plan(
            tuple(
                Stage.group(sorted(g, key=order.__getitem__), a, b)
                for g, a, b in parts
                if g and a < b
            )
        )

    for s in range(n - 1):  # a cut one unit either way
        (g, a, b), (h, _, c) = stages[s], stages[s + 1]
        for cut in (b - 1, b + 1):
            if a < cut < c:
                yield made([*stages[:s], (g, a, cut), (h, cut, c), *stages[s + 2 :]])
    for s, (g, a, b) in enumerate(stages):
        if len(g) < 2:
            continue
        for d in g:
            rest = [x for x in g if x != d]
            for t in (s - 1, s + 1):  # a member to the stage before or after
                if 0 <= t < n:
                    parts = [(list(x), y, z) for x, y, z in stages]
                    parts[s] = (rest, a, b)
                    parts[t] = (parts[t][0] + [d], parts[t][1], parts[t][2])
                    yield made(parts)
            for cut in range(a + 1, b):  # split off into a stage of its own
                yield made([*stages[:s], ([d], a, cut), (rest, cut, b), *stages[s + 1 :]])
                yield made([*stages[:s], (rest, a, cut), ([d], cut, b), *stages[s + 1 :]])
            yield made([*stages[:s], (rest, a, b), *stages[s + 1 :]])  # left out
    for s in range(n - 1):  # two neighbouring stages as one group
        (g, a, _), (h, _, c) = stages[s], stages[s + 1]
        yield made([*stages[:s], (g + h, a, c), *stages[s + 2 :]])
    used = set(plan.devices)
    for u in (d.id for d in problem.devices if d.id not in used):
        for s, (g, a, b) in enumerate(stages):
            yield made([*stages[:s], ([*g, u], a, b), *stages[s + 1 :]])
            for d in g:
                swapped = [u if x == d else x for x in g]
                yield made([*stages[:s], (swapped, a, b), *stages[s + 1 :]])


def _fits(problem: PlanningProblem, plan: Plan, limits: GroupLimits | None) -> bool:
    """Whether ``plan`` is valid for ``problem``, fits under the spec's score, and keeps
    within ``limits``."""
    if limits is not None and not limits.allows(problem, plan):
        return False
    try:
        return score_plan(problem, plan).feasible
    except ValueError:  # not a plan of this problem (pin_first not in stage 0, say)
        return False
