"""The planner: which devices run which contiguous range of units, in which order.

- :mod:`coordinator.planner.score`: plans and the spec's score (``shared/spec/planning.md``);
- :mod:`coordinator.planner.tables`: the score's terms as arrays for the search;
- :mod:`coordinator.planner.search`: threshold search and the dynamic programmes;
- :mod:`coordinator.planner.solve`: the entry point, exact or heuristic by fleet size;
- :mod:`coordinator.planner.partition`: a job's ``partition`` and ``stages`` made into a plan.
"""

from coordinator.planner.score import Plan, PlanScore, Stage, score_plan
from coordinator.planner.solve import SearchResult, plan_problem

__all__ = ["Plan", "PlanScore", "SearchResult", "Stage", "plan_problem", "score_plan"]
