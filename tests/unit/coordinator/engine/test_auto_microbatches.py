"""A job's ``microbatches: "auto"``, its default: the engine plans the number with the plan
and runs the job with it ([Note: choosing the microbatches] in
:mod:`coordinator.planner.microbatches`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.jobs_api import jobs_api

from coordinator.engine.assignments import make_assignments, microbatch_choices_of
from coordinator.engine.engine import plan_over
from coordinator.engine.runners import run_inprocess
from coordinator.engine.spec import JobSpec
from coordinator.planner.build import parse_fleet
from coordinator.planner.predict import UnitSeconds
from coordinator.planner.score import score_plan
from edge.errors import UserError
from edge.models.local_data import announce, register
from edge.models.user_code import CodeAllowance

BATCH = 16


def _fleet(microbatch_s: float) -> list:  # type: ignore[type-arg]
    """Three Pi 4s that announce a fixed cost per microbatch, as measuring agents do."""
    costs = {"microbatch_s": microbatch_s, "step_s": 0.0, "frame_s": 0.0, "byte_s": 0.0}
    return [
        d.model_copy(update={"id": f"pi-{i}", "details": {"fixed_costs": costs}})
        for i, d in enumerate(parse_fleet("rpi4-4gb:3"))
    ]


def test_a_job_leaves_its_microbatches_to_the_planner_by_default() -> None:
    spec = JobSpec(model="mlp", steps=2, batch_size=BATCH)
    assert spec.microbatches == "auto"
    assert spec.at_microbatches(4).microbatches == 4
    assert JobSpec(model="mlp", steps=2, batch_size=BATCH, microbatches=2).at_microbatches(4) == (
        JobSpec(model="mlp", steps=2, batch_size=BATCH, microbatches=2)
    )


PI_UNITS = UnitSeconds(seconds=(0.020, 0.038, 0.013, 0.012), gflops=70.0)
"""cnn-digits' four units as a Pi 4 times them at the first choice's rows (16 of 64), in
proportion to the rows: the agents' own timings, so that the choice below does not ride
on this host's timing of the units (a fitted intercept that moves with the host's load
moved the cheap fleet's choice between 1 and 2 microbatches)."""


def _own_units() -> dict[str, UnitSeconds]:
    return {f"pi-{i}": PI_UNITS for i in range(3)}


def test_an_auto_job_is_refused_an_assignment_before_it_is_planned() -> None:
    spec = JobSpec(model="mlp", steps=2, batch_size=BATCH)
    planned = plan_over(spec.at_microbatches(4), _fleet(0.0)[:1])
    with pytest.raises(ValueError, match="chosen with the plan"):
        make_assignments("j", spec, planned.plan)


def test_the_engine_plans_the_number_and_the_job_runs_with_it() -> None:
    """A pipeline of three stages: dear microbatches, fewer of them. The plan's score and
    prediction are at the chosen number, and the job trained at it is the job trained
    with that number given."""
    spec = JobSpec(model="cnn-digits", steps=2, batch_size=64, seed=3, stages=3)
    cheap = plan_over(spec, _fleet(0.0), device_units=_own_units())
    dear = plan_over(spec, _fleet(0.5), device_units=_own_units())
    assert cheap.own_units == ("pi-0", "pi-1", "pi-2")
    choices = microbatch_choices_of(spec)
    assert cheap.problem.microbatches in choices and dear.problem.microbatches in choices
    assert dear.problem.microbatches < cheap.problem.microbatches
    assert len(dear.plan.stages) == 3 and "microbatches of" in dear.found.method
    prediction = dear.found.prediction
    assert prediction is not None
    # The plan's score and prediction are at the number it runs with.
    assert dear.score == score_plan(dear.problem, dear.plan)
    assert prediction.spec_step_time_s == dear.score.step_time_s
    m = cheap.problem.microbatches
    got = run_inprocess(spec.at_microbatches(m), cheap.plan, shares=cheap.shares)
    given = JobSpec.model_validate({**spec.model_dump(), "microbatches": m})
    want = run_inprocess(given, cheap.plan, shares=cheap.shares)
    assert m > 1 and all(r.actions.count("F") == m for r in got.reports)
    for name, tensor in want.weights.items():
        assert torch.equal(got.weights[name], tensor), name


def test_the_api_takes_auto_and_refuses_anything_else_with_one_message(tmp_path: Path) -> None:
    body = {"model": "mlp", "steps": 2, "batch_size": BATCH}
    with jobs_api(tmp_path / "coord") as api:
        made = api.client.post("/api/v1/jobs", json=body)
        assert made.status_code == 201, made.text
        assert made.json()["spec"]["microbatches"] == "auto"
        given = api.client.post("/api/v1/jobs", json={**body, "microbatches": "auto"})
        assert given.status_code == 201, given.text
        for bad in ("many", 0, 3):
            refused = api.client.post("/api/v1/jobs", json={**body, "microbatches": bad})
            assert refused.status_code == 422, refused.text
            assert len(refused.json()["detail"]) == 1, refused.json()


def test_an_auto_job_on_many_holders_starts_where_each_holds_a_sample() -> None:
    """[Note: a row for every holder]: 32 Pi 4s holding digits and a laptop, batches of
    64. The first choice, 4 microbatches of 16, leaves half the holders without a
    sample, so the auto job is planned from the choices with one a holder; a job that
    names 4 microbatches is refused with the planner's one line."""
    holders = 32
    shards = [
        register([f"digits=digits:shard={i + 1}/{holders}"], CodeAllowance(()))
        for i in range(holders)
    ]
    pis = parse_fleet(f"rpi4-4gb:{holders},laptop")
    fleet = [announce(d, shards[i]) if i < holders else d for i, d in enumerate(pis)]
    body = {"model": "cnn-digits", "steps": 2, "batch_size": 64, "data": {"name": "digits"}}
    planned = plan_over(JobSpec.model_validate(body), fleet)
    assert planned.problem.microbatches in (1, 2)
    assert len(planned.plan.stages[0].devices) == holders
    with pytest.raises(UserError, match="holders' shares of a microbatch of 16"):
        plan_over(JobSpec.model_validate({**body, "microbatches": 4}), fleet)
