"""Plans for data that stays home (coordinator/planner/holders.py): stage 0 on the
holders at shares fixed by their data, the cut and the helpers chosen by score."""

from __future__ import annotations

import itertools

import pytest
from support.planning import brute_force, make_problem

from coordinator.planner.holders import plan_with_holders
from coordinator.planner.score import Plan, PlanScore, Stage, score_plan
from edge.problem import PlanningProblem

GB = 1e9
LAYERS = [
    {"fwd_flops": 2e8, "param_bytes": 1e4, "out_bytes": 4e5, "act_bytes": 1e5},
    {"fwd_flops": 8e8, "param_bytes": 1e6, "out_bytes": 1e5, "act_bytes": 1e5},
    {"fwd_flops": 8e8, "param_bytes": 1e6, "out_bytes": 2e4, "act_bytes": 1e5},
    {"fwd_flops": 1e8, "param_bytes": 4e6, "out_bytes": 4e2, "act_bytes": 1e4},
]


def _device(i: str, gflops: float, bw: float = 100.0) -> dict[str, object]:
    return {
        "id": i,
        "gflops": gflops,
        "memory_bytes": 2 * GB,
        "bandwidth_mbps": bw,
        "latency_ms": 1,
    }


def _problem(helpers: list[tuple[str, float]]) -> PlanningProblem:
    holders = [_device("h0", 2.0), _device("h1", 4.0), _device("h2", 2.0)]
    problem = make_problem(LAYERS, holders + [_device(i, g, 1000.0) for i, g in helpers])
    return problem.as_version(2)


def _rest(sub: PlanningProblem) -> PlanScore | None:
    """The helpers' plan: the version 1 optimum by brute force (one-device stages)."""
    best = brute_force(sub.as_version(1))
    return None if best is None else score_plan(sub.as_version(1), best.plan)


SHARES = [0.5, 0.25, 0.25]  # by data: h0 holds twice what h1 and h2 do


def test_fixed_shares_make_stage_0_as_slow_as_its_slowest_member() -> None:
    problem = _problem([("lap", 40.0)])
    plan = Plan((Stage.group(["h0", "h1", "h2"], 0, 1), Stage.group(["lap"], 1, 4)))
    got = score_plan(problem, plan, fixed_shares={0: SHARES})
    b, flops = 32 / 4, 3 * 2e8  # fwd + bwd = 3 x fwd, as the spec's train_flops
    slowest = max(w / g for w, g in zip(SHARES, [2.0, 4.0, 2.0], strict=True))  # h0: 0.5 / 2
    assert got.compute_s[0] == pytest.approx(b * flops * slowest / 1e9)
    assert got.shares[0] == SHARES
    by_speed = score_plan(problem, plan)  # the spec's shares: 2/8, 4/8, 2/8
    assert by_speed.compute_s[0] == pytest.approx(b * flops / 8e9)
    assert by_speed.compute_s[0] < got.compute_s[0]
    with pytest.raises(ValueError, match="do not split a microbatch"):
        score_plan(problem, plan, fixed_shares={0: [0.5, 0.5]})


def test_the_cut_is_the_best_of_every_cut_with_the_helpers_own_best_plan() -> None:
    problem = _problem([("lap", 40.0), ("nuc", 20.0)])
    found = plan_with_holders(problem, ["h0", "h1", "h2"], SHARES, _rest)
    assert found.best is not None and found.tried == 4
    by_cut = {}
    for k in range(1, 5):
        stages = [Stage.group(["h0", "h1", "h2"], 0, k)]
        if k < 4:
            sub = problem.model_copy(
                update={"layers": problem.layers[k:], "devices": problem.devices[3:]}
            )
            rest = _rest(sub)
            assert rest is not None
            stages += [Stage.group(st.devices, st.start + k, st.end + k) for st in rest.plan.stages]
        by_cut[k] = score_plan(problem, Plan(tuple(stages)), fixed_shares={0: SHARES})
    best_k = min(by_cut, key=lambda k: by_cut[k].step_time_s)
    assert found.best.step_time_s == by_cut[best_k].step_time_s
    assert found.best.plan.stages[0].devices == ("h0", "h1", "h2")
    assert best_k < 4  # helpers this fast take work: not the degenerate holders-alone plan
    assert found.holders_alone.step_time_s == by_cut[4].step_time_s
    assert set(found.each_alone) == {"h0", "h1", "h2"}


def test_min_local_units_and_solo_units_bound_the_cut() -> None:
    problem = _problem([("lap", 40.0)])
    found = plan_with_holders(problem, ["h0", "h1", "h2"], SHARES, _rest, min_local_units=2)
    assert found.best is not None and found.best.plan.stages[0].end >= 2 and found.tried == 3
    # Unit 1 cannot be trained by a group: the holders keep unit 0 only.
    solo = plan_with_holders(problem, ["h0", "h1", "h2"], SHARES, _rest, solo_units=frozenset({1}))
    assert solo.tried == 1 and solo.best is not None and solo.best.plan.stages[0].end == 1
    # Without helpers, the holders train alone together.
    alone = _problem([])
    only = plan_with_holders(alone, ["h0", "h1", "h2"], SHARES, _rest)
    assert only.best is not None and len(only.best.plan.stages) == 1


HOLDERS = ["h0", "h1", "h2"]


def _u_score(problem: PlanningProblem, plan: Plan) -> PlanScore:
    ends = {0: SHARES, len(plan.stages) - 1: SHARES}
    return score_plan(problem, plan, fixed_shares=ends)


def _every_u(problem: PlanningProblem, helpers: list[str]) -> list[Plan]:
    """Every U-shaped plan: the holders on ``[0, k)`` and ``[m, n)``, and between them
    every split of ``[k, m)`` over every ordering of distinct helpers."""
    n, plans = len(problem.layers), []
    for k in range(1, n - 1):
        for m in range(k + 1, n):
            for s in range(1, min(len(helpers), m - k) + 1):
                for cuts in itertools.combinations(range(k + 1, m), s - 1):
                    bounds = (k, *cuts, m)
                    for order in itertools.permutations(helpers, s):
                        middle = [
                            Stage(d, a, b)
                            for d, a, b in zip(order, bounds, bounds[1:], strict=False)
                        ]
                        stages = (Stage.group(HOLDERS, 0, k), *middle, Stage.group(HOLDERS, m, n))
                        plans.append(Plan(stages, u_shaped=True))
    return plans


def test_labels_local_plan_is_the_best_u_of_every_cut_and_tail() -> None:
    problem = _problem([("lap", 40.0), ("nuc", 20.0)])
    found = plan_with_holders(problem, HOLDERS, SHARES, _rest, labels_local=True)
    # k = 1 (tails at 2, 3), k = 2 (tail at 3), and the holders alone.
    assert found.best is not None and found.tried == 4
    best = found.best.plan
    assert best.u_shaped and best.stages[0].devices == best.stages[-1].devices == tuple(HOLDERS)
    assert {d for st in best.stages[1:-1] for d in st.devices} <= {"lap", "nuc"}
    assert found.best.shares[-1] == SHARES
    # Brute force over every U-shaped plan: none is faster.
    every = [_u_score(problem, plan) for plan in _every_u(problem, ["lap", "nuc"])]
    fastest = min((sc for sc in every if sc.feasible), key=lambda sc: sc.step_time_s)
    assert found.best.step_time_s == fastest.step_time_s
    assert found.best.step_time_s < found.holders_alone.step_time_s


def test_a_u_scores_what_its_holders_do_twice() -> None:
    """The holders compute both ends (the bottleneck is at least both), and each must hold
    both segments: a tail that fits alone does not fit beside stage 0."""
    problem = _problem([("lap", 40.0)])
    plan = Plan(
        (Stage.group(HOLDERS, 0, 1), Stage.group(["lap"], 1, 3), Stage.group(HOLDERS, 3, 4)),
        u_shaped=True,
    )
    got = _u_score(problem, plan)
    assert got.feasible and len(got.link_s) == 2  # out to the helper and back to the holders
    assert got.bottleneck_s >= got.compute_s[0] + got.compute_s[2]
    b = problem.batch_size / problem.microbatches
    k = problem.optimizer_state_factor
    head = k * 1e4 + 3 * SHARES[0] * b * 1e5  # h0, the tightest: stage 0, 3 microbatches deep
    tail = k * 4e6 + 1 * SHARES[0] * b * 1e4
    assert got.memory_bytes[2] == pytest.approx(head + tail)
    # Memory just short of both segments: the tail alone would fit, the U does not.
    tight = problem.model_copy(
        update={
            "devices": [
                d.model_copy(update={"memory_bytes": (head + tail) * 0.999}) if d.id == "h0" else d
                for d in problem.devices
            ]
        }
    )
    short = _u_score(tight, plan)
    assert tail < (head + tail) * 0.999 and not short.feasible
    assert short.reasons == [
        f"stage 2 on h0 needs {(head + tail) / 1e9:.3f} GB of {(head + tail) * 0.999 / 1e9:.3f} GB"
    ]


def test_only_a_u_may_have_a_device_in_two_stages() -> None:
    problem = _problem([("lap", 40.0)])
    stages = (Stage.group(HOLDERS, 0, 1), Stage.group(["lap"], 1, 3), Stage.group(HOLDERS, 3, 4))
    with pytest.raises(ValueError, match="a device appears in two stages"):
        score_plan(problem, Plan(stages))
    swapped = (*stages[:2], Stage.group(["h1", "h0", "h2"], 3, 4))
    with pytest.raises(ValueError, match="ends on stage 0's devices"):
        score_plan(problem, Plan(swapped, u_shaped=True))
