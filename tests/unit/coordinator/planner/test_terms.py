"""coordinator/planner/terms.py: each cost term once, the same bits in the score and the tables.

:func:`score_plan` calls the terms on Python floats, the search's tables on numpy
arrays ([Note: one formula, two kinds of number]). Every figure the score gives a
plan, a stage's ``T_s`` and 1F1B memory, a link's ``C_s``, a group's ``R_s``, must
equal, with ``==``, the entry the search reads for it: over random problems of
every regime of :data:`support.planning.REGIMES` (zero latency, zero FLOPs,
nothing crossing a cut, identical devices, ...), random plans of one device per
stage against :class:`CostTables`, random plans of groups against
:class:`GroupTables`, and the corners no random problem reaches: a link between
two devices of the same figures (the tables' diagonal) and a link of unbounded
bandwidth.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.planning import REGIMES, make_problem, problems

from coordinator.planner.group_tables import GroupTables
from coordinator.planner.score import Plan, PlanScore, Stage, score_plan
from coordinator.planner.tables import CostTables
from coordinator.planner.terms import allreduce_s, compute_s, link_s, need_bytes
from edge.problem import DeviceSpec, PlanningProblem

PLANS_PER_PROBLEM = 20


def _random_plan(problem: PlanningProblem, rng: random.Random, groups: bool) -> Plan:
    """A valid plan: a random ordered subset of the devices (every one of them, in
    groups, when ``groups``), cut at random, ``pin_first`` in stage 0."""
    ids = [d.id for d in problem.devices]
    rng.shuffle(ids)
    if problem.pin_first is not None:
        ids.remove(problem.pin_first)
        ids.insert(0, problem.pin_first)
    n = len(problem.layers)
    k = rng.randint(1, min(len(ids), n))
    cuts = [0, *sorted(rng.sample(range(1, n), k - 1)), n]
    sizes = [1] * k
    if groups:
        for _ in range(len(ids) - k):
            sizes[rng.randrange(k)] += 1
    stages, used = [], 0
    for s in range(k):
        stages.append(Stage.group(ids[used : used + sizes[s]], cuts[s], cuts[s + 1]))
        used += sizes[s]
    return Plan(tuple(stages))


def _assert_same_as_tables(tab: CostTables, score: PlanScore) -> None:
    index = {d: i for i, d in enumerate(tab.ids)}
    stages = score.plan.stages
    for s, st_ in enumerate(stages):
        d = index[st_.device]
        assert score.compute_s[s] == tab.compute[d, st_.start, st_.end]
        assert score.memory_bytes[s] == tab.need(len(stages) - s)[st_.start, st_.end]
        if s + 1 < len(stages):
            e = index[stages[s + 1].device]
            assert score.link_s[s] == tab.link[d, e, st_.end]
    # The score's figures stay Python floats; the tables' are arrays of the same bits.
    assert all(type(x) is float for x in [*score.compute_s, *score.link_s, *score.allreduce_s])


def _assert_same_as_group_tables(gt: GroupTables, score: PlanScore) -> None:
    index = {d.id: i for i, d in enumerate(gt.problem.devices)}
    groups = [tuple(index[d] for d in st_.devices) for st_ in score.plan.stages]
    n_stages = len(groups)
    for s, (st_, g) in enumerate(zip(score.plan.stages, groups, strict=True)):
        costs = gt.costs(g)
        assert score.compute_s[s] == costs.compute[st_.start, st_.end]
        assert score.allreduce_s[s] == costs.allreduce[st_.start, st_.end]
        fits = not any(r.startswith(f"stage {s} on ") for r in score.reasons)
        assert bool(gt.fits(g, n_stages - s)[st_.start, st_.end]) == fits
        if s + 1 < n_stages:
            assert score.link_s[s] == gt.link(g, groups[s + 1])[st_.end]


@pytest.mark.parametrize("regime", REGIMES)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_score_and_the_tables_give_the_same_bits(regime: str, data: st.DataObject) -> None:
    problem = data.draw(problems(regime), label="problem")
    rng = random.Random(data.draw(st.integers(0, 2**32), label="seed"))
    tab = CostTables.build(problem)
    for _ in range(PLANS_PER_PROBLEM):
        _assert_same_as_tables(tab, score_plan(problem, _random_plan(problem, rng, False)))
    grouped = problem.as_version(2)
    gt = GroupTables.build(grouped)
    for _ in range(PLANS_PER_PROBLEM):
        _assert_same_as_group_tables(gt, score_plan(grouped, _random_plan(grouped, rng, True)))
    # A group of one device is version 1's device: the same arrays, entry for entry.
    for d in range(len(problem.devices)):
        assert np.array_equal(gt.costs((d,)).compute, tab.compute[d])
        for e in range(len(problem.devices)):
            assert np.array_equal(gt.link((d,), (e,)), tab.link[d, e])


def _corner_problem(devices: list[DeviceSpec]) -> PlanningProblem:
    layers = [
        {"fwd_flops": 3e9, "param_bytes": 1e6, "out_bytes": 5e5},
        {"fwd_flops": 1e9, "param_bytes": 2e6, "out_bytes": 0.0},  # nothing crosses this cut
        {"fwd_flops": 0.0, "param_bytes": 0.0, "out_bytes": 3e4},
        {"fwd_flops": 7e9, "param_bytes": 4e6, "out_bytes": 1e5},
    ]
    stand_in = {"id": "x", "gflops": 1.0, "memory_bytes": 1.0, "bandwidth_mbps": 1.0}
    problem = make_problem(
        layers, [stand_in | {"latency_ms": 0.0}], batch_size=24.0, microbatches=3
    )
    return problem.model_copy(update={"devices": devices})  # unchecked: an infinite bandwidth


def test_corners_a_link_between_equal_devices_and_an_unbounded_link() -> None:
    """The tables' diagonal (a link from a device to itself, which no plan has) equals the
    score's link between two devices of the same figures; a link of infinite bandwidth
    (no validated problem has one: built unchecked) and zero latency costs exactly 0."""
    a = DeviceSpec(id="a", gflops=7.0, memory_bytes=1e12, bandwidth_mbps=90.0, latency_ms=3.5)
    free = DeviceSpec.model_construct(
        id="free", gflops=3.0, memory_bytes=1e12, bandwidth_mbps=float("inf"), latency_ms=0.0
    )
    open_ = free.model_copy(update={"id": "open"})
    problem = _corner_problem([a, a.model_copy(update={"id": "twin"}), free, open_])
    tab = CostTables.build(problem)
    gt = GroupTables.build(problem.as_version(2))
    for cut in (1, 2, 3):
        twins = score_plan(problem, Plan.of(("a", 0, cut), ("twin", cut, 4)))
        assert twins.link_s[0] == tab.link[0, 0, cut] == tab.link[0, 1, cut]
        assert twins.link_s[0] == gt.link((0,), (0,))[cut]
        unbounded = score_plan(problem, Plan.of(("free", 0, cut), ("open", cut, 4)))
        assert unbounded.link_s[0] == tab.link[2, 3, cut] == 0.0
        _assert_same_as_tables(tab, twins)
        _assert_same_as_tables(tab, unbounded)
    # Zero latency and nothing crossing the cut: free; from a device of latency: its latency.
    assert score_plan(problem, Plan.of(("free", 0, 2), ("open", 2, 4))).link_s[0] == 0.0
    assert score_plan(problem, Plan.of(("free", 0, 2), ("a", 2, 4))).link_s[0] == 2 * 3.5 / 1000
    assert tab.link[2, 3, 2] == 0.0 and tab.link[2, 0, 2] == 2 * 3.5 / 1000


def test_one_function_serves_floats_and_arrays() -> None:
    """Each term on arrays is, entry for entry, the term on each entry as a Python float."""
    rng = np.random.default_rng(7)
    out = np.concatenate([[0.0, np.inf], rng.lognormal(11, 2, 30)])
    lat = np.concatenate([[0.0, 0.0], rng.uniform(0, 40, 30)])
    bw = np.concatenate([[np.inf, 1e-3], rng.lognormal(4, 2, 30)])
    flops = np.concatenate([[0.0, np.inf], rng.lognormal(20, 3, 30)])
    speeds = np.concatenate([[1e-3, np.inf], rng.lognormal(2, 2, 30)])
    with np.errstate(all="ignore"):  # inf / inf and inf * 0 are NaN on both sides
        pairs = [
            (
                link_s(0.75, out, lat, lat[::-1], bw, bw[::-1]),
                [
                    link_s(0.75, float(o), float(x), float(y), float(u), float(v))
                    for o, x, y, u, v in zip(out, lat, lat[::-1], bw, bw[::-1], strict=True)
                ],
            ),
            (
                compute_s(12.5, flops, speeds),
                [compute_s(12.5, float(f), float(g)) for f, g in zip(flops, speeds, strict=True)],
            ),
            (
                need_bytes(4.0, flops, 3, 0.25, 2.0, out),
                [
                    need_bytes(4.0, float(p), 3, 0.25, 2.0, float(a))
                    for p, a in zip(flops, out, strict=True)
                ],
            ),
        ]
    for arrays, floats in pairs:
        assert all(type(x) is float for x in floats)
        assert np.array_equal(arrays, floats, equal_nan=True)
    group = [
        DeviceSpec(id=f"d{i}", gflops=1.0, memory_bytes=1.0, bandwidth_mbps=b, latency_ms=x)
        for i, (b, x) in enumerate([(100.0, 0.0), (7.5, 2.5), (1e4, 0.25)])
    ]
    for members in (group[:1], group[:2], group):
        arrays = allreduce_s(members, flops)
        assert np.array_equal(arrays, [allreduce_s(members, float(p)) for p in flops])
        assert type(allreduce_s(members, 1e6)) is float
