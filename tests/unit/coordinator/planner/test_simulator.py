"""The pipeline simulator and schedules: exactness against the spec's closed form
where proved ([Note: closed form versus simulation]), memory, timeline invariants,
traces and deadlocks."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import get_args

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from support.planning import make_problem

from coordinator.planner.score import Plan, Stage, score_plan
from coordinator.planner.simulator import (
    DeadlockError,
    SimulationResult,
    TimelineEvent,
    fastest_schedule,
    memory_error,
    simulate,
)
from edge.config import Schedule
from edge.problem import PlanningProblem
from edge.runtime.schedules import (
    SCHEDULES,
    Action,
    format_schedule,
    gpipe,
    make_schedule,
    one_f_one_b,
    parse_schedule,
    validate_schedule,
    zb_h1,
)

REL = 1e-9


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL, abs_tol=1e-15)


def _pipe(
    times: list[float],
    m: int,
    links: list[float] | None = None,
    shares: list[float] | None = None,
    k: float = 4.0,
) -> tuple[PlanningProblem, Plan]:
    """One layer per stage on 1-GFLOP/s devices with b = 1: ``T_s = times[s]``, link
    ``s`` has ``C_s = links[s]`` (a 1 Mbit/s link, no latency), forward share ``shares[s]``."""
    n = len(times)
    links = links or [0.0] * (n - 1)
    shares = shares or [1 / 3] * n
    layers = [
        {
            "name": f"l{s}",
            "fwd_flops": t * 1e9 * shares[s],
            "bwd_flops": t * 1e9 * (1 - shares[s]),
            "param_bytes": 100.0 + s,
            "out_bytes": links[s] / 16 * 1e6 if s < n - 1 else 8.0,
            "act_bytes": 10.0 + s,
        }
        for s, t in enumerate(times)
    ]
    devices = [
        {
            "id": f"d{s}",
            "gflops": 1.0,
            "memory_bytes": 1e12,
            "bandwidth_mbps": 1.0,
            "latency_ms": 0.0,
        }
        for s in range(n)
    ]
    problem = PlanningProblem.model_validate(
        {
            "version": 1,
            "batch_size": float(m),
            "microbatches": m,
            "optimizer_state_factor": k,
            "layers": layers,
            "devices": devices,
        }
    )
    return problem, Plan.of(*[(f"d{s}", s, s + 1) for s in range(n)])


@st.composite
def _problems(draw: st.DrawFn, free_links: bool = False) -> tuple[PlanningProblem, Plan]:
    """A random small problem and a random valid plan: contiguous cuts, distinct devices."""
    n_units = draw(st.integers(1, 7))
    n_devices = draw(st.integers(1, 5))
    m = draw(st.integers(1, 8))
    size = st.floats(0, 1e5)
    layers = [
        {
            "name": f"l{i}",
            "fwd_flops": draw(st.floats(1e6, 1e9)),
            "bwd_flops": draw(st.none() | st.floats(0, 2e9)),
            "param_bytes": draw(size),
            "out_bytes": 0.0 if free_links else draw(size),
            "act_bytes": draw(st.none() | size),
        }
        for i in range(n_units)
    ]
    devices = [
        {
            "id": f"d{i}",
            "gflops": draw(st.floats(0.5, 50)),
            "memory_bytes": 1e12,
            "bandwidth_mbps": draw(st.floats(1, 1000)),
            "latency_ms": 0.0 if free_links else draw(st.floats(0, 20)),
        }
        for i in range(n_devices)
    ]
    problem = PlanningProblem.model_validate(
        {
            "version": 1,
            "batch_size": float(m * draw(st.integers(1, 4))),
            "microbatches": m,
            "optimizer_state_factor": draw(st.floats(1, 8)),
            "layers": layers,
            "devices": devices,
        }
    )
    n_stages = draw(st.integers(1, min(n_units, n_devices)))
    cut_points = st.integers(1, n_units - 1) if n_units > 1 else st.nothing()
    cuts = draw(st.lists(cut_points, min_size=n_stages - 1, max_size=n_stages - 1, unique=True))
    bounds = [0, *sorted(cuts), n_units]
    order = draw(st.permutations(range(n_devices)))
    return problem, Plan.of(*[(f"d{order[s]}", bounds[s], bounds[s + 1]) for s in range(n_stages)])


def _split(problem: PlanningProblem, plan: Plan) -> tuple[list[float], list[float], list[float]]:
    """``f_s``, ``g_s`` and ``c_s`` as the simulator's docstring defines them."""
    score = score_plan(problem, plan)
    fwd, bwd = [], []
    for s, stage in enumerate(plan.stages):
        chunk = problem.layers[stage.start : stage.end]
        share = sum(unit.fwd_flops for unit in chunk) / sum(unit.train_flops for unit in chunk)
        fwd.append(score.compute_s[s] * share)
        bwd.append(score.compute_s[s] - fwd[-1])
    return fwd, bwd, [c / 2 for c in score.link_s]


def _exact_conditions(problem: PlanningProblem, plan: Plan) -> bool:
    """(a), (b), (c) of [Note: closed form versus simulation], or ``M = 1``."""
    score = score_plan(problem, plan)
    t, c_full, m = score.compute_s, score.link_s, problem.microbatches
    f, _, c = _split(problem, plan)
    last = len(t) - 1
    if m == 1:
        return True
    if t[last] < score.bottleneck_s:
        return False
    for s in range(last):
        if m > len(t) - s and t[s] + c_full[s] > t[last]:
            return False
        reach = max(f[: s + 1] + c[: s + 1])
        if min(last - s, m - 1) * reach > t[last] + sum(
            t[q] + c_full[q] for q in range(s + 1, last)
        ):
            return False
    return True


def _check_timeline(result: SimulationResult, actions: list[list[Action]], m: int) -> None:
    n = len(actions)
    ev = {(e.lane, e.index, e.kind, e.microbatch): e for e in result.timeline}
    assert len(ev) == len(result.timeline) == 2 * m * n + 2 * m * (n - 1)
    for s in range(n):
        for i in range(m):
            f, b = ev["stage", s, "F", i], ev["stage", s, "B", i]
            assert b.start_s >= f.end_s
            if s > 0:
                assert f.start_s >= ev["link", s - 1, "send-fwd", i].end_s
                assert ev["link", s - 1, "send-bwd", i].start_s >= b.end_s
            if s < n - 1:
                assert ev["link", s, "send-fwd", i].start_s >= f.end_s
                assert b.start_s >= ev["link", s, "send-bwd", i].end_s
    # One action at a time per stage, one transfer at a time per link direction,
    # and each stage in its schedule's order (the timeline is ordered by start).
    lanes: dict[tuple[str, int, str], list[TimelineEvent]] = {}
    for e in result.timeline:
        lanes.setdefault((e.lane, e.index, e.kind if e.lane == "link" else ""), []).append(e)
    for (lane, index, _), events in lanes.items():
        for a, b in itertools.pairwise(events):
            assert b.start_s >= a.end_s
        if lane == "stage":
            assert [f"{e.kind}{e.microbatch}" for e in events] == [str(a) for a in actions[index]]


# ---- schedules as data


def test_one_f_one_b_text_form() -> None:
    text = format_schedule(one_f_one_b(4, 6))
    assert text.splitlines() == [
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5",
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5",
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5",
    ]
    assert format_schedule(one_f_one_b(3, 2)).splitlines() == ["F0 F1 B0 B1"] * 2 + ["F0 B0 F1 B1"]
    assert format_schedule(gpipe(2, 3)).splitlines() == ["F0 F1 F2 B0 B1 B2"] * 2


def test_a_job_may_name_every_schedule_and_no_other() -> None:
    assert set(get_args(Schedule)) == set(SCHEDULES)


def test_zb_h1_text_form() -> None:
    """1F1B's rows, stage ``s`` putting each weight pass ``s`` backwards behind."""
    assert format_schedule(zb_h1(3, 4)).splitlines() == [
        "F0 F1 F2 B0 W0 F3 B1 W1 B2 W2 B3 W3",
        "F0 F1 B0 F2 B1 W0 F3 B2 W1 B3 W2 W3",
        "F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3",
    ]
    assert format_schedule(zb_h1(3, 1)).splitlines() == ["F0 B0 W0"] * 3


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 12])
def test_zb_h1_takes_a_third_of_the_bubble_in_the_same_memory(n: int, m: int) -> None:
    """Equal stages, F = B = W, free links: ``3 M + S - 1`` against 1F1B's ``3 (M + S - 1)``
    once ``M >= S``, never slower, and every stage holds ``min(S, M)``: stage 0's 1F1B peak."""
    problem, plan = _pipe([3.0] * n, m)  # f = 1 and g = 2 on every stage
    zb, ofob = simulate(problem, plan, "zb-h1"), simulate(problem, plan, "1f1b")
    assert _close(ofob.step_time_s, 3 * (m + n - 1))
    if m >= n:
        assert _close(zb.step_time_s, 3 * m + n - 1)
    assert zb.step_time_s <= ofob.step_time_s + 1e-12
    assert zb.peak_microbatches_held == [min(n, m)] * n
    assert max(zb.peak_microbatches_held) == max(ofob.peak_microbatches_held)
    w = [e for e in zb.timeline if e.kind == "W"]
    assert len(w) == n * m and all(_close(e.end_s - e.start_s, 1.0) for e in w if e.index > 0)
    assert all(_close(e.end_s - e.start_s, 2.0) for e in w if e.index == 0)  # B is free there


def test_a_plan_that_fits_1f1b_may_not_fit_zb_h1_or_gpipe() -> None:
    """The last stage holds one microbatch under 1F1B, three under ZB-H1 and four under
    GPipe: with room for exactly 1F1B's, the other two are refused, naming the stage."""
    problem, plan = _pipe([3.0, 3.0, 3.0], 4)
    tight = score_plan(problem, plan).memory_bytes[2]
    devices = [
        d.model_copy(update={"memory_bytes": tight}) if d.id == "d2" else d for d in problem.devices
    ]
    problem = problem.model_copy(update={"devices": devices})
    assert memory_error(problem, plan, "1f1b") is None
    for schedule, held in (("zb-h1", 3), ("gpipe", 4)):
        why = memory_error(problem, plan, schedule)
        assert why is not None and why.startswith("stage 2 on d2 needs ")
        assert f"under {schedule} ({held} microbatches in flight)" in why
    # One stage: 1F1B and ZB-H1 hold one microbatch, GPipe all four.
    alone, one = _pipe([3.0], 4)
    room = score_plan(alone, one).memory_bytes[0]
    alone = alone.model_copy(
        update={"devices": [d.model_copy(update={"memory_bytes": room}) for d in alone.devices]}
    )
    assert memory_error(alone, one, "1f1b") is None and memory_error(alone, one, "zb-h1") is None
    assert "under gpipe (4 microbatches in flight)" in (memory_error(alone, one, "gpipe") or "")
    roomy = [d.model_copy(update={"memory_bytes": tight * 2}) for d in problem.devices]
    assert memory_error(problem.model_copy(update={"devices": roomy}), plan, "zb-h1") is None


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize(("n", "m"), [(1, 1), (1, 5), (3, 2), (4, 4), (5, 9)])
def test_schedules_round_trip_and_are_complete(name: str, n: int, m: int) -> None:
    schedule = make_schedule(name, n, m)
    validate_schedule(schedule, n, m)
    assert parse_schedule(format_schedule(schedule)) == schedule
    assert (
        parse_schedule("# stage 0\nF0  B0\n\nF0 B0 # last\n")
        == [[Action("F", 0), Action("B", 0)]] * 2
    )
    assert str(Action("B", 12)) == "B12" and Action.parse("F7") == Action("F", 7)
    assert Action.parse("W3") == Action("W", 3)


def test_malformed_schedules_are_refused() -> None:
    with pytest.raises(ValueError, match="not an action"):
        Action.parse("X1")
    with pytest.raises(ValueError, match="missing B1"):
        validate_schedule(parse_schedule("F0 F1 B0"), 1, 2)
    with pytest.raises(ValueError, match="extra F0"):
        validate_schedule(parse_schedule("F0 F0 B0"), 1, 1)
    with pytest.raises(ValueError, match="2 stages"):
        validate_schedule(one_f_one_b(2, 2), 3, 2)
    with pytest.raises(ValueError, match="stage 1: W0 runs before B0"):
        validate_schedule(parse_schedule("F0 B0 W0\nF0 W0 B0"), 2, 1)
    with pytest.raises(ValueError, match=r"stage 1: must run F, B and W .* missing W0"):
        validate_schedule(parse_schedule("F0 B0 W0\nF0 B0"), 2, 1)
    with pytest.raises(ValueError, match="unknown schedule 'zb'"):
        make_schedule("zb", 2, 2)
    problem, plan = _pipe([1.0, 1.0], 2)
    with pytest.raises(ValueError, match="stage 1"):
        simulate(problem, plan, parse_schedule("F0 F1 B0 B1\nF0 F1 B0"))


# ---- (a) where the closed form is exact


@pytest.mark.parametrize("m", [1, 2, 3, 7, 16])
@pytest.mark.parametrize("share", [1 / 3, 0.0, 0.8])
def test_one_stage_is_exactly_m_times_t(m: int, share: float) -> None:
    problem, plan = _pipe([0.37], m, shares=[share])
    result = simulate(problem, plan)
    assert _close(result.step_time_s, m * 0.37)
    assert _close(result.step_time_s, score_plan(problem, plan).step_time_s)
    assert result.bubble_fraction == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 13])
@pytest.mark.parametrize("shares", ["equal", "mixed"])
def test_balanced_free_links_match_closed_form_and_bubble(n: int, m: int, shares: str) -> None:
    mixed = [(0.1, 0.9, 1 / 3, 0.0, 1.0, 0.5)[s] for s in range(n)]
    problem, plan = _pipe([0.25] * n, m, shares=None if shares == "equal" else mixed)
    result = simulate(problem, plan)
    closed = score_plan(problem, plan).step_time_s
    assert _close(result.step_time_s, closed)
    assert _close(closed, (m + n - 1) * 0.25)
    # (e): each stage is busy m * T of (m + n - 1) * T.
    assert result.bubble_fraction == pytest.approx((n - 1) / (m + n - 1), rel=REL, abs=1e-12)
    assert all(_close(busy, m * 0.25) for busy in result.busy_s)


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 5),
    m=st.integers(1, 8),
    head=st.lists(st.floats(0.01, 1.0), min_size=4, max_size=4),
    last=st.floats(1.0, 4.0),
    links=st.lists(st.floats(0.0, 0.6), min_size=4, max_size=4),
    shares=st.lists(st.floats(0.0, 1.0), min_size=5, max_size=5),
)
def test_closed_form_is_exact_under_the_proved_conditions(
    n: int, m: int, head: list[float], last: float, links: list[float], shares: list[float]
) -> None:
    problem, plan = _pipe([*head[: n - 1], last], m, links[: n - 1], shares[:n])
    assume(_exact_conditions(problem, plan))
    assert _close(simulate(problem, plan).step_time_s, score_plan(problem, plan).step_time_s)


@settings(max_examples=300, deadline=None)
@given(st.one_of(_problems(), _problems(free_links=True)))
def test_random_plans_exact_when_proved_and_above_every_lower_bound(
    case: tuple[PlanningProblem, Plan],
) -> None:
    problem, plan = case
    score = score_plan(problem, plan)
    result = simulate(problem, plan)
    if _exact_conditions(problem, plan):
        assert _close(result.step_time_s, score.step_time_s)
    # Any schedule: stage s starts after everything before it, works M * T_s, and
    # its last gradient returns through everything before it.
    m, t, c = problem.microbatches, score.compute_s, score.link_s
    for s in range(len(t)):
        bound = sum(t[:s]) + sum(c[:s]) + m * t[s]
        assert result.step_time_s >= bound * (1 - REL)


@pytest.mark.parametrize(
    ("times", "links", "shares", "m", "closed", "simulated"),
    [
        ([3, 1], None, None, 4, 13.0, 12.0),
        ([1, 1], [1.0], None, 8, 10.0, 13.0),
        ([1, 2], [1.0], None, 8, 18.0, 18.0),
        ([0.1, 0.1], [1.0], None, 8, 8.2, 5.3),
        ([1, 1, 0.5, 1], None, [0, 1, 0, 0], 3, 5.5, 6.0),
    ],
)
def test_documented_differences(
    times: list[float],
    links: list[float] | None,
    shares: list[float] | None,
    m: int,
    closed: float,
    simulated: float,
) -> None:
    # The examples quoted in [Note: closed form versus simulation].
    problem, plan = _pipe(times, m, links, shares)
    assert score_plan(problem, plan).step_time_s == pytest.approx(closed, rel=1e-9)
    assert simulate(problem, plan).step_time_s == pytest.approx(simulated, rel=1e-9)


# ---- (b) memory


@settings(max_examples=150, deadline=None)
@given(_problems())
def test_peak_memory_is_the_spec_formula(case: tuple[PlanningProblem, Plan]) -> None:
    problem, plan = case
    n, m = len(plan.stages), problem.microbatches
    one = simulate(problem, plan, "1f1b")
    assert one.peak_memory_bytes == score_plan(problem, plan).memory_bytes  # exactly
    assert one.peak_microbatches_held == [min(n - s, m) for s in range(n)]
    pipe = simulate(problem, plan, "gpipe")
    b, k = problem.batch_size / m, problem.optimizer_state_factor
    for s, stage in enumerate(plan.stages):
        chunk = problem.layers[stage.start : stage.end]
        params = sum(unit.param_bytes for unit in chunk)
        acts = sum(unit.saved_bytes for unit in chunk)
        assert pipe.peak_memory_bytes[s] == k * params + m * b * acts
        assert pipe.peak_memory_bytes[s] >= one.peak_memory_bytes[s]


# ---- (c) timeline invariants, (d) GPipe


@settings(max_examples=150, deadline=None)
@given(_problems(), st.sampled_from(["1f1b", "gpipe"]))
def test_timeline_respects_dependencies_and_resources(
    case: tuple[PlanningProblem, Plan], name: str
) -> None:
    problem, plan = case
    result = simulate(problem, plan, name)
    _check_timeline(
        result, make_schedule(name, len(plan.stages), problem.microbatches), problem.microbatches
    )
    assert result.step_time_s == max(e.end_s for e in result.timeline if e.kind == "B")
    busy = sum(result.busy_s)
    assert _close(busy, problem.microbatches * sum(score_plan(problem, plan).compute_s))
    assert result.bubble_fraction == pytest.approx(
        1 - busy / (len(plan.stages) * result.step_time_s), abs=1e-12
    )


@settings(max_examples=150, deadline=None)
@given(_problems())
def test_gpipe_is_two_tandem_lines(case: tuple[PlanningProblem, Plan]) -> None:
    problem, plan = case
    score = score_plan(problem, plan)
    f, g, c = _split(problem, plan)
    m = problem.microbatches
    expect = sum(score.compute_s) + sum(score.link_s) + (m - 1) * (max(f + c) + max(g + c))
    step = simulate(problem, plan, "gpipe").step_time_s
    assert _close(step, expect)
    assert step >= score.step_time_s * (1 - REL)


@pytest.mark.parametrize(("n", "m"), [(1, 4), (2, 2), (3, 5), (4, 8), (5, 3)])
def test_gpipe_equals_1f1b_for_balanced_stages_and_free_links(n: int, m: int) -> None:
    problem, plan = _pipe([0.5] * n, m)
    one, pipe = simulate(problem, plan), simulate(problem, plan, "gpipe")
    assert _close(one.step_time_s, pipe.step_time_s)
    assert all(p >= o for p, o in zip(pipe.peak_memory_bytes, one.peak_memory_bytes, strict=True))
    # Unequal forward shares make GPipe's phases slower: (m - 1) * (max f + max g).
    problem, plan = _pipe([0.5] * n, m, shares=[0.1, 0.9, 0.5, 0.2, 0.7][:n])
    assert simulate(problem, plan, "gpipe").step_time_s >= simulate(problem, plan).step_time_s


# ---- (f) traces, (g) deadlocks


def test_chrome_trace_is_valid_json(tmp_path: Path) -> None:
    problem, plan = _pipe([0.2, 0.3, 0.1], 4, links=[0.05, 0.02])
    result = simulate(problem, plan)
    path = tmp_path / "trace.json"
    result.write_chrome_trace(path)
    trace = json.loads(path.read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(result.timeline) == 3 * 2 * 4 + 2 * 2 * 4
    assert {(e["pid"], e["tid"]) for e in complete} == {
        (0, 0),
        (1, 0),
        (2, 0),
        (0, 1),
        (1, 1),
        (1, 2),
        (2, 2),
    }
    last = max(complete, key=lambda e: e["ts"] + e["dur"])
    assert last["ts"] + last["dur"] == pytest.approx(result.step_time_s * 1e6)
    names = [e for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"]
    assert names[1]["args"]["name"] == "stage 1 (d1)"
    assert json.loads(json.dumps(result.to_json()))["timeline"][0]["kind"] == "F"


def test_deadlock_is_detected() -> None:
    problem, plan = _pipe([1.0, 1.0], 2)
    # Stage 1 wants microbatch 1 first; stage 0 sends it only after B0, which
    # needs stage 1's B0, which comes after its F1.
    bad = parse_schedule("F0 B0 F1 B1\nF1 B1 F0 B0")
    with pytest.raises(
        DeadlockError, match="stage 1 waits at F1 for the activation of microbatch 1"
    ):
        simulate(problem, plan, bad)
    with pytest.raises(DeadlockError, match="waits at B0 for its own F0"):
        simulate(problem, plan, parse_schedule("B0 F0 F1 B1\nF0 B0 F1 B1"))
    simulate(problem, plan, parse_schedule("F0 F1 B1 B0\nF0 F1 B1 B0"))  # unusual, but fine


def test_a_group_sums_its_gradients_after_its_last_backward() -> None:
    """Version 2: a group's sum overlaps its last backward by its reduce-scatter half
    ([Note: what the overlap hides]): one stage on a group of two is ``M * T + R`` (the
    closed form) less ``min(R / 2, g)``; in a two-stage plan the step ends when what is
    left of the group's sum after its last backward is done, and its peak memory is the
    larger member's share of each microbatch."""
    unit = {"fwd_flops": 1e9, "param_bytes": 4e6, "out_bytes": 1e5, "act_bytes": 1e6}
    devices = [
        {
            "id": f"d{i}",
            "gflops": g,
            "memory_bytes": 1e10,
            "bandwidth_mbps": 100.0,
            "latency_ms": 1.0,
        }
        for i, g in enumerate((30.0, 10.0, 20.0))
    ]
    problem = make_problem([unit, unit], devices, microbatches=4).model_copy(update={"version": 2})
    one = Plan((Stage.group(["d0", "d1"], 0, 2),))
    score, sim = score_plan(problem, one), simulate(problem, one)
    r, backward = score.allreduce_s[0], score.compute_s[0] * 2 / 3  # bwd = 2 x fwd
    assert 0 < r / 2 < backward  # the whole reduce-scatter half hides
    assert sim.step_time_s == pytest.approx(score.step_time_s - r / 2, rel=1e-12)
    assert sim.devices == ["d0+d1"]
    two = Plan((Stage.group(["d0", "d1"], 0, 1), Stage("d2", 1, 2)))
    score, sim = score_plan(problem, two), simulate(problem, two)
    last_b = max(e.end_s for e in sim.timeline if e.kind == "B" and e.index == 0)
    hidden = min(score.allreduce_s[0] / 2, score.compute_s[0] * 2 / 3)
    assert sim.step_time_s == pytest.approx(
        max(
            last_b + score.allreduce_s[0] - hidden,
            max(e.end_s for e in sim.timeline if e.kind == "B" and e.index == 1),
        ),
        rel=1e-12,
    )
    assert sim.step_time_s > last_b
    b, k = problem.batch_size / 4, problem.optimizer_state_factor
    held = sim.peak_microbatches_held[0]
    assert sim.peak_memory_bytes[0] == pytest.approx(k * 4e6 + held * 0.75 * b * 1e6)


def test_a_diloco_group_sums_once_in_its_steps_after_them() -> None:
    """A non-exact job's group sums its movement once in ``sum_every`` steps, after the
    optimizer's step: nothing of it hides behind a backward, and the simulated step is the
    mean, the compute's end plus ``R / H``, as :func:`predict` prices it."""
    unit = {"fwd_flops": 1e9, "param_bytes": 4e6, "out_bytes": 1e5, "act_bytes": 1e6}
    devices = [
        {
            "id": f"d{i}",
            "gflops": 20.0,
            "memory_bytes": 1e10,
            "bandwidth_mbps": 10.0,
            "latency_ms": 1.0,
        }
        for i in range(2)
    ]
    problem = make_problem([unit, unit], devices, microbatches=4).model_copy(update={"version": 2})
    plan = Plan((Stage.group(["d0", "d1"], 0, 2),))
    score = score_plan(problem, plan)
    r = score.allreduce_s[0]
    exact = simulate(problem, plan)
    for every in (2, 8):
        sim = simulate(problem, plan, sum_every=every)
        end = max(e.end_s for e in sim.timeline if e.lane == "stage")
        assert sim.step_time_s == pytest.approx(end + r / every, rel=1e-12)
        assert sim.step_time_s < exact.step_time_s
    steps = fastest_schedule(problem, plan, sum_every=8)[1]
    assert steps["1f1b"] == pytest.approx(simulate(problem, plan, sum_every=8).step_time_s)
