"""Baseline partitioners, for comparison in the benchmark and the plan report only.

Each returns a plan that is scored with the same spec formula as edgetrain's
own (:func:`coordinator.planner.score.score_plan`); a plan that breaks a memory
limit is reported as infeasible, not dropped. "The given order" is the order of
``devices`` in the problem, with ``pin_first`` moved to the front.

- ``single``: the best single device that can hold the model.
- ``even``: every device in the given order, the same number of units each.
- ``pipedream``: every device in the given order, cuts that balance FLOPs as
  if the devices were identical (PipeDream's partitioner on a homogeneous
  cluster model), no memory check.
- ``ftpipehd``: every device in the given order, cuts chosen by dynamic
  programming to minimise the bottleneck with each device's real speed and
  link (FTPipeHD's heterogeneity-aware partitioning), no memory check.

For a version 2 problem two more, from :mod:`coordinator.planner.group_search`:

- ``data-parallel``: one stage on the best group of the fastest devices;
- ``pipeline-only``: the version 1 planner's plan for the same devices.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from coordinator.planner.group_search import data_parallel_only
from coordinator.planner.holders import HolderPlans
from coordinator.planner.score import Plan, PlanScore, Stage, score_plan
from coordinator.planner.solve import plan_problem
from coordinator.planner.tables import CostTables
from edge.problem import PlanningProblem

__all__ = ["BASELINES", "LOCAL_DATA_FORBIDS", "job_baselines", "run_baselines"]


def _given_order(problem: PlanningProblem) -> list[str]:
    ids = [d.id for d in problem.devices]
    if problem.pin_first is not None:
        ids.remove(problem.pin_first)
        ids.insert(0, problem.pin_first)
    return ids[: len(problem.layers)]


def _plan_from_bounds(ids: list[str], bounds: list[int]) -> Plan:
    return Plan(tuple(Stage(d, a, b) for d, a, b in zip(ids, bounds, bounds[1:], strict=False)))


def single_device(problem: PlanningProblem) -> Plan:
    """The single device with the least step time among those that fit (else the fastest)."""
    n = len(problem.layers)
    ids = [problem.pin_first] if problem.pin_first else [d.id for d in problem.devices]
    scores = [score_plan(problem, Plan((Stage(d, 0, n),))) for d in ids]
    feasible = [s for s in scores if s.feasible] or scores
    return min(feasible, key=lambda s: s.step_time_s).plan


def even_split(problem: PlanningProblem) -> Plan:
    """All devices in the given order, units shared out as evenly as counts allow."""
    ids, n = _given_order(problem), len(problem.layers)
    bounds = [round(i * n / len(ids)) for i in range(len(ids) + 1)]
    return _plan_from_bounds(ids, bounds)


def _min_max_partition(
    weights: np.ndarray, parts: int, cost: Callable[[int, int, int], float]
) -> list[int]:
    """Cut ``len(weights)`` units into ``parts`` non-empty ranges minimising the largest
    ``cost(part, start, end)``; returns the bounds. O(parts * n^2)."""
    n = len(weights)
    inf = float("inf")
    best = np.full((parts + 1, n + 1), inf)
    arg = np.zeros((parts + 1, n + 1), dtype=int)
    best[0, 0] = 0.0
    for p in range(1, parts + 1):
        for end in range(p, n - (parts - p) + 1):
            for start in range(p - 1, end):
                if best[p - 1, start] == inf:
                    continue
                val = max(best[p - 1, start], cost(p - 1, start, end))
                if val < best[p, end]:
                    best[p, end], arg[p, end] = val, start
    bounds = [n]
    for p in range(parts, 0, -1):
        bounds.append(int(arg[p, bounds[-1]]))
    return bounds[::-1]


def pipedream(problem: PlanningProblem) -> Plan:
    """All devices in the given order, FLOPs balanced as if every device were the same."""
    ids = _given_order(problem)
    flops = np.array([unit.train_flops for unit in problem.layers])
    prefix = np.concatenate([[0.0], np.cumsum(flops)])
    bounds = _min_max_partition(flops, len(ids), lambda _p, a, b: prefix[b] - prefix[a])
    return _plan_from_bounds(ids, bounds)


def ftpipehd(problem: PlanningProblem) -> Plan:
    """All devices in the given order, cuts minimising the real bottleneck (no memory check)."""
    ids = _given_order(problem)
    tab = CostTables.build(problem)
    index = [tab.ids.index(d) for d in ids]

    def cost(p: int, a: int, b: int) -> float:
        t = float(tab.compute[index[p], a, b])
        if b < tab.num_units and p + 1 < len(index):
            t = max(t, float(tab.link[index[p], index[p + 1], b]))
        return t

    bounds = _min_max_partition(np.zeros(tab.num_units), len(ids), cost)
    return _plan_from_bounds(ids, bounds)


BASELINES: dict[str, Callable[[PlanningProblem], Plan]] = {
    "single": single_device,
    "even": even_split,
    "pipedream": pipedream,
    "ftpipehd": ftpipehd,
}


def run_baselines(problem: PlanningProblem, time_budget_s: float = 8.0) -> dict[str, PlanScore]:
    """Every baseline's plan scored with the spec formula (feasible or not); a version 2
    problem's baselines also "data parallel only" and "pipeline only" where they exist."""
    out = {name: score_plan(problem, fn(problem)) for name, fn in BASELINES.items()}
    if problem.version == 2:
        group = data_parallel_only(problem)
        if group is not None:
            out["data-parallel"] = score_plan(problem, group)
        pipeline = plan_problem(problem.as_version(1), time_budget_s=time_budget_s).plan
        if pipeline is not None:
            out["pipeline-only"] = score_plan(problem, pipeline)
    return out


LOCAL_DATA_FORBIDS = "the data may not leave the devices that hold it"
"""Why a local-data job's usual baselines are not options for it."""


def job_baselines(
    problem: PlanningProblem, holders: HolderPlans | None = None
) -> dict[str, dict[str, Any]]:
    """What a job's plan is compared with, each scored as the plan is: the baselines of
    :func:`run_baselines`; on local data (``holders``), first the alternatives its
    constraints allow (the holders alone together, each alone on its own data), and the
    usual baselines, which read the data anywhere, labelled forbidden."""
    usual = {
        k: {"throughput_sps": b.throughput_sps, "feasible": b.feasible}
        for k, b in run_baselines(problem).items()
    }
    if holders is None:
        return usual
    out: dict[str, dict[str, Any]] = {
        "holders alone": {
            "throughput_sps": holders.holders_alone.throughput_sps,
            "feasible": holders.holders_alone.feasible,
        }
    }
    for device, alone in holders.each_alone.items():
        out[f"{device} alone, its own data"] = {
            "throughput_sps": alone.throughput_sps,
            "feasible": alone.feasible,
        }
    for k, b in usual.items():
        out[k] = {**b, "forbidden": LOCAL_DATA_FORBIDS}
    return out
