"""A finished job's totals over every stage member's reports: its traffic and its compiling.

Made-up reports of a 2-step job on a plan whose first stage is a group of two: the
traffic adds what every member sent and received (a group's members report the same
stage and step, so keying by stage alone would lose one), over the samples trained;
the compile seconds are the slowest member's own total.
"""

from __future__ import annotations

from coordinator.engine.monitor import JobResult
from coordinator.engine.spec import JobSpec
from coordinator.planner.score import Plan, Stage
from edge.wire.messages import StepReport


def _result() -> JobResult:
    spec = JobSpec(model="mlp", steps=2, batch_size=8, microbatches=2)
    plan = Plan((Stage.group(["a", "b"], 0, 1), Stage("c", 1, 3)))
    members = [(0, 0, "a"), (0, 1, "b"), (1, 0, "c")]
    reports = [
        StepReport(
            job="j1",
            stage=stage,
            member=member,
            device=device,
            step=step,
            bytes_sent=100 * (stage + 1) + member,
            bytes_received=10 * (stage + 1),
            compile_s=(3.0 if member else 1.0) if step == 0 else 0.0,
        )
        for step in range(2)
        for stage, member, device in members
    ]
    return JobResult("j1", plan, spec, [1.0, 0.5], reports, wall_s=4.0)


def test_traffic_adds_every_member_sent_and_received_over_the_samples() -> None:
    traffic = _result().traffic()
    sent = 2 * (100 + 101 + 200)
    received = 2 * (10 + 10 + 20)
    assert traffic == {
        "bytes_sent": sent,
        "bytes_received": received,
        "samples": 16,
        "bytes_per_sample": (sent + received) / 16,
    }


def test_compile_seconds_are_the_slowest_members_and_per_stage_the_sum() -> None:
    result = _result()
    assert result.compile_s == 3.0  # member 1 of stage 0, not the members' sum
    assert [s["compile_s"] for s in result.stage_summary()] == [4.0, 1.0]
