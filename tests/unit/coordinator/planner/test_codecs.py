"""The planner's link codecs: compress the slow uplink of a hybrid plan, nothing else."""

from __future__ import annotations

import pytest
from support.planning import make_problem

from coordinator.planner import Plan, plan_problem, score_plan
from coordinator.planner.codecs import (
    RATIO,
    choose_codecs,
    plan_with_codecs,
    with_codecs,
)
from edge.problem import PlanningProblem

GB = 1e9


def _hybrid(uplink_mbps: float) -> PlanningProblem:
    """A phone holding the data, a GPU server behind an uplink, and a 6-unit model.

    Unit 0 shrinks the input (a stem), units 1-5 are heavy; the phone is 50x slower.
    """
    layers = [{"fwd_flops": 2e8, "param_bytes": 1e5, "out_bytes": 2e5}] + [
        {"fwd_flops": 2e9, "param_bytes": 4e6, "out_bytes": 2e5} for _ in range(5)
    ]
    devices = [
        {
            "id": "phone",
            "gflops": 20,
            "memory_bytes": 4 * GB,
            "bandwidth_mbps": uplink_mbps,
            "latency_ms": 5,
        },
        {
            "id": "server",
            "gflops": 1000,
            "memory_bytes": 80 * GB,
            "bandwidth_mbps": 10_000,
            "latency_ms": 0.1,
        },
    ]
    return make_problem(layers, devices, batch_size=32, microbatches=4, pin_first="phone")


def _search(problem: PlanningProblem) -> Plan | None:
    return plan_problem(problem).plan


def test_with_codecs_scales_only_the_bytes_at_the_cuts() -> None:
    problem = _hybrid(100)
    plan = Plan.of(("phone", 0, 1), ("server", 1, 6))
    scaled = with_codecs(problem, plan, ["int8"])
    assert scaled.layers[0].out_bytes == problem.layers[0].out_bytes * RATIO["int8"]
    assert [unit.out_bytes for unit in scaled.layers[1:]] == [
        unit.out_bytes for unit in problem.layers[1:]
    ]
    with pytest.raises(ValueError, match="2 codecs for 1 links"):
        with_codecs(problem, plan, ["fp32", "fp32"])


def test_a_fast_link_keeps_fp32() -> None:
    problem = _hybrid(100_000)
    plan = Plan.of(("phone", 0, 1), ("server", 1, 6))
    assert choose_codecs(problem, plan) == ["fp32"]


def test_a_slow_uplink_gets_the_most_precise_codec_that_hides_it() -> None:
    problem = _hybrid(100)
    plan = Plan.of(("phone", 0, 1), ("server", 1, 6))
    score = score_plan(problem, plan)
    bottleneck = max(score.compute_s)
    # fp32 makes the uplink the bottleneck; the chosen codec hides it, and the one
    # before it in precision order would not.
    assert score.link_s[0] > bottleneck
    codecs = choose_codecs(problem, plan)
    assert codecs != ["fp32"]
    assert score_plan(with_codecs(problem, plan, codecs), plan).link_s[0] <= bottleneck
    if codecs == ["int8"]:
        assert score_plan(with_codecs(problem, plan, ["bf16"]), plan).link_s[0] > bottleneck


def test_a_link_no_codec_hides_gets_the_smallest() -> None:
    problem = _hybrid(1)
    plan = Plan.of(("phone", 0, 1), ("server", 1, 6))
    assert choose_codecs(problem, plan) == ["int8"]
    assert choose_codecs(problem, plan, ["fp32", "fp16"]) == ["fp16"]


def test_the_hybrid_plan_with_codecs_beats_every_fp32_plan() -> None:
    problem = _hybrid(100)
    fp32_only = plan_problem(problem).score
    assert fp32_only is not None
    chosen = plan_with_codecs(problem, _search)
    assert chosen is not None
    # Edge first (it holds the data), the server the rest, over one compressed uplink.
    assert [s.device for s in chosen.plan.stages] == ["phone", "server"]
    assert chosen.codecs[0] != "fp32"
    assert chosen.score.step_time_s < fp32_only.step_time_s
    # The score is the spec's formula on the codec-scaled problem, nothing else.
    rescored = score_plan(with_codecs(problem, chosen.plan, chosen.codecs), chosen.plan)
    assert rescored.step_time_s == chosen.score.step_time_s


def test_fp32_alone_gives_the_plain_planner_result() -> None:
    problem = _hybrid(100)
    chosen = plan_with_codecs(problem, _search, ["fp32"])
    plain = plan_problem(problem).score
    assert chosen is not None and plain is not None
    links = len(plain.plan.stages) - 1
    assert chosen.plan.stages == plain.plan.stages and chosen.codecs == ["fp32"] * links
    assert chosen.plan.codecs == ("fp32",) * links  # the plan carries its links' codecs
    assert chosen.score.step_time_s == plain.step_time_s


def test_unknown_codecs_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown codecs"):
        choose_codecs(_hybrid(100), Plan.of(("phone", 0, 6)), ["zstd"])
