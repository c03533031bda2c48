"""Random measured figures for the internal cost model's tests: the fixed costs an agent
announces and per-unit seconds with a part that does not shrink with the rows."""

from __future__ import annotations

import random

from coordinator.planner.predict import UnitSeconds
from edge.problem import PlanningProblem

__all__ = ["with_measured_costs"]


def with_measured_costs(
    problem: PlanningProblem, rng: random.Random
) -> tuple[PlanningProblem, UnitSeconds]:
    """``problem`` with every device announcing the same random fixed costs, and random
    unit seconds (each with a fixed part of up to 80%), drawn from ``rng``."""
    costs = {
        "microbatch_s": rng.uniform(0, 0.01),
        "step_s": rng.uniform(0, 0.05),
        "frame_s": rng.uniform(0, 0.01),
        "byte_s": 10 ** rng.uniform(-10, -7),
    }
    devices = [d.model_copy(update={"details": {"fixed_costs": costs}}) for d in problem.devices]
    problem = problem.model_copy(update={"devices": devices})
    seconds = tuple(rng.uniform(0.01, 0.5) for _ in problem.layers)
    units = UnitSeconds(seconds, 20.0, fixed=tuple(s * rng.uniform(0, 0.8) for s in seconds))
    return problem, units
