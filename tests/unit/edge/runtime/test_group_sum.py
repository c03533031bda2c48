"""A group's gradient sum: the same bits on every member, chunks in pieces, exact bytes,
and, armed before the last backward, pieces sent as their gradients become final."""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from coordinator.engine.spec import JobSpec
from edge.runtime.group_sum import (
    MIN_PIECE_BYTES,
    PIECE_BYTES,
    PIECES_PER_CHUNK,
    WHOLE_SUM_BYTES,
    GroupSum,
    piece_elements,
    sum_load,
    sums_whole,
)
from edge.transport.inbox import Inbox
from edge.transport.inprocess import InProcessTransport
from edge.wire.frames import Kind, prefix_size, read_header
from edge.wire.groups import split_samples, sum_waits
from edge.wire.messages import StageAssignment

SPEC = JobSpec(model="mlp", steps=4, batch_size=6, microbatches=1, seed=0)


def _member(g: int, m: int, last: bool) -> StageAssignment:
    split = tuple(split_samples(6, [1.0] * g))
    return StageAssignment.for_stage(
        SPEC,
        job="j1",
        stage=1 if last else 0,
        num_stages=2,
        start=0 if not last else 1,
        end=1 if not last else 2,
        dataset="digits",
        dataset_options={},
        member=m,
        group_samples=((6,), split) if last else (split, (6,)),
        recv_timeout_s=10.0,
    )


def _sum_over(
    g: int, numel: int, last: bool, late: float = 0.0
) -> list[tuple[GroupSum, torch.Tensor, float | None]]:
    """Run one sum of ``g`` members on their own threads, the last member starting ``late``
    seconds after the others; each member's result."""
    transport = InProcessTransport()
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(numel)) for _ in range(g)]
    for p in params:
        p.grad = torch.randn(numel, generator=gen)
    out: list[tuple[GroupSum, torch.Tensor, float | None]] = []
    members: list[tuple[GroupSum, Inbox]] = []
    for m in range(g):
        a = _member(g, m, last)
        summer = GroupSum(a, transport, [params[m]])
        inbox = transport.attach(a.job, a.stage, m, members=a.group_size)
        inbox.expect(summer.expected, microbatches=1, step=0, members=g)
        members.append((summer, inbox))
    losses: list[float | None] = [None] * g

    def run(m: int) -> None:
        losses[m] = members[m][0].sum(members[m][1], 0, float(m + 1) if last else None)

    threads = [threading.Thread(target=run, args=(m,)) for m in range(g)]
    for m, t in enumerate(threads):
        if m == g - 1 and late:
            time.sleep(late)
        t.start()
    for t in threads:
        t.join(timeout=30)
    transport.close()
    for m in range(g):
        grad = params[m].grad
        assert grad is not None
        out.append((members[m][0], grad, losses[m]))
    return out


def test_every_member_ends_with_the_same_bits_of_the_sum() -> None:
    numel = 3 * PIECE_BYTES // 4 + 5  # chunks of two pieces each for 2 members
    gen = torch.Generator().manual_seed(0)
    want = sum(torch.randn(numel, generator=gen) for _ in range(3))
    got = _sum_over(3, numel, last=True)
    assert all(torch.equal(grad, got[0][1]) for _, grad, _ in got)
    torch.testing.assert_close(got[0][1], want, rtol=1e-6, atol=1e-6)
    assert [loss for _, _, loss in got] == [6.0, 6.0, 6.0]  # 1 + 2 + 3: the group's loss


def test_a_chunk_goes_in_about_eight_pieces_of_256_kib_to_1_mib() -> None:
    """[Note: pieces of a chunk]."""
    small, large = MIN_PIECE_BYTES // 4, PIECE_BYTES // 4
    assert PIECES_PER_CHUNK == 8 and (small, large) == (1 << 16, 1 << 18)
    assert piece_elements(1) == small  # one short piece
    assert piece_elements(4 * small) == small  # four of the smallest
    assert piece_elements(8 * small + 8) == small + 1  # eight, each just over the smallest
    assert piece_elements(2 * PIECES_PER_CHUNK * large) == large  # sixteen of the largest


def test_a_chunk_travels_in_pieces_and_each_member_sends_g_chunks() -> None:
    """``g - 1`` chunks to their owners and the member's own sum once, whatever ``g``."""
    small, large = MIN_PIECE_BYTES // 4, PIECE_BYTES // 4
    for g in (2, 3):
        for chunk, pieces in ((small // 2, 1), (4 * small, 4), (9 * large + 3, 10)):
            got = _sum_over(g, g * chunk, last=False)
            for summer, _, _ in got:
                assert len(summer.pieces) == pieces
                assert summer.pieces[0][0] == 0 and summer.pieces[-1][1] == summer.chunk
                frames = g * pieces * prefix_size(1)
                assert summer.bytes_sent == frames + g * 4 * summer.chunk


def test_each_member_says_when_its_sum_started_and_the_cpu_it_cost() -> None:
    """The last of three members starts 0.2 s late: the others' sums waited at least that
    long for it (:func:`sum_waits` over their start times), and it waited for none."""
    got = _sum_over(3, 3 * PIECE_BYTES // 4, last=False, late=0.2)
    started = [summer.started for summer, _, _ in got]
    waits = sum_waits(started)
    assert waits[2] == 0.0 and min(waits[:2]) >= 0.2
    assert all(summer.cpu_s > 0 for summer, _, _ in got)


@dataclass
class _Seen:
    """What one member saw of its step: when its backward ended, the bytes of its sum
    sent before that and in all, and each reduce-scatter piece it sent (when, and from
    which element of its chunk)."""

    backward_end: float = 0.0
    early: int = 0
    sent_bytes: int = 0
    pieces: list[tuple[float, int]] = field(default_factory=list)


def _backward_and_sum(armed: bool) -> tuple[list[list[torch.Tensor]], list[_Seen]]:
    """Two members of a stage of four 256-wide layers (chunks of three pieces each) each
    run a backward on their own rows, then sum; ``armed``: each arms its sum just before
    the backward. Each member's summed gradients, and what it saw."""
    transport = InProcessTransport()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(4)))
    x = torch.randn(6, 256)
    sent: list[tuple[float, int, int]] = []  # (time, sending member, first element)
    send = transport.send

    def recording(job: str, stage: int, channel: Any, frame: bytes, *args: Any, **kw: Any) -> None:
        if channel == "reduce":
            sent.append((time.perf_counter(), int(kw["sender"]), read_header(frame).samples[0]))
        send(job, stage, channel, frame, *args, **kw)

    transport.send = recording  # type: ignore[method-assign]
    copies = [copy.deepcopy(model) for _ in range(2)]
    seen = [_Seen(), _Seen()]
    grads: list[list[torch.Tensor]] = [[], []]

    def run(m: int) -> None:
        a = _member(2, m, last=False)
        params = list(copies[m].parameters())
        summer = GroupSum(a, transport, params)
        inbox = transport.attach(a.job, a.stage, m, members=2)
        inbox.expect(summer.expected, microbatches=1, step=0, members=2)
        loss = copies[m](x[3 * m : 3 * m + 3]).square().sum()
        if armed:
            summer.arm(0, None)
        loss.backward()
        seen[m].backward_end = time.perf_counter()
        seen[m].early = summer.early_bytes
        summer.sum(inbox, 0, None)
        seen[m].sent_bytes = summer.bytes_sent
        grads[m] = [p.grad.clone() for p in params if p.grad is not None]

    threads = [threading.Thread(target=run, args=(m,)) for m in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    transport.close()
    for m in range(2):
        seen[m].pieces = [(when, lo) for when, who, lo in sent if who == m]
    return grads, seen


def test_an_armed_sum_sends_each_piece_as_its_gradients_become_final() -> None:
    """[Note: the sum overlapped with the backward]: armed, every reduce-scatter piece goes
    before the backward returns, member 0's (the vector's tail: the last layers, final
    first) from its last piece to its first; the sum is the same bits as unarmed."""
    plain, _ = _backward_and_sum(armed=False)
    overlapped, seen = _backward_and_sum(armed=True)
    for a, b in zip(plain, overlapped, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    for member in seen:
        assert len(member.pieces) == 3
        assert all(when < member.backward_end for when, _ in member.pieces)
        assert member.early == member.sent_bytes - member.early  # the gather's half after
    tail = [lo for _, lo in seen[0].pieces]
    assert tail == sorted(tail, reverse=True), tail


def test_an_unarmed_sum_sends_nothing_early() -> None:
    _, seen = _backward_and_sum(armed=False)
    assert [member.early for member in seen] == [0, 0]


def test_a_small_vector_is_summed_whole_in_member_order() -> None:
    """[Note: a small sum goes whole]: each member publishes its vector once (one frame,
    the gather channel alone) and adds all ``g`` in member order: the same bits on
    every member as a chunk's owner gives, and what its load says for the planner."""
    numel = 500  # with the loss: 501 elements, 2 kB
    assert sums_whole(numel + 1, 3) and not sums_whole(WHOLE_SUM_BYTES // 4 + 1, 3)
    gen = torch.Generator().manual_seed(0)
    vectors = [torch.randn(numel, generator=gen) for _ in range(3)]
    want = torch.zeros(numel)
    for v in vectors:
        want += v
    got = _sum_over(3, numel, last=True)
    for summer, grad, loss in got:
        assert summer.whole and set(summer.expected) == {Kind.GATHER}
        assert torch.equal(grad, want) and loss == 6.0
        assert summer.bytes_sent == prefix_size(1) + 4 * (numel + 1)  # one frame, once
    assert sum_load(numel + 1, 3) == (3, 1.0, 2.0)
