"""The number of microbatches chosen with the plan ([Note: choosing the microbatches]).

Each choice is checked against the brute force over every divisor of the batch, under
the same prediction, and the two forces the choice weighs are checked to move it the
way they must: fixed costs per microbatch towards fewer, the bubble towards more.
"""

from __future__ import annotations

import pytest

from coordinator.planner.build import build_problem, parse_fleet
from coordinator.planner.group_search import plan_any
from coordinator.planner.microbatches import (
    best_microbatches,
    first_microbatches,
    microbatch_choices,
    plan_microbatches,
)
from coordinator.planner.partition import scored
from coordinator.planner.predict import UnitSeconds, predict
from coordinator.planner.score import Plan
from edge.problem import PlanningProblem

BATCH = 32


def _problem(
    microbatch_s: float, frame_s: float = 0.0, fleet: str = "rpi4-4gb:4"
) -> PlanningProblem:
    """vgg11 over ``fleet`` at 4 microbatches, every device announcing these fixed costs."""
    problem = build_problem(
        "vgg11", parse_fleet(fleet), batch_size=BATCH, microbatches=4, version=1
    )
    costs = {"microbatch_s": microbatch_s, "step_s": 0.0, "frame_s": frame_s, "byte_s": 0.0}
    devices = [d.model_copy(update={"details": {"fixed_costs": costs}}) for d in problem.devices]
    return problem.model_copy(update={"devices": devices})


def _pipeline(problem: PlanningProblem) -> Plan:
    plan = plan_any(problem, time_budget_s=5).plan
    assert plan is not None and len(plan.stages) > 1, "the case is a pipeline"
    return plan


def _brute(problem: PlanningProblem, plan: Plan, units: UnitSeconds | None) -> int:
    """The fastest feasible number of microbatches, each predicted on its own problem."""
    rows = BATCH / problem.microbatches
    best = None
    for m in microbatch_choices(BATCH):
        q = problem.model_copy(update={"microbatches": m})
        moved = None if units is None else units.at_rows(BATCH / m, rows)
        score, guess = scored(q, plan, moved)
        if score.feasible and (best is None or guess.step_time_s < best[1]):
            best = (m, guess.step_time_s)
    assert best is not None
    return best[0]


def test_the_choices_are_the_divisors_with_enough_rows() -> None:
    assert microbatch_choices(32) == (1, 2, 4, 8, 16, 32)
    assert microbatch_choices(32, min_rows=2) == (1, 2, 4, 8, 16)
    assert microbatch_choices(12, most=4) == (1, 2, 3, 4)
    assert microbatch_choices(7) == (1, 7)
    assert first_microbatches((1, 2, 4, 8)) == 4
    assert first_microbatches((1, 3, 9)) == 9
    assert first_microbatches((1, 2)) == 2
    with pytest.raises(ValueError, match="at least 1"):
        microbatch_choices(0)


def test_unit_seconds_move_along_their_fitted_line() -> None:
    """The fixed part stays, the rest follows the rows; devices' own seconds move too."""
    own = UnitSeconds((2.0, 4.0), 10.0, (1.0, 0.0))
    units = UnitSeconds((1.0, 3.0), 20.0, (0.5, 1.0), devices={"a": own})
    half = units.at_rows(4, 8)
    assert half.seconds == (0.75, 2.0) and half.fixed == units.fixed
    assert half.devices["a"].seconds == (1.5, 2.0)
    assert units.at_rows(8, 8) is units
    assert UnitSeconds((1.0,), 20.0).at_rows(16, 8).seconds == (2.0,)  # no fixed part


@pytest.mark.parametrize("microbatch_s", [0.0, 0.02, 0.5])
def test_the_choice_is_the_fastest_of_every_divisor(microbatch_s: float) -> None:
    problem = _problem(microbatch_s)
    plan = _pipeline(problem)
    units = UnitSeconds(
        tuple(0.02 for _ in problem.layers), 20.0, tuple(0.005 for _ in problem.layers)
    )
    chose = best_microbatches(problem, plan, units, microbatch_choices(BATCH), scored)
    assert chose is not None
    assert chose.microbatches == _brute(problem, plan, units)
    q = problem.model_copy(update={"microbatches": chose.microbatches})
    moved = units.at_rows(BATCH / chose.microbatches, BATCH / 4)
    assert chose.prediction == predict(q, plan, moved)


def test_fixed_costs_per_microbatch_take_microbatches_away() -> None:
    """Free microbatches: the bubble shrinks with each, so the most are best. A cost of half
    a second each on every device: the fewest. In between, in between."""
    chosen = []
    for microbatch_s in (0.0, 0.02, 0.5):
        problem = _problem(microbatch_s)
        plan = _pipeline(problem)
        chose = best_microbatches(problem, plan, None, microbatch_choices(BATCH), scored)
        assert chose is not None
        chosen.append(chose.microbatches)
    assert chosen[0] == BATCH
    assert chosen[0] > chosen[1] > chosen[2], chosen


def test_a_unit_s_fixed_part_takes_microbatches_away() -> None:
    """No device costs anything fixed; the units' own fixed parts alone move the choice."""
    problem = _problem(0.0)
    plan = _pipeline(problem)
    n = len(problem.layers)
    choices = microbatch_choices(BATCH)
    by_rows = best_microbatches(problem, plan, UnitSeconds((0.1,) * n, 20.0), choices, scored)
    fixed = UnitSeconds((0.1,) * n, 20.0, (0.09,) * n)
    with_fixed = best_microbatches(problem, plan, fixed, choices, scored)
    assert by_rows is not None and with_fixed is not None
    assert by_rows.microbatches == BATCH
    assert with_fixed.microbatches < by_rows.microbatches


def test_memory_bounds_the_choice_from_below() -> None:
    """A device that holds the stage's activations only in small microbatches: the
    choices whose rows do not fit are not taken, even where fixed costs favour them."""
    problem = _problem(0.5)
    plan = _pipeline(problem)
    need = {}
    for m in microbatch_choices(BATCH):
        score, _ = scored(problem.model_copy(update={"microbatches": m}), plan, None)
        need[m] = max(score.memory_bytes)
    memory = (need[4] + need[2]) / 2  # 4 microbatches fit, 2 do not
    devices = [d.model_copy(update={"memory_bytes": int(memory)}) for d in problem.devices]
    tight = problem.model_copy(update={"devices": devices})
    chose = best_microbatches(tight, plan, None, microbatch_choices(BATCH), scored)
    assert chose is not None and chose.microbatches == 4


def test_plan_and_microbatches_together_are_never_slower_than_the_first() -> None:
    problem = _problem(0.02, frame_s=0.005, fleet="rpi4-4gb:3,rpi5-8gb")
    n = len(problem.layers)
    units = UnitSeconds((0.02,) * n, 20.0, (0.01,) * n)
    searched: list[int] = []

    def search(q: PlanningProblem, moved: UnitSeconds | None) -> Plan:
        searched.append(q.microbatches)
        plan = plan_any(q, time_budget_s=5).plan
        assert plan is not None
        return plan

    choices = microbatch_choices(BATCH)
    at, chose = plan_microbatches(problem, units, choices, search, scored)
    assert searched[0] == first_microbatches(choices) and len(searched) <= 3
    assert at.microbatches == chose.microbatches
    first = scored(problem, search(problem, units), units)[1]
    assert chose.prediction.step_time_s <= first.step_time_s
    plan = chose.score.plan
    assert chose.microbatches == _brute(problem, plan, units)
