"""The measured anatomy of a real pipeline (:func:`coordinator.planner.anatomy.measured_anatomy`).

Two stages run in threads of this process (:func:`coordinator.engine.runners.run_inprocess`)
on a model cut where one stage has nearly all the work: six 1024-wide layers against a
1024 x 10 head. Their step reports carry a timeline; the anatomy built from them must

- add up, for every member, to its period (exactly: ``fixed`` is the rest), and each
  member's periods, over the steady steps, to within 5% of stage 0's (the step the
  pipeline makes);
- hold the waits the stage reported: its timeline's waits sum to its ``wait_s``;
- put the light stage's waiting where it is: in the steady state (imbalance), many
  times its own compute, while the heavy stage waits less than it computes.
"""

from __future__ import annotations

import pytest

from coordinator.engine.runners import run_inprocess
from coordinator.engine.spec import JobSpec
from coordinator.planner.anatomy import PARTS, measured_anatomy
from coordinator.planner.score import Plan
from edge.wire.timeline import parse_timeline

STEPS, MICROBATCHES = 12, 4


def test_a_heavy_and_a_light_stage_show_where_their_steps_go() -> None:
    spec = JobSpec(
        model="mlp",
        model_options={"hidden": 1024, "depth": 8},
        steps=STEPS,
        batch_size=64,
        microbatches=MICROBATCHES,
    )
    plan = Plan.of(("heavy", 0, 7), ("light", 7, 8))
    result = run_inprocess(spec, plan, timeout_s=300)
    reports = result.reports
    assert {(r.stage, r.step) for r in reports} == {(s, k) for s in (0, 1) for k in range(STEPS)}
    for r in reports:
        waits = [i for i in parse_timeline(r.timeline) if i.op == "w"]
        assert r.started_at > 0 and r.timeline
        assert sum(i.seconds for i in waits) == pytest.approx(
            r.wait_s, abs=2e-6 * len(waits) + 1e-9
        )
    steady = range(1, STEPS - 1)  # the first step warms up; the last has no next start
    periods = {0: 0.0, 1: 0.0}
    totals = {s: dict.fromkeys(PARTS, 0.0) for s in (0, 1)}
    for k in steady:
        got = measured_anatomy(reports, k)
        assert [m.stage for m in got.members] == [0, 1]
        for m in got.members:
            start = {r.stage: r.started_at for r in reports if r.step == k}
            after = {r.stage: r.started_at for r in reports if r.step == k + 1}
            period = after[m.stage] - start[m.stage]
            assert m.total == pytest.approx(period, rel=1e-9)
            periods[m.stage] += period
            for p in PARTS:
                totals[m.stage][p] += getattr(m, p)
    assert periods[1] == pytest.approx(periods[0], rel=0.05)
    heavy, light = totals[0], totals[1]
    assert light["imbalance"] > 5 * light["compute"], light
    assert light["imbalance"] > light["bubble"], light
    assert heavy["bubble"] + heavy["imbalance"] < heavy["compute"], heavy
