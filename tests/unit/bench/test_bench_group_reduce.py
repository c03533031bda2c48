"""bench/group_reduce.py's prediction is the planning spec's ring term, and the planner's."""

from __future__ import annotations

from types import ModuleType

import pytest
from support.bench import load_bench

from coordinator.planner.score import Plan, Stage, score_plan
from edge.problem import DeviceSpec, PlanningProblem, UnitSpec


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_bench("group_reduce")


def test_the_prediction_is_the_specs_ring_term(bench: ModuleType) -> None:
    # 2 (g - 1) latency + 2 (g - 1) / g P 8 / bw: 3 members, 6 MB, 100 Mbit/s, 5 ms.
    assert bench.predicted_s(3, 6_000_000, 100.0, 5.0) == pytest.approx(0.02 + 0.64)
    assert bench.predicted_s(2, 1_000_000, 8.0, 0.0) == pytest.approx(1.0)


def test_the_prediction_is_what_the_planner_scores(bench: ModuleType) -> None:
    """A two-member stage of P parameter bytes on 100 Mbit/s, 5 ms links."""
    nbytes = 4_000_000
    devices = [
        DeviceSpec(id=d, gflops=10.0, memory_bytes=1e12, bandwidth_mbps=100.0, latency_ms=5.0)
        for d in ("a", "b")
    ]
    unit = UnitSpec(name="u", fwd_flops=1e6, param_bytes=nbytes, out_bytes=1)
    problem = PlanningProblem(
        version=2, batch_size=4, microbatches=1, layers=[unit], devices=devices
    )
    score = score_plan(problem, Plan((Stage.group(["a", "b"], 0, 1),)))
    assert score.allreduce_s[0] == pytest.approx(bench.predicted_s(2, nbytes, 100.0, 5.0))
