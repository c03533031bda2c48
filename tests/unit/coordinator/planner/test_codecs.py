"""The planner's link codecs: compress the slow uplink of a hybrid plan, nothing else;
the links of a U-shaped plan on local data likewise; a plan priced by its codecs."""

from __future__ import annotations

from dataclasses import replace

import pytest
from support.planning import make_problem

from coordinator.planner import Plan, plan_problem, score_plan
from coordinator.planner.codecs import choose_codecs, plan_with_codecs
from coordinator.planner.partition import plan_holders_job
from coordinator.planner.predict import predict
from coordinator.planner.score import CODEC_RATIO, for_plan, with_codecs
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
    assert scaled.layers[0].out_bytes == problem.layers[0].out_bytes * CODEC_RATIO["int8"]
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


def test_a_plan_that_carries_its_codecs_is_priced_by_them_once() -> None:
    problem = _hybrid(100)
    plain = Plan.of(("phone", 0, 1), ("server", 1, 6))
    coded = replace(plain, codecs=("int8",))
    # for_plan scales the bytes at the cut; score_plan alone never reads the codecs.
    assert for_plan(problem, coded).layers == with_codecs(problem, plain, ["int8"]).layers
    assert for_plan(problem, plain) == problem
    assert score_plan(problem, coded) == replace(score_plan(problem, plain), plan=coded)
    # The internal model prices the link at a quarter of the bytes, as the runtime sends.
    fast, slow = predict(problem, coded), predict(problem, plain)
    assert fast.link_s[0] < slow.link_s[0]
    assert fast.spec_step_time_s == score_plan(for_plan(problem, coded), coded).step_time_s


def _holders_problem(mbps: float) -> PlanningProblem:
    """Three slow holders with their data and one fast helper, every link at ``mbps``;
    a 4-unit model whose first unit's activations are large."""
    layers = [
        {"fwd_flops": 2e8, "param_bytes": 1e4, "out_bytes": 1.6e4},
        {"fwd_flops": 4e9, "param_bytes": 1e5, "out_bytes": 1e3},
        {"fwd_flops": 4e9, "param_bytes": 1e5, "out_bytes": 40},
        {"fwd_flops": 1e6, "param_bytes": 1e3, "out_bytes": 40},
    ]
    devices = [
        {"id": f"h{i}", "gflops": 5, "memory_bytes": GB, "bandwidth_mbps": mbps, "latency_ms": 1}
        for i in range(3)
    ] + [{"id": "helper", "gflops": 150, "memory_bytes": 8 * GB, "bandwidth_mbps": mbps}]
    devices[-1]["latency_ms"] = 1
    problem = make_problem(layers, devices, batch_size=48, microbatches=4)
    return problem.as_version(2).model_copy(update={"groups": True})


def test_a_u_of_holders_compresses_the_links_that_bind_and_keeps_the_shares() -> None:
    holders, shares = ["h0", "h1", "h2"], [0.5, 0.25, 0.25]
    problem = _holders_problem(1)
    exact, _ = plan_holders_job(problem, holders, shares, labels_local=True)
    auto, alternatives = plan_holders_job(problem, holders, shares, labels_local=True, codec="auto")
    assert auto.plan.u_shaped and auto.plan.codecs is not None
    assert auto.plan.codecs[0] != "fp32"  # the activations the holders send the helper
    assert "links" in auto.method
    assert auto.score.step_time_s < exact.score.step_time_s
    assert auto.score.step_time_s < alternatives.holders_alone.step_time_s
    # Scored with the holders' shares at both ends, on the bytes its codecs send.
    ends = {0: shares, len(auto.plan.stages) - 1: shares}
    assert auto.score.shares[0] == shares and auto.score.shares[-1] == shares
    rescored = score_plan(for_plan(problem, auto.plan), auto.plan, fixed_shares=ends)
    assert rescored.step_time_s == auto.score.step_time_s
    # Where the links are fast, nothing is compressed.
    fast, _ = plan_holders_job(
        _holders_problem(100_000), holders, shares, labels_local=True, codec="auto"
    )
    assert fast.plan.codecs is None or set(fast.plan.codecs) == {"fp32"}
