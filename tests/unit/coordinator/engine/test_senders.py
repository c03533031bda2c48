"""A sender is who the broker says: events and replicas from the wrong device are ignored.

The job monitor counts an event only when it came on the events topic of the device
that holds its stage in the plan, and names that device; the replica store takes a
stage's state only with exactly that stage's units. Everything else is counted by
reason (what ``JobResult.rejected`` reports), never folded into the job.
"""

from __future__ import annotations

import pytest
import torch

from coordinator.engine.monitor import JobFailed, JobMonitor
from coordinator.engine.replicas import ReplicaStore
from edge.runtime.checkpoint import StageState, encode_state
from edge.wire.messages import StageDone, StageReady, StepReport
from edge.wire.topics import job_replica

DEVICES = ["pi-a", "pi-b", "pi-c"]
UNITS = ["u0", "u1", "u2"]


def test_an_event_counts_only_from_the_device_that_holds_its_stage() -> None:
    m = JobMonitor("j1", 3, devices=DEVICES)
    m.on_event(StageDone(job="j1", stage=1, device="pi-b", steps=5), sender="pi-a")
    m.on_event(StageDone(job="j1", stage=1, device="pi-a", steps=5), sender="pi-a")
    m.on_event(StageReady(job="j1", stage=7, device="pi-b"), sender="pi-b")
    m.on_event(StageReady(job="j2", stage=0, device="pi-a"), sender="pi-a")
    m.on_event(StepReport(job="j1", stage=2, device="pi-c", step=0, loss=9.0), sender=None)
    assert m.done == set() and m.ready == set() and m.losses == {}
    assert m.rejected == {"wrong-sender": 3, "no-such-stage": 1, "other-job": 1}
    m.on_event(StageDone(job="j1", stage=1, device="pi-b", steps=5), sender="pi-b")
    m.on_event(StepReport(job="j1", stage=2, device="pi-c", step=0, loss=2.5), sender="pi-c")
    assert m.done == {(1, 0)} and m.losses == {0: 2.5}
    assert sum(m.rejected.values()) == 5


def test_a_group_member_counts_only_from_its_own_device() -> None:
    """Stage 1 runs on the group (pi-b, pi-d): each member's events come from its device."""
    m = JobMonitor("j1", 3, devices=["pi-a", ("pi-b", "pi-d"), "pi-c"], group_sizes=[1, 2, 1])
    m.on_event(StageDone(job="j1", stage=1, member=1, device="pi-b", steps=5), sender="pi-b")
    m.on_event(StageDone(job="j1", stage=1, member=2, device="pi-d", steps=5), sender="pi-d")
    m.on_event(StageDone(job="j1", stage=0, member=1, device="pi-d", steps=5), sender="pi-d")
    assert m.done == set()
    assert m.rejected == {"wrong-sender": 1, "no-such-stage": 2}
    for stage, member, device in [(0, 0, "pi-a"), (1, 0, "pi-b"), (1, 1, "pi-d")]:
        m.on_event(StageDone(job="j1", stage=stage, member=member, device=device), sender=device)
    assert m.done == {(0, 0), (1, 0), (1, 1)} and not m.finished
    m.on_event(StageDone(job="j1", stage=2, device="pi-c"), sender="pi-c")
    assert m.finished


def test_group_members_must_end_with_the_same_weights() -> None:
    m = JobMonitor("j1", 1, group_sizes=[3])
    for member, digest in enumerate(["aa", "aa", "ab"]):
        m.on_event(StageDone(job="j1", stage=0, member=member, device="d", weights_sha256=digest))
    with pytest.raises(JobFailed, match="j1: member 2 of stage 0 ended with other weights"):
        m.check_same_weights()
    alike = JobMonitor("j1", 1, group_sizes=[2])
    for member in range(2):
        alike.on_event(StageDone(job="j1", stage=0, member=member, device="d", weights_sha256="c"))
    alike.check_same_weights()


def test_in_process_events_need_no_sender() -> None:
    m = JobMonitor("j1", 2)
    m.on_event(StageDone(job="j1", stage=1, device="local", steps=1))
    assert m.done == {(1, 0)} and not m.rejected


def _replica(step: int, start: int, end: int, job: str) -> bytes:
    weights = {f"{UNITS[u]}.w": torch.full((2,), float(u)) for u in range(start, end)}
    return encode_state(StageState(step, job, start, start, end, UNITS[start:end], weights))


def test_a_replica_must_hold_exactly_its_stages_units() -> None:
    store = ReplicaStore(UNITS)
    store.accept("j1", [(0, 2), (2, 3)])
    store._on_replica(job_replica("j1", 1), _replica(2, 0, 2, "j1"))  # stage 0's units
    store._on_replica(job_replica("j1", 5), _replica(2, 2, 3, "j1"))  # no stage 5
    store._on_replica(job_replica("j9", 1), _replica(2, 2, 3, "j9"))  # not an accepted job
    assert store.received == 0 and store.rejected == 2
    store._on_replica(job_replica("j1", 0), _replica(2, 0, 2, "j1"))
    store._on_replica(job_replica("j1", 1), _replica(2, 2, 3, "j1"))
    assert store.received == 2 and store.newest_complete(10) == 2
