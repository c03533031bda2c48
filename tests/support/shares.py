"""Whether a job's group members ran the shares its plan gave them.

Training cannot tell: a group that split its microbatches equally sums the same
gradients and equals the reference; only its speed suffers. So the members'
reports are read instead. Member ``m`` of stage ``s`` must have run, every step,
``M`` times its rows of a microbatch, as the wire contract splits the plan's
shares (:func:`edge.wire.groups.split_samples`), and on the device the plan put
there. A plan whose shares split equally would prove nothing, and fails here.
"""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.engine.monitor import JobResult
from edge.wire.groups import split_samples

__all__ = ["assert_ran_planned_shares"]


def assert_ran_planned_shares(
    result: JobResult, shares: Sequence[Sequence[float]] | None, batch_size: int, microbatches: int
) -> None:
    plan = result.plan
    assert plan.grouped and shares is not None, "the plan has no group to split"
    rows = batch_size // microbatches
    counts = [split_samples(rows, ours) for ours in shares]
    assert any(len(set(c)) > 1 for c in counts), f"the plan splits equally: {counts}"
    want = {
        (s, m): (plan.stages[s].devices[m], n * microbatches)
        for s, per_member in enumerate(counts)
        for m, n in enumerate(per_member)
    }
    steps = {r.step for r in result.reports}
    assert {(r.stage, r.member, r.step) for r in result.reports} == {
        (*key, t) for key in want for t in steps
    }
    for r in result.reports:
        assert (r.device, r.samples) == want[(r.stage, r.member)], (
            f"stage {r.stage} member {r.member} ran {r.samples} samples of step {r.step}, "
            f"the plan's shares {list(shares[r.stage])} give {want[(r.stage, r.member)][1]}"
        )
