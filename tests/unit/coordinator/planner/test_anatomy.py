"""The predicted anatomy of a step (:mod:`coordinator.planner.anatomy`).

Claims under test:

- every member's six parts add up to the step, and the step is the one the spec's
  score or the internal model predicts for the same plan (random plans: pipelines,
  groups with the spec's shares and with fixed ones, U-shaped, fixed costs and unit
  seconds with a fixed part);
- each part is what its formula says, on hand-worked cases: a pipeline whose first
  stage is the bottleneck (the fast stage waits in the steady state: imbalance), a
  balanced pipeline (only bubble), a link as the bottleneck, a group whose members
  are unequal, and a version 2 group's sum;
- :meth:`Anatomy.largest_loss` names the part besides compute that costs the fleet most;
- ``edgetrain plan --explain`` prints the anatomy of the plan it gives, and adds it to
  ``--json``;
- the measured anatomy splits each member's waits, from hand-made reports, into what
  was on the wire (by the sender's clock) and what was fill and drain or steady state,
  and its parts add up to each member's period;
- a run's meter measures each step once every member reported it and the next (the
  first, warm-up, left out), averages what it measured, and keeps a bounded buffer.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from support.calibrated import with_measured_costs
from support.planning import make_problem, random_problem
from typer.testing import CliRunner

from coordinator.planner.anatomy import (
    PARTS,
    Anatomy,
    AnatomyMeter,
    StepTerms,
    anatomy,
    measured_anatomy,
)
from coordinator.planner.predict import predict
from coordinator.planner.score import Plan, Stage, score_plan
from edge.problem import PlanningProblem
from edge.wire.messages import StepReport
from edgetrain.cli import app

REL = 1e-9


def _check_adds_up(got: Anatomy, step: float) -> None:
    assert got.step_time_s == pytest.approx(step, rel=REL)
    for member in got.members:
        assert member.total == pytest.approx(step, rel=REL), member
        assert min(getattr(member, p) for p in PARTS) >= -step * REL, member


def _stage(members: list[str] | tuple[str, ...], start: int, end: int) -> Stage:
    return Stage(members[0], start, end, tuple(members[1:]))


def _random_plan(problem: PlanningProblem, rng: random.Random, *, groups: bool) -> Plan:
    """Devices in random order, cut into random contiguous stages; with ``groups``, some
    stages on two or three devices."""
    ids = [d.id for d in problem.devices]
    rng.shuffle(ids)
    n_units = len(problem.layers)
    n_stages = rng.randint(1, min(n_units, 3))
    cuts = sorted(rng.sample(range(1, n_units), n_stages - 1))
    bounds = [0, *cuts, n_units]
    stages = []
    for s in range(n_stages):
        size = rng.randint(1, 2) if groups and len(ids) - (n_stages - s) >= 2 else 1
        members, ids = ids[:size], ids[size:]
        stages.append(_stage(members, bounds[s], bounds[s + 1]))
    return Plan(tuple(stages))


@pytest.mark.parametrize("seed", range(12))
def test_the_parts_add_up_to_the_spec_score_of_random_plans(seed: int) -> None:
    rng = random.Random(seed)
    problem = random_problem(seed, 6, 6, memory_fraction=(5.0, 10.0)).as_version(2)
    plan = _random_plan(problem, rng, groups=seed % 2 == 1)
    score = score_plan(problem, plan)
    got = anatomy(plan, StepTerms.of_score(problem, score))
    _check_adds_up(got, score.step_time_s)
    assert len(got.members) == sum(len(st.devices) for st in plan.stages)


@pytest.mark.parametrize("seed", range(12))
def test_the_parts_add_up_to_the_prediction_with_fixed_costs_and_unit_seconds(seed: int) -> None:
    rng = random.Random(seed)
    problem = random_problem(seed, 6, 6, memory_fraction=(5.0, 10.0)).as_version(2)
    problem, units = with_measured_costs(problem, rng)
    plan = _random_plan(problem, rng, groups=True)
    prediction = predict(problem, plan, units)
    got = anatomy(plan, StepTerms.of_prediction(problem, prediction))
    _check_adds_up(got, prediction.step_time_s)
    fixed = [m.fixed for m in got.members]
    assert min(fixed) >= prediction.per_step_s > 0  # the fixed costs are a part of their own


def test_a_u_shaped_plan_adds_up_too() -> None:
    problem = random_problem(3, 4, 5, memory_fraction=(5.0, 10.0)).as_version(2)
    a, b, c = (d.id for d in problem.devices[:3])
    plan = Plan((_stage((a, b), 0, 1), _stage((c,), 1, 4), _stage((a, b), 4, 5)), u_shaped=True)
    score = score_plan(problem, plan)
    _check_adds_up(anatomy(plan, StepTerms.of_score(problem, score)), score.step_time_s)


def _two_stage(gflops: tuple[float, float], *, bandwidth_mbps: float = 1e15) -> PlanningProblem:
    """Two units of 1 GFLOP a sample (forward and backward together), nothing to send but
    what ``bandwidth_mbps`` makes of 125 kB; one sample a microbatch, four microbatches."""
    unit = {"fwd_flops": 0.5e9, "bwd_flops": 0.5e9, "param_bytes": 0.0, "out_bytes": 125_000.0}
    devices = [
        {
            "id": name,
            "gflops": g,
            "memory_bytes": 1e12,
            "bandwidth_mbps": bandwidth_mbps,
            "latency_ms": 0.0,
        }
        for name, g in zip("ab", gflops, strict=True)
    ]
    return make_problem([unit, unit], devices, batch_size=4, microbatches=4)


TWO = Plan.of(("a", 0, 1), ("b", 1, 2))


def _parts(problem: PlanningProblem, plan: Plan) -> list[dict[str, float]]:
    got = anatomy(plan, StepTerms.of_score(problem, score_plan(problem, plan)))
    return [{p: round(getattr(m, p), 9) for p in PARTS} for m in got.members]


def test_a_fast_stage_behind_a_slow_one_waits_in_the_steady_state() -> None:
    """T = [1/3, 1] s (a at 3, b at 1 GFLOP/s), free link, M = 4: the step is
    3 * 1 + 4/3 = 13/3 s. b computes 4 s and waits 1/3 s for the first forward and the
    last backward (bubble); a computes 4/3 s, waits 1 s of bubble and 3 * 2/3 = 2 s on b."""
    got = _parts(_two_stage((3.0, 1.0)), TWO)
    none = {"fixed": 0.0, "link": 0.0, "group_sum": 0.0}
    assert got == [
        {"compute": round(4 / 3, 9), "bubble": 1.0, "imbalance": 2.0, **none},
        {"compute": 4.0, "bubble": round(1 / 3, 9), "imbalance": 0.0, **none},
    ]


def test_a_balanced_pipeline_loses_only_its_bubble() -> None:
    """T = [1, 1], M = 4: a step of 5 s, of which each stage waits 1 (S - 1 = 1 stage's T)."""
    got = _parts(_two_stage((1.0, 1.0)), TWO)
    assert [(m["compute"], m["bubble"], m["imbalance"]) for m in got] == [(4.0, 1.0, 0.0)] * 2


def test_a_link_that_is_the_bottleneck_is_link_time() -> None:
    """T = [1, 1] and a link of C = 2 * 125 kB * 8 / 0.5 Mbit/s = 4 s a microbatch (the
    activation and its gradient): tau = 4, the step 3 * 4 + 2 + 4 = 18 s; each stage
    computes 4 and waits 1 of bubble, the rest, 4 + 3 * 3 = 13 s, is the link."""
    got = _parts(_two_stage((1.0, 1.0), bandwidth_mbps=0.5), TWO)
    assert [(m["compute"], m["bubble"], m["link"]) for m in got] == [(4.0, 1.0, 13.0)] * 2


def test_a_groups_faster_member_waits_for_the_slower_with_fixed_shares() -> None:
    """One stage on a (3 GFLOP/s) and b (1 GFLOP/s) at half the rows each (data that stays
    home fixes the shares): b takes 1 s a microbatch of 2 GFLOP, a 1/3 s; over four
    microbatches a waits 4 * 2/3 s on b. The sum of 0 bytes of parameters is free."""
    problem = _two_stage((3.0, 1.0)).as_version(2)
    plan = Plan((_stage(("a", "b"), 0, 2),))
    score = score_plan(problem, plan, fixed_shares={0: [0.5, 0.5]})
    got = anatomy(plan, StepTerms.of_score(problem, score))
    _check_adds_up(got, 4.0)
    a, b = got.members
    assert (a.compute, a.imbalance) == pytest.approx((4 / 3, 8 / 3), rel=REL)
    assert (b.compute, b.imbalance) == pytest.approx((4.0, 0.0), abs=1e-12)


def test_a_groups_sum_is_group_sum_for_every_member() -> None:
    """A version 2 group with parameters to sum: every member of every stage waits for the
    slowest group's sum, R, once a step; and it is the largest loss of a plan whose
    stages are otherwise balanced."""
    unit = {"fwd_flops": 0.5e9, "bwd_flops": 0.5e9, "param_bytes": 5e6, "out_bytes": 1.0}
    devices = [
        {"id": i, "gflops": 1.0, "memory_bytes": 1e12, "bandwidth_mbps": 10.0, "latency_ms": 0.0}
        for i in "abc"
    ]
    problem = make_problem([unit, unit], devices, batch_size=4, microbatches=4).as_version(2)
    plan = Plan((_stage(("a", "b"), 0, 1), _stage(("c",), 1, 2)))
    score = score_plan(problem, plan)
    got = anatomy(plan, StepTerms.of_score(problem, score))
    _check_adds_up(got, score.step_time_s)
    assert score.allreduce_s[0] > 0
    assert [m.group_sum for m in got.members] == [score.allreduce_s[0]] * 3
    assert got.largest_loss() == "group_sum"
    assert got.to_json()["largest_loss"] == "group_sum"
    assert sum(got.fractions().values()) == pytest.approx(1.0, rel=REL)


def test_plan_explain_gives_the_anatomy_of_the_plan_it_prints() -> None:
    """``edgetrain plan --explain --json``: the plan's JSON object gains ``anatomy``, whose
    members are the plan's and add up to its step; four Pis on VGG-11 sum their group's
    gradients, the largest loss. Without --json the same parts print as a table."""
    args = ["plan", "--model", "vgg11", "--devices", "rpi4-4gb:4", "-b", "64", "--explain"]
    done = CliRunner().invoke(app, [*args, "--json"])
    assert done.exit_code == 0, done.output
    got = json.loads(done.output)
    parts = got["anatomy"]
    assert parts["step_time_s"] == pytest.approx(got["step_time_s"], rel=REL)
    members = [d for stage in got["stages"] for d in stage["devices"]]
    assert [m["device"] for m in parts["members"]] == members
    for m in parts["members"]:
        assert sum(m[p] for p in PARTS) == pytest.approx(got["step_time_s"], rel=REL)
    assert parts["largest_loss"] == "group_sum"
    shown = CliRunner().invoke(app, args)
    assert shown.exit_code == 0, shown.output
    said = " ".join(shown.output.split())  # rich wraps at the terminal's width
    assert "where the step goes" in said and "the largest loss is group sum" in said
    plain = CliRunner().invoke(app, [*args[:-1], "--json"])
    assert "anatomy" not in json.loads(plain.output)


def _report(stage: int, step: int, started_at: float, **fields: Any) -> StepReport:
    return StepReport(
        job="j1", stage=stage, device=f"d{stage}", step=step, started_at=started_at, **fields
    )


def test_the_measured_anatomy_splits_waits_by_the_senders_clock_and_the_stage_times() -> None:
    """Two stages, two microbatches, 1F1B, hand-made reports (times in ms from 100 s).

    Stage 1 waits 0-9 for activation 0, which stage 0 began sending at 10 (stage 1's
    clock started at 2): 1 ms on the wire, 8 on stage 0. It waits 16-23 for activation
    1, sent from 21: 4 on the wire, 3 on stage 0. Of its 11 ms on stage 0, the fill and
    drain of stages of 5 and 10 ms a microbatch (compute over 2) cost it 15 - 10 = 5
    (bubble), the rest is imbalance. Stage 0 waits 22-30 for gradient 0, sent from 17,
    and 40-45 for gradient 1, sent from 32: all on the wire. Sends count as link; what
    the period (to the next step's start) holds besides is fixed."""
    zero = 100.0
    reports = [
        _report(
            0,
            0,
            zero,
            actions="F0 F1 B0 B1",
            timeline="sA0@10+1 sA1@21+1 wG0@22+8 wG1@40+5",
            compute_s=0.010,
            step_s=0.060,
        ),
        _report(
            1,
            0,
            zero + 0.002,
            actions="F0 B0 F1 B1",
            timeline="wA0@0+9 sG0@15+1 wA1@16+7 sG1@30+1",
            compute_s=0.020,
            step_s=0.050,
        ),
        _report(0, 1, zero + 0.070),
        _report(1, 1, zero + 0.072),
    ]
    got = measured_anatomy(reports, 0)
    assert got.step_time_s == pytest.approx(0.070, abs=1e-9)
    ms = [{p: round(getattr(m, p) * 1e3, 6) for p in PARTS} for m in got.members]
    assert ms == [
        {"compute": 10, "fixed": 45, "bubble": 0, "imbalance": 0, "link": 15, "group_sum": 0},
        {"compute": 20, "fixed": 32, "bubble": 5, "imbalance": 6, "link": 7, "group_sum": 0},
    ]
    last = measured_anatomy(reports[:2], 0)  # no next step: the period is the step's own
    assert [m.total for m in last.members] == pytest.approx([0.060, 0.050], abs=1e-9)


def test_a_report_without_a_timeline_has_its_waits_split_as_on_a_neighbour() -> None:
    """One stage of 1 s (no F actions said: one microbatch) alone: no fill to pay, so
    its 0.5 s of waiting is imbalance; its sends, unseen, stay in fixed."""
    old = _report(0, 0, 0.0, compute_s=1.0, wait_s=0.5, send_s=0.25, step_s=2.0)
    (member,) = measured_anatomy([old], 0).members
    assert (member.compute, member.bubble, member.imbalance) == (1.0, 0.0, 0.5)
    assert (member.link, member.fixed) == (0.0, 0.5)
    with pytest.raises(ValueError, match="no report of step 3"):
        measured_anatomy([old], 3)


def _two_members(step: int, at: float, compute: float) -> list[StepReport]:
    """Stage 0 and 1 of one step, one microbatch each way, starting at ``at``."""
    return [
        _report(0, step, at, actions="F0 B0", timeline="sA0@0+1", compute_s=compute, step_s=0.9),
        _report(1, step, at, actions="F0 B0", timeline="wA0@0+1", compute_s=compute, step_s=0.9),
    ]


def test_the_meter_measures_each_step_once_all_members_and_the_next_step_reported() -> None:
    """Steps of 1 s, compute 0.2 s then 0.4 s: the first step is warm-up, the last waits for
    a next one, and the mean is over what was measured, member by member."""
    meter = AnatomyMeter(members=2)
    runs = [_two_members(k, 100.0 + k, 0.2 if k < 3 else 0.4) for k in range(5)]
    assert meter.mean() is None
    seen = []
    for step in runs:
        for r in step:
            seen.append(meter.add(r))
    # step 1 is measured when step 2's second report arrives, and so on; step 0 never
    assert seen == [False, False, False, False, False, True, False, True, False, True]
    assert meter.steps == 3
    mean = meter.mean()
    assert mean is not None
    assert mean.step_time_s == pytest.approx(1.0, abs=1e-9)
    assert [m.compute for m in mean.members] == pytest.approx([(0.2 + 0.2 + 0.4) / 3] * 2)
    assert [m.total for m in mean.members] == pytest.approx([1.0, 1.0], abs=1e-9)
    meter.finish()  # the last step, by its own step_s (0.9 s)
    assert meter.steps == 4
    last = meter.mean()
    assert last is not None and last.step_time_s == pytest.approx((3 * 1.0 + 0.9) / 4)


def test_the_meter_forgets_a_step_a_member_never_reported() -> None:
    """Stage 1's report of step 2 is lost: steps 1 and 2 cannot be measured, later ones are,
    and what it holds stays a few steps long."""
    meter = AnatomyMeter(members=2, warmup=0)
    for k in range(12):
        for r in _two_members(k, 100.0 + k, 0.2):
            if (k, r.stage) != (2, 1):
                meter.add(r)
    assert meter.steps == 11 - 2
    assert len(meter._reports) <= 5  # the bound is the claim
