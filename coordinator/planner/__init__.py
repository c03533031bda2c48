"""The planner: which devices run which contiguous range of units, in which order.

- :mod:`coordinator.planner.score`: plans and the spec's score (``shared/spec/planning.md``, v2);
- :mod:`coordinator.planner.terms`: each cost term of the score once, for floats and arrays;
- :mod:`coordinator.planner.tables`: version 1's terms as arrays over ranges and device pairs;
- :mod:`coordinator.planner.group_tables`: version 2's terms per device group, as arrays;
- :mod:`coordinator.planner.search`: the threshold search and version 1's dynamic programmes;
- :mod:`coordinator.planner.solve`: version 1's entry point, exact or heuristic by fleet size;
- :mod:`coordinator.planner.group_search`: version 2's search (groups, energy, deadlines, re-plan);
- :mod:`coordinator.planner.bounds`: a lower bound on any plan's step time;
- :mod:`coordinator.planner.baselines`: the partitioners edgetrain is compared with;
- :mod:`coordinator.planner.build`: a planning problem from a zoo model and a fleet;
- :mod:`coordinator.planner.codecs`: each link's codec, compressed only where it pays;
- :mod:`coordinator.planner.holders`: plans for data that stays home (holders, U-shaped);
- :mod:`coordinator.planner.predict`: the internal cost model: a plan's step on real devices;
- :mod:`coordinator.planner.refine`: a job's plan improved by that prediction;
- :mod:`coordinator.planner.microbatches`: how many microbatches a step splits into (``auto``);
- :mod:`coordinator.planner.partition`: a job's ``partition`` and ``stages`` made into a plan;
- :mod:`coordinator.planner.simulator`: one step of a plan under a schedule, event by event;
- :mod:`coordinator.planner.anatomy`: where a plan's step goes, per member, in parts that add up.
"""

from coordinator.planner.score import Plan, PlanScore, Stage, score_plan
from coordinator.planner.solve import SearchResult, plan_problem

__all__ = ["Plan", "PlanScore", "SearchResult", "Stage", "plan_problem", "score_plan"]
