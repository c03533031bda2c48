"""How many microbatches a job's step splits into, when the job leaves it to the planner.

A job's ``microbatches: "auto"`` (:attr:`~coordinator.engine.spec.JobBase.microbatches`)
is settled here, with its plan (:func:`plan_microbatches`).

[Note: choosing the microbatches]
A pipeline's step is ``(M - 1) tau + sum(T) + sum(C)`` plus what a step pays once
(``shared/spec/planning-v2.md``; :func:`~coordinator.planner.predict.predict`). More
microbatches shrink the bubble, since each one's ``T`` and ``C`` shrink with its rows.
But every microbatch also pays what does not shrink with its rows:
- each unit's fixed part (the intercept of its fitted line,
  :func:`~coordinator.planner.predict.fit_unit_seconds`);
- the device's fixed cost per microbatch;
- each frame's fixed cost and the link's latency.

Fewer microbatches hold more rows in flight, so memory bounds the choice from the
other side. So for a plan the planner predicts the step at every divisor ``M`` of the
batch (:func:`microbatch_choices`, each microbatch with at least ``min_rows`` rows),
with the unit seconds moved along their fitted lines to ``B / M`` rows
(:meth:`~coordinator.planner.predict.UnitSeconds.at_rows`). It keeps the fastest
``M`` whose memory fits under the spec's score (:func:`best_microbatches`).

The plan depends on ``M``, and ``M`` on the plan. So :func:`plan_microbatches`
alternates:
1. plan at a first ``M`` (:func:`first_microbatches`);
2. choose ``M`` for that plan;
3. plan again at it, until a choice repeats (at most :data:`ROUNDS` plans).

It keeps the fastest predicted pair. Without measured unit seconds and fixed costs
(a catalogue fleet, a problem file), only the spec's terms weigh: the bubble against
the links' latency per microbatch.

Tested in tests/unit/coordinator/planner/test_microbatches.py and
tests/unit/coordinator/engine/test_auto_microbatches.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from coordinator.planner.predict import Prediction, UnitSeconds
from coordinator.planner.score import Plan, PlanScore
from edge.problem import PlanningProblem

__all__ = [
    "FIRST_MICROBATCHES",
    "ROUNDS",
    "Choice",
    "best_microbatches",
    "first_microbatches",
    "microbatch_choices",
    "plan_microbatches",
]

FIRST_MICROBATCHES = 4
"""The first ``M`` tried: the least choice of at least this many (a 1F1B pipeline of a few
stages fills at about as many microbatches); also the shape the unit seconds are timed
at, before they are moved to other row counts."""

ROUNDS = 3
"""At most this many plans are searched for one job (one per ``M`` tried)."""

Scorer = Callable[[PlanningProblem, Plan, UnitSeconds | None], tuple[PlanScore, Prediction]]
"""A plan's score on a problem and its prediction with unit seconds (the job's planner's
own, :func:`~coordinator.planner.partition.scored`)."""


@dataclass(frozen=True)
class Choice:
    """A number of microbatches for a plan, and the plan's score and prediction at it."""

    microbatches: int
    score: PlanScore
    prediction: Prediction
    found_at: int
    """The ``M`` whose search found the plan."""


def microbatch_choices(batch_size: int, *, min_rows: int = 1, most: int = 1024) -> tuple[int, ...]:
    """The numbers of microbatches ``batch_size`` splits into evenly, each microbatch of at
    least ``min_rows`` rows, at most ``most`` of them; in increasing order."""
    if batch_size < 1 or min_rows < 1:
        raise ValueError(f"batch size {batch_size} and min_rows {min_rows} must be at least 1")
    found = [
        m for m in range(1, batch_size + 1) if batch_size % m == 0 and batch_size // m >= min_rows
    ]
    return tuple(m for m in found if m <= most) or (1,)


def first_microbatches(choices: Sequence[int]) -> int:
    """The first ``M`` to plan at: the least of ``choices`` that is at least
    :data:`FIRST_MICROBATCHES`, else the largest."""
    return next((m for m in choices if m >= FIRST_MICROBATCHES), max(choices))


def _at(problem: PlanningProblem, microbatches: int) -> PlanningProblem:
    return problem.model_copy(update={"microbatches": microbatches})


def best_microbatches(
    problem: PlanningProblem,
    plan: Plan,
    units: UnitSeconds | None,
    choices: Sequence[int],
    scored: Scorer,
) -> Choice | None:
    """The ``M`` of ``choices`` at which ``plan`` is predicted fastest, its memory fitting
    and each member of its groups with a row of every microbatch (see [Note: choosing the
    microbatches]). ``units`` were timed at ``problem``'s rows a microbatch. Ties go to
    fewer microbatches; ``None`` when it fits at none."""
    rows = problem.batch_size / problem.microbatches
    widest = max(len(st.devices) for st in plan.stages)
    best: Choice | None = None
    for m in sorted(choices):
        if problem.batch_size // m < widest:
            continue
        q = _at(problem, m)
        moved = None if units is None else units.at_rows(q.batch_size / m, rows)
        score, guess = scored(q, plan, moved)
        if not score.feasible:
            continue
        if best is None or guess.step_time_s < best.prediction.step_time_s:
            best = Choice(m, score, guess, problem.microbatches)
    return best


def plan_microbatches(
    problem: PlanningProblem,
    units: UnitSeconds | None,
    choices: Sequence[int],
    search: Callable[[PlanningProblem, UnitSeconds | None], Plan],
    scored: Scorer,
) -> tuple[PlanningProblem, Choice]:
    """The plan and ``M`` predicted fastest (see [Note: choosing the microbatches]):
    ``search(q, units)`` plans the problem ``q`` (``problem`` at some ``M``) with the unit
    seconds moved to its rows; ``units`` were timed at ``problem``'s rows. Returns the
    problem at the chosen ``M`` and the choice; the search's own error when it finds no
    plan at the first ``M``."""
    rows = problem.batch_size / problem.microbatches

    def moved(m: int) -> UnitSeconds | None:
        return None if units is None else units.at_rows(problem.batch_size / m, rows)

    m = first_microbatches(choices)
    tried: dict[int, Choice] = {}
    best: Choice | None = None
    while m not in tried and len(tried) < ROUNDS:
        plan = search(_at(problem, m), moved(m))
        score, guess = scored(_at(problem, m), plan, moved(m))
        tried[m] = Choice(m, score, guess, m)
        if score.feasible and (best is None or guess.step_time_s < best.prediction.step_time_s):
            best = tried[m]
        better = best_microbatches(_at(problem, m), plan, moved(m), choices, scored)
        if better is None:
            break
        if best is None or better.prediction.step_time_s < best.prediction.step_time_s:
            best = better
        m = better.microbatches
    if best is None:
        raise ValueError(f"no number of microbatches of {list(choices)} fits the plan's memory")
    return _at(problem, best.microbatches), best
