"""Which unused devices the group search brings in (``group_search._spare``).

One device per class of identical devices, and none of a class another unused
class dominates: as fast, as much memory, as fast a link, as short a latency,
and for the energy objective as frugal busy and idle. Each case has a device
that only one figure keeps in, so dropping that figure from the rule fails it.
"""

from __future__ import annotations

from typing import Any

import pytest
from support.planning import make_problem

from coordinator.planner.group_search import _class_of, _spare
from edge.problem import Objective, PlanningProblem

LAYERS = [{"fwd_flops": 1e9, "param_bytes": 1e6, "out_bytes": 1e5, "act_bytes": 1e5}] * 4
BEST = {"gflops": 100.0, "memory_bytes": 8e9, "bandwidth_mbps": 1000.0, "latency_ms": 1.0}


def _problem(devices: list[dict[str, Any]], minimize: str = "time") -> PlanningProblem:
    power = {"watts_busy": 10.0, "watts_idle": 2.0}
    base = make_problem(LAYERS, [{**BEST, **_without(d, power)} for d in devices])
    with_power = [
        d.model_copy(update={k: spec.get(k, v) for k, v in power.items()})
        for d, spec in zip(base.devices, devices, strict=True)
    ]
    goal = Objective(minimize=minimize)  # type: ignore[arg-type]
    return base.model_copy(update={"version": 2, "objective": goal, "devices": with_power})


def _without(d: dict[str, Any], keys: dict[str, float]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k not in keys}


def _spare_ids(problem: PlanningProblem, used: tuple[tuple[int, ...], ...]) -> set[str]:
    return {problem.devices[i].id for i in _spare(used, problem, _class_of(problem))}


@pytest.mark.parametrize(
    "kept",
    [
        {"id": "memory", "gflops": 50.0, "memory_bytes": 16e9},
        {"id": "link", "gflops": 50.0, "bandwidth_mbps": 2000.0},
        {"id": "latency", "gflops": 50.0, "latency_ms": 0.5},
        {"id": "speed", "gflops": 200.0, "memory_bytes": 1e9},
    ],
)
def test_a_device_better_in_one_figure_is_kept_a_dominated_one_is_not(
    kept: dict[str, Any],
) -> None:
    problem = _problem(
        [
            {"id": "used"},
            {"id": "best"},
            {"id": "twin"},  # the same class as "best": one of them is offered
            {"id": "slower", "gflops": 50.0},  # "best" is as good in every figure
            kept,
        ]
    )
    assert _spare_ids(problem, ((0,),)) == {"best", kept["id"]}
    # Once the others are in the plan, "slower" is no longer dominated.
    assert _spare_ids(problem, ((0, 1, 2), (4,))) == {"slower"}


def test_for_energy_a_frugal_device_is_kept() -> None:
    devices: list[dict[str, Any]] = [
        {"id": "used"},
        {"id": "best"},
        {"id": "frugal", "gflops": 50.0, "watts_busy": 4.0},
        {"id": "idler", "gflops": 50.0, "watts_idle": 1.0},
    ]
    assert _spare_ids(_problem(devices, "time"), ((0,),)) == {"best"}
    assert _spare_ids(_problem(devices, "energy"), ((0,),)) == {"best", "frugal", "idler"}
