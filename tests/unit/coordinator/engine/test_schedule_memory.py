"""The schedule fitted to a job's plan ([Note: choosing the schedule] in
:mod:`coordinator.engine.engine`): the planner checks 1F1B's memory, and ZB-H1 and GPipe
keep more microbatches in flight on the later stages, so a named schedule the devices
cannot hold is refused, and ``auto`` takes the fastest they hold, with the prediction
moved to it.
"""

from __future__ import annotations

import pytest

from coordinator.engine.assignments import make_assignments
from coordinator.engine.engine import plan_over
from coordinator.engine.runners import run_inprocess
from coordinator.engine.spec import JobSpec
from coordinator.planner.anatomy import StepTerms, anatomy
from coordinator.planner.build import parse_fleet
from coordinator.planner.score import for_plan
from coordinator.planner.simulator import memory_error, schedule_saving, simulate
from edge.errors import UserError


def test_a_plan_that_fits_only_1f1b_is_refused_for_zb_h1_and_gpipe() -> None:
    spec = JobSpec(model="cnn-digits", steps=1, batch_size=64, microbatches=4, stages=3)
    fleet = [
        d.model_copy(update={"id": f"pi-{i}"}) for i, d in enumerate(parse_fleet("rpi4-4gb:3"))
    ]
    planned = plan_over(spec, fleet)
    last = planned.plan.stages[-1].devices[0]
    need = planned.score.memory_bytes[-1]
    tight = [d.model_copy(update={"memory_bytes": need}) if d.id == last else d for d in fleet]
    again = plan_over(spec, tight)
    assert again.plan == planned.plan, "the same plan still fits 1F1B"
    for schedule in ("zb-h1", "gpipe"):
        with pytest.raises(UserError, match=rf"^stage 2 on {last} needs .* under {schedule} "):
            plan_over(spec.model_copy(update={"schedule": schedule}), tight)
    assert plan_over(spec.model_copy(update={"schedule": "zb-h1"}), fleet).plan == planned.plan


def _fleet() -> list:  # type: ignore[type-arg]
    """Three Pi 4s from the catalogue: no fixed costs, so no unit timed on this machine and
    every figure the spec's (a plan that does not move with this host's load)."""
    return [d.model_copy(update={"id": f"pi-{i}"}) for i, d in enumerate(parse_fleet("rpi4-4gb:3"))]


def test_auto_does_not_take_a_split_schedule_for_a_compiled_job() -> None:
    """Where auto takes ZB-H1 (the test below), a job with ``compile`` gets the fastest
    of the others ([Note: compiled stages] in :mod:`edge.runtime.compiling`)."""
    spec = JobSpec(
        model="cnn-digits", steps=1, batch_size=64, microbatches=4, stages=3, schedule="auto"
    )
    assert plan_over(spec, _fleet()).schedule == "zb-h1"
    compiled = plan_over(spec.model_copy(update={"compile": True}), _fleet())
    assert compiled.schedule in ("1f1b", "gpipe")
    assert "zb-h1" not in compiled.found.method


def test_auto_takes_the_fastest_schedule_the_devices_hold_and_the_job_runs_it() -> None:
    spec = JobSpec(
        model="cnn-digits", steps=1, batch_size=64, microbatches=4, stages=3, schedule="auto"
    )
    fleet = _fleet()
    ofob = plan_over(spec.model_copy(update={"schedule": "1f1b"}), fleet)
    auto = plan_over(spec, fleet)
    assert auto.plan == ofob.plan and auto.schedule == "zb-h1"
    assert "schedule zb-h1 of 1f1b " in auto.found.method
    # The prediction moves to the schedule: less by what it saves, and out of the bubble.
    before, after = ofob.found.prediction, auto.found.prediction
    assert before is not None and after is not None and after.schedule == "zb-h1"
    saving = schedule_saving(
        for_plan(auto.problem, auto.plan), auto.plan, before.compute_s, before.link_s, "zb-h1"
    )
    assert saving > 0 and after.schedule_saving_s == saving
    assert after.step_time_s == pytest.approx(before.step_time_s - saving, rel=1e-12)
    parts = anatomy(auto.plan, StepTerms.of_prediction(auto.problem, after))
    assert parts.step_time_s == pytest.approx(after.step_time_s, rel=1e-9)
    assert all(m.total == pytest.approx(after.step_time_s, rel=1e-9) for m in parts.members)
    was = anatomy(ofob.plan, StepTerms.of_prediction(ofob.problem, before))
    assert sum(m.bubble for m in parts.members) < sum(m.bubble for m in was.members)
    # An unplanned auto job gets no assignment; planned, it runs the schedule chosen.
    with pytest.raises(ValueError, match='schedule "auto" is chosen with the plan'):
        make_assignments("j", spec, auto.plan)
    result = run_inprocess(auto.resolve(spec), auto.plan, timeout_s=120)
    assert {r.stage for r in result.reports} == {0, 1, 2}
    assert all("W" in r.actions for r in result.reports), "the job ran another schedule"


def test_auto_keeps_1f1b_where_the_devices_hold_no_other() -> None:
    spec = JobSpec(model="mlp", steps=1, batch_size=64, microbatches=4, stages=3, schedule="auto")
    fleet = _fleet()
    planned = plan_over(spec, fleet)
    # Every device with room for the plan's largest 1F1B stage, and no more.
    most = max(planned.score.memory_bytes)
    again = plan_over(spec, [d.model_copy(update={"memory_bytes": most}) for d in fleet])
    assert len(again.plan.stages) == 3 and again.schedule == "1f1b"
    # ZB-H1 would be faster, and is not taken because it does not fit.
    problem = for_plan(again.problem, again.plan)
    assert memory_error(problem, again.plan, "zb-h1") is not None
    faster = simulate(problem, again.plan, "zb-h1").step_time_s
    assert faster < simulate(problem, again.plan, "1f1b").step_time_s
    assert again.found.prediction is not None and again.found.prediction.schedule == "1f1b"
    assert again.resolve(spec).schedule == "1f1b"
