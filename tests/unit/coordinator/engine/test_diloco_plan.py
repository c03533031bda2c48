"""A non-exact job is planned with its groups' rarer sum ([Note: planning a DiLoCo job] in
:mod:`coordinator.engine.engine`, [Note: a DiLoCo group's sum] in
:mod:`coordinator.planner.predict`).

Four Pi 4s on 10 Mbit/s links train gpt-mini. Exactly, every step's sum of its gradients
costs more than a group saves, and the plan is one device. With ``diloco: {every: 8}`` the
engine predicts one group of all four faster and takes it, its sum an eighth of an exact
group's, and says so in the plan's method.
"""

from __future__ import annotations

import pytest

from coordinator.engine.engine import plan_over
from coordinator.engine.spec import JobSpec
from coordinator.planner.build import parse_fleet
from coordinator.planner.holders import holder_ends
from coordinator.planner.predict import predict
from coordinator.planner.score import score_plan
from edge.models.local_data import announce, register
from edge.models.user_code import CodeAllowance

EVERY = 8
SHARES = [1 / 3] * 3
"""Three holders of a third of digits each."""


def _fleet() -> list:  # type: ignore[type-arg]
    return [
        d.model_copy(update={"id": f"pi-{i}", "bandwidth_mbps": 10.0})
        for i, d in enumerate(parse_fleet("rpi4-4gb:4"))
    ]


def test_a_diloco_job_takes_the_group_its_rare_sum_makes_fastest() -> None:
    base = {"model": "gpt-mini", "steps": 10, "batch_size": 64, "microbatches": 4}
    exact = plan_over(JobSpec(**base), _fleet())
    diloco = plan_over(JobSpec(**base, diloco={"every": EVERY}), _fleet())
    assert not exact.plan.grouped, "the exact job should not pay for a group here"
    (stage,) = diloco.plan.stages
    assert sorted(stage.devices) == [f"pi-{i}" for i in range(4)]
    assert (stage.start, stage.end) == (0, len(diloco.problem.layers))
    assert "one group of every device" in diloco.found.method
    assert "DiLoCo, non-exact" in diloco.found.method
    before, after = exact.found.prediction, diloco.found.prediction
    assert before is not None and after is not None
    assert after.step_time_s < before.step_time_s
    # The group's sum is an eighth of what an exact group would pay (no fixed costs here).
    links = score_plan(diloco.problem, diloco.plan).allreduce_s[0]
    assert after.allreduce_s[0] == links / EVERY
    assert predict(diloco.problem, diloco.plan).allreduce_s[0] > after.allreduce_s[0]


def test_a_diloco_job_without_a_group_says_it_is_exact() -> None:
    base = {"model": "mlp", "steps": 10, "batch_size": 64, "microbatches": 4}
    planned = plan_over(JobSpec(**base, diloco={"every": EVERY}), _fleet())
    assert not planned.plan.grouped
    assert planned.found.method.endswith("DiLoCo asked, but no group: exact")


def test_a_diloco_jobs_schedule_is_simulated_with_its_rare_sum() -> None:
    """``schedule: auto`` simulates a DiLoCo plan's step with the sum it pays: each
    schedule's simulated step in the plan's method is the prediction's, not an exact
    group's that sums every step."""
    base = {"model": "gpt-mini", "steps": 10, "batch_size": 64, "microbatches": 4}
    planned = plan_over(JobSpec(**base, diloco={"every": EVERY}, schedule="auto"), _fleet())
    prediction = planned.found.prediction
    assert planned.plan.grouped and prediction is not None
    said = planned.found.method.split("schedule ")[-1]
    ms = float(said.split("1f1b ")[2].split(" ms")[0])
    assert ms == pytest.approx(prediction.step_time_s * 1e3, rel=0.02)


def test_holders_of_local_data_that_average_are_planned_with_their_rare_sum() -> None:
    """Data that stays home on three Pi 4s at 10 Mbit/s: with ``diloco`` (federated
    averaging: outer lr 1, no momentum) the holders' group sums once in ``every`` steps,
    in the prediction of the plan the job runs, and the plan's method says it is not
    exact."""
    shards = [register([f"digits=digits:shard={i + 1}/3"], CodeAllowance(())) for i in range(3)]
    fleet = [announce(d, shards[i]) for i, d in enumerate(_fleet()[:3])]
    base = {
        "model": "cnn-digits",
        "steps": 10,
        "batch_size": 48,
        "microbatches": 4,
        "data": {"name": "digits"},
    }
    averaged = {"every": EVERY, "outer_lr": 1.0, "outer_momentum": 0.0}
    exact = plan_over(JobSpec(**base), fleet)
    diloco = plan_over(JobSpec(**base, diloco=averaged), fleet)
    assert exact.plan == diloco.plan and diloco.plan.stages[0].devices == ("pi-0", "pi-1", "pi-2")
    assert "the holders average every 8 steps (DiLoCo, non-exact)" in diloco.found.method
    assert "non-exact" not in exact.found.method
    before, after = exact.found.prediction, diloco.found.prediction
    assert before is not None and after is not None
    # The whole sum once in EVERY steps (to the members' CPU that moves it, which the
    # exact step's links hide: [Note: a DiLoCo group's sum]).
    whole = predict(diloco.problem, diloco.plan, fixed_shares=holder_ends(diloco.plan, SHARES))
    assert after.allreduce_s[0] == pytest.approx(whole.allreduce_s[0] / EVERY, rel=0.01)
    assert after.step_time_s < before.step_time_s
