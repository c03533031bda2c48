"""A group runs the shares its plan gives it, in process, on a fleet of unequal devices.

cnn-digits at twice its width on two Raspberry Pi 4s and a Pi 5 (about three
times faster): the planner puts the first units on a group of one Pi 4 and the
Pi 5, split by their speeds, and the rest on the other Pi 4. Each member must
run its planned rows of every microbatch (:mod:`support.shares`); an equal split
would train just as exactly (the reference is checked too, but cannot tell them apart).
"""

from __future__ import annotations

from support.reference import assert_matches, train_reference
from support.shares import assert_ran_planned_shares

from coordinator.engine.spec import JobSpec
from coordinator.local.train import train_inprocess

PROFILES = ["rpi4", "rpi4", "rpi5"]
WIDE = {"width": 32}
"""cnn-digits at twice its width: its compute outweighs its links on Pis, so groups pay."""


def test_each_member_runs_its_planned_share_of_every_microbatch() -> None:
    spec = JobSpec(
        model="cnn-digits",
        model_options=WIDE,
        steps=2,
        batch_size=16,
        microbatches=2,
        seed=1,
    )
    run = train_inprocess(spec, len(PROFILES), profiles=PROFILES)

    assert [len(st.devices) for st in run.result.plan.stages] == [2, 1]
    assert_ran_planned_shares(run.result, run.score.shares, spec.batch_size, spec.microbatches)
    reference = train_reference(
        "cnn-digits", steps=2, batch_size=16, seed=1, model_options=WIDE, microbatches=2
    )
    assert_matches(run.result.losses, run.result.weights, reference)
