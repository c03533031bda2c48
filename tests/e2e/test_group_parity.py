"""Stages trained data-parallel by device groups train the same model as one device.

For every combination of equal shares, unequal ones and unequal ones whose split
into samples has a remainder, 1F1B and GPipe, and the
groups ``2,1``, ``1,2,1`` and ``1,2``, a short mlp job's per-step losses and final
parameters equal, within 1e-5, those of the plain PyTorch loop
(:mod:`support.reference`); over MQTT (a real Mosquitto that enforces the
plan's grants, :func:`edge.wire.topics.stage_access`, and four real agent
processes) and in-process. Every member reports every step with the samples
of its share, and members end with the same weights (the runners check that). Where
a group sums by the ring, each member's reduce-scatter went while its last backward
still ran ([Note: the sum overlapped with the backward] in
:mod:`edge.runtime.group_sum`): its report's ``allreduce_early_bytes`` is the whole
chunk it sent; where its vector is small, it went whole, once ([Note: a small sum goes
whole]); the groups ``2,1`` and ``1,2,1`` sum by the ring here, ``1,2`` whole.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from support.reference import ReferenceRun, assert_matches, train_reference

from coordinator.engine.assignments import make_assignments
from coordinator.engine.monitor import JobResult
from coordinator.engine.options import RunOptions
from coordinator.engine.runners import run_inprocess, run_on_agents
from coordinator.engine.spec import JobSpec, new_job_id
from coordinator.local.fleet import LocalFleet
from coordinator.local.owned import OwnedBroker
from coordinator.planner.score import Plan, Stage
from edge.errors import UserError
from edge.models.zoo import get_model
from edge.runtime.group_sum import sums_whole
from edge.runtime.schedules import SCHEDULES
from edge.runtime.stage import StageRuntime
from edge.transport.inprocess import InProcessTransport
from edge.transport.mqtt import MqttTransport
from edge.wire.frames import Codec, Kind, encode_frame, prefix_size
from edge.wire.groups import chunk_size
from edge.wire.messages import StageAssignment

STEPS, BATCH, MICROBATCHES = 3, 16, 2
N = BATCH // MICROBATCHES  # samples per microbatch
SHARES = {"equal": None, "unequal": (0.75, 0.25), "rounded": (0.6, 0.4)}
"""The group's shares; 0.75/0.25 of 8 samples is 6 and 2, and 0.6/0.4 (4.8 and 3.2) rounds
to 5 and 3: the largest remainder gets the sample left over."""
COUNTS = {"equal": (4, 4), "unequal": (6, 2), "rounded": (5, 3)}
"""Each member's samples of a microbatch, by :data:`SHARES`."""
SIZES = {"2,1": (2, 1), "1,2,1": (1, 2, 1), "1,2": (1, 2)}
"""Groups first, in the middle and last (where each member scales its loss by its share)."""
_REFERENCE: list[ReferenceRun] = []


def _spec(schedule: str) -> JobSpec:
    return JobSpec.model_validate(
        {
            "model": "mlp",
            "steps": STEPS,
            "batch_size": BATCH,
            "microbatches": MICROBATCHES,
            "schedule": schedule,
            "seed": 3,
        }
    )


def _reference() -> ReferenceRun:
    if not _REFERENCE:
        _REFERENCE.append(
            train_reference("mlp", steps=STEPS, batch_size=BATCH, seed=3, microbatches=2)
        )
    return _REFERENCE[0]


def _plan(devices: list[str], sizes: tuple[int, ...]) -> Plan:
    """The mlp's three units, one a stage (two on the first stage of two)."""
    cuts = [0, 2, 3] if len(sizes) == 2 else [0, 1, 2, 3]
    stages, at = [], 0
    for s, size in enumerate(sizes):
        stages.append(Stage.group(devices[at : at + size], cuts[s], cuts[s + 1]))
        at += size
    return Plan(tuple(stages))


def _shares(sizes: tuple[int, ...], shares: tuple[float, ...] | None) -> list[list[float]] | None:
    if shares is None:
        return None
    return [list(shares) if size == 2 else [1.0] for size in sizes]


def _sum_sent(plan: Plan, s: int) -> tuple[int, int]:
    """Bytes each member of group stage ``s`` sends in a step's sum of its gradients (and
    loss), and how many of them while its last backward still ran: a ring's 2 chunks,
    one of them early; a small vector's one whole frame, after the backward ([Note: a
    small sum goes whole] in :mod:`edge.runtime.group_sum`)."""
    st = plan.stages[s]
    segment = get_model("mlp", seed=3).build_segment(st.start, st.end)
    numel = sum(p.numel() for p in segment.parameters()) + (s == len(plan.stages) - 1)
    if sums_whole(numel, 2):
        return prefix_size(1) + 4 * numel, 0
    chunk = prefix_size(1) + 4 * chunk_size(numel, 2)
    return 2 * chunk, chunk


def _check(result: JobResult, plan: Plan, counts: tuple[int, int]) -> None:
    group = [s for s, st in enumerate(plan.stages) if len(st.devices) == 2]
    assert len(group) == 1 and len(result.plan.stages[group[0]].devices) == 2
    assert_matches(result.losses, result.weights, _reference())
    # Every member of every stage reported every step, with the samples of its share.
    seen = {(r.stage, r.member, r.step): r for r in result.reports}
    assert set(seen) == {
        (s, m, t)
        for s, st in enumerate(plan.stages)
        for m in range(len(st.devices))
        for t in range(STEPS)
    }
    for (s, m, _), report in seen.items():
        share = counts[m] if s == group[0] else N
        assert report.samples == share * MICROBATCHES
        assert report.device == plan.stages[s].devices[m]
        if s == group[0]:  # the group summed its gradients: a ring's g = 2 chunks sent
            # (one its sum), the reduce-scatter's while the last backward still ran (its
            # gradients final, hook by hook); or a small vector once, whole, after it.
            sent, early = _sum_sent(plan, s)
            assert (report.allreduce_bytes, report.allreduce_early_bytes) == (sent, early)
        else:
            assert report.allreduce_bytes == report.allreduce_early_bytes == 0


@pytest.mark.parametrize("shares", list(SHARES))
@pytest.mark.parametrize("sizes", list(SIZES))
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_groups_in_process_equal_one_device(schedule: str, sizes: str, shares: str) -> None:
    plan = _plan(["a", "b", "c", "d"], SIZES[sizes])
    result = run_inprocess(
        _spec(schedule), plan, shares=_shares(SIZES[sizes], SHARES[shares]), timeout_s=120
    )
    _check(result, plan, COUNTS[shares])


def test_a_group_refuses_batchnorm() -> None:
    spec = JobSpec(
        model="cnn-digits",
        model_options={"norm": "batch"},
        steps=1,
        batch_size=8,
        microbatches=2,
        seed=3,
    )
    plan = Plan((Stage.group(["a", "b"], 0, 2), Stage("c", 2, 4)))
    with pytest.raises(UserError, match=r"stage 0: a group of 2 devices cannot train BatchNorm"):
        run_inprocess(spec, plan, timeout_s=60)
    # A device refuses it too, whoever sent the assignment.
    member = StageAssignment.for_stage(
        spec,
        job="j1",
        stage=0,
        num_stages=2,
        start=0,
        end=2,
        dataset="digits",
        dataset_options={},
        member=1,
        group_samples=((2, 2), (4,)),
    )
    transport = InProcessTransport()
    with pytest.raises(
        ValueError, match=r"a group of 2 devices cannot train BatchNorm \(conv1.1\)"
    ):
        StageRuntime(member, transport)
    transport.close()


@pytest.fixture(scope="module")
def fleet(secure_broker: OwnedBroker, secure_control: MqttTransport) -> Iterator[LocalFleet]:
    with LocalFleet(4, secure_broker, threads=1) as local:
        local.wait_online(secure_control, timeout=90)
        yield local


@pytest.mark.parametrize("shares", list(SHARES))
@pytest.mark.parametrize("sizes", list(SIZES))
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_groups_over_mqtt_equal_one_device(
    fleet: LocalFleet,
    secure_control: MqttTransport,
    secure_broker: OwnedBroker,
    schedule: str,
    sizes: str,
    shares: str,
) -> None:
    plan = _plan(list(fleet.ids), SIZES[sizes])
    result = run_on_agents(
        _spec(schedule),
        plan,
        secure_control,
        shares=_shares(SIZES[sizes], SHARES[shares]),
        options=RunOptions(access=secure_broker.accounts, timeout_s=120),
    )
    assert result.rejected == {}
    _check(result, plan, COUNTS[shares])


@contextlib.contextmanager
def _secure_group(broker: OwnedBroker, members: int) -> Iterator[tuple[str, list[MqttTransport]]]:
    """A job on ``broker`` whose stage 1 is a group of ``members`` behind a one-device
    stage 0, every device enrolled and granted its rights, each on its own connected
    transport: the job's id and the transports of stage 0 then of each member."""
    accounts = broker.accounts
    assert accounts is not None
    job = new_job_id()
    devices = [f"{job}-{name}" for name in "abcdefgh"[: members + 1]]
    plan = Plan((Stage(devices[0], 0, 1), Stage.group(devices[1:], 1, 3)))
    creds = [accounts.enroll(d) for d in devices]
    assignments = make_assignments(job, _spec("1f1b"), plan)
    accounts.grant(job, list(zip(devices, assignments, strict=True)))
    transports = [MqttTransport(c.settings()) for c in creds]
    try:
        for t in transports:
            t.connect(timeout=10)
        yield job, transports
    finally:
        for t in transports:
            t.close()
        accounts.release(job)


def test_only_a_groups_members_may_send_on_its_reduce_topics(
    secure_broker: OwnedBroker,
) -> None:
    """The broker grants a group's reduce topics to its members only: a frame that stage 0's
    device sends on member 1's reduce topic to member 0, claiming to be member 1, never
    arrives (its key would make member 1's real frame a duplicate); member 1's own does."""
    with _secure_group(secure_broker, 2) as (job, (first, m0, m1)):
        inbox = m0.attach(job, 1, 0, members=2)
        forged = encode_frame(Kind.REDUCE, job, 0, 1, torch.full((3,), 7.0), Codec.RAW)
        first.send(job, 1, "reduce", forged, 0, sender=1)
        assert first.flush(10)  # the broker has judged it before the real one
        real = encode_frame(Kind.REDUCE, job, 0, 1, torch.ones(3), Codec.RAW)
        m1.send(job, 1, "reduce", real, 0, sender=1)
        got = inbox.take(Kind.REDUCE, 0, 1, timeout=10)
        assert torch.equal(got.tensor, torch.ones(3))
        assert inbox.frames_received == 1 and not inbox.dropped


def test_a_member_cannot_pass_its_chunk_off_as_another_members(
    secure_broker: OwnedBroker,
) -> None:
    """In a group of three, member 2 forges member 1's chunk for member 0: on member 1's
    topic the broker refuses it, and on its own topic member 0 drops it, as its claim is
    not its topic's (``wrong-sender``). Member 1's real chunk is the one summed."""
    with _secure_group(secure_broker, 3) as (job, (_first, m0, m1, m2)):
        inbox = m0.attach(job, 1, 0, members=3)
        forged = encode_frame(Kind.REDUCE, job, 0, 1, torch.full((3,), 7.0), Codec.RAW)
        m2.send(job, 1, "reduce", forged, 0, sender=1)  # not its topic: refused
        m2.send(job, 1, "reduce", forged, 0, sender=2)  # its own: arrives
        assert m2.flush(10)  # the broker has passed both on before the real one
        real = encode_frame(Kind.REDUCE, job, 0, 1, torch.ones(3), Codec.RAW)
        m1.send(job, 1, "reduce", real, 0, sender=1)
        got = inbox.take(Kind.REDUCE, 0, 1, timeout=10)
        assert torch.equal(got.tensor, torch.ones(3))
        assert inbox.frames_received == 1 and inbox.dropped == {"wrong-sender": 1}


def test_only_its_member_may_publish_a_gather_topic_and_the_others_read_it(
    secure_broker: OwnedBroker,
) -> None:
    """In a group of three, member 2 and stage 0's device publish on member 1's gather topic:
    the broker refuses both. Member 1's one publish reaches members 0 and 2, and only it."""
    with _secure_group(secure_broker, 3) as (job, (first, m0, m1, m2)):
        inboxes = [m.attach(job, 1, i, members=3) for i, m in ((0, m0), (2, m2))]
        forged = encode_frame(Kind.GATHER, job, 0, 1, torch.full((3,), 7.0), Codec.RAW)
        for liar in (m2, first):
            liar.send(job, 1, "gather", forged, sender=1)  # not its topic: refused
            assert liar.flush(10)  # judged before the real one
        real = encode_frame(Kind.GATHER, job, 0, 1, torch.ones(3), Codec.RAW)
        m1.send(job, 1, "gather", real, sender=1)
        for inbox in inboxes:
            assert torch.equal(inbox.take(Kind.GATHER, 0, 1, timeout=10).tensor, torch.ones(3))
            assert inbox.frames_received == 1 and not inbox.dropped
