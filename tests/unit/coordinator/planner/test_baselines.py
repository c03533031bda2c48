"""Baselines do what they claim, and the planner never loses to them."""

from __future__ import annotations

import itertools
import random

import pytest

from coordinator.planner import plan_problem, score_plan
from coordinator.planner.baselines import (
    even_split,
    ftpipehd,
    pipedream,
    run_baselines,
    single_device,
)
from coordinator.planner.bounds import lower_bound
from coordinator.planner.score import Plan, Stage, validate_plan
from coordinator.planner.tables import CostTables
from edge.problem import DeviceSpec, PlanningProblem, UnitSpec


def problem(seed: int, layers: int = 9, devices: int = 4, pin: bool = False) -> PlanningProblem:
    rng = random.Random(seed)
    return PlanningProblem(
        version=1,
        batch_size=32,
        microbatches=rng.choice([1, 4, 8]),
        layers=[
            UnitSpec(
                name=f"l{i}",
                fwd_flops=rng.uniform(1e6, 5e8),
                param_bytes=rng.uniform(1e4, 1e7),
                out_bytes=rng.uniform(1e3, 1e6),
            )
            for i in range(layers)
        ],
        devices=[
            DeviceSpec(
                id=f"d{j}",
                gflops=rng.choice([5.0, 50.0]) * rng.uniform(0.8, 1.2),
                memory_bytes=rng.uniform(1e8, 1e9),
                bandwidth_mbps=rng.uniform(50, 1000),
                latency_ms=rng.uniform(0.1, 3),
            )
            for j in range(devices)
        ],
        pin_first="d2" if pin else None,
    )


def _given(p: PlanningProblem) -> list[str]:
    ids = [d.id for d in p.devices]
    if p.pin_first:
        ids.remove(p.pin_first)
        ids.insert(0, p.pin_first)
    return ids


@pytest.mark.parametrize("seed", range(12))
def test_baselines_are_valid_plans_and_never_beat_the_planner(seed: int) -> None:
    p = problem(seed, pin=seed % 2 == 1)
    best = plan_problem(p).score
    for name, score in run_baselines(p).items():
        assert validate_plan(p, score.plan) == [], name
        if best is not None and score.feasible:
            assert best.step_time_s <= score.step_time_s * (1 + 1e-12), name
    if best is not None:
        assert lower_bound(p) <= best.step_time_s * (1 + 1e-12)


def test_even_split_and_pipedream_use_every_device_in_the_given_order() -> None:
    p = problem(3, layers=10, devices=4, pin=True)
    for plan in (even_split(p), pipedream(p)):
        assert [s.device for s in plan.stages] == _given(p)
    sizes = [s.end - s.start for s in even_split(p).stages]
    assert sorted(sizes) == [2, 2, 3, 3]


def _max_over_cuts(p: PlanningProblem, cost) -> float:  # type: ignore[no-untyped-def]
    ids, n = _given(p), len(p.layers)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), len(ids) - 1):
        bounds = [0, *cuts, n]
        best = min(best, max(cost(s, bounds[s], bounds[s + 1]) for s in range(len(ids))))
    return best


def test_pipedream_balances_flops_as_if_devices_were_identical() -> None:
    p = problem(5, layers=9, devices=4)
    flops = [unit.train_flops for unit in p.layers]
    plan = pipedream(p)
    got = max(sum(flops[s.start : s.end]) for s in plan.stages)
    assert got == pytest.approx(_max_over_cuts(p, lambda _s, a, b: sum(flops[a:b])))


def test_ftpipehd_minimises_the_real_bottleneck_for_its_order() -> None:
    p = problem(7, layers=9, devices=4, pin=True)
    tab = CostTables.build(p)
    ids = _given(p)
    idx = [tab.ids.index(d) for d in ids]

    def cost(s: int, a: int, b: int) -> float:
        t = float(tab.compute[idx[s], a, b])
        if s + 1 < len(ids):
            t = max(t, float(tab.link[idx[s], idx[s + 1], b]))
        return t

    assert score_plan(p, ftpipehd(p)).bottleneck_s == pytest.approx(_max_over_cuts(p, cost))


def test_single_device_prefers_a_device_that_fits() -> None:
    p = problem(1, devices=3)
    total = sum(unit.param_bytes for unit in p.layers) * p.optimizer_state_factor
    roomy = p.devices[0].model_copy(update={"memory_bytes": total * 10, "gflops": 1.0})
    small = [d.model_copy(update={"memory_bytes": total / 10}) for d in p.devices[1:]]
    p = p.model_copy(update={"devices": [roomy, *small]})
    assert single_device(p) == Plan((Stage(roomy.id, 0, len(p.layers)),))
