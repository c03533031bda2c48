"""A stage group's once-a-step sum of its gradients (and loss), through its transport.

The members of a group ([Note: groups on the wire] in :mod:`edge.wire.groups`)
each hold the gradients of their own share of the step's samples. Before the
optimizer steps, :class:`GroupSum` flattens them (in parameter order, then the
member's share of the loss on the last stage), zero-pads the vector to ``g``
equal chunks and runs a reduce-scatter on the ``reduce`` channel then an
all-gather on the ``gather`` channel: member ``i`` sends chunk ``k`` to member
``k``; member ``k`` adds the ``g`` contributions in member order and publishes
the sum once, on its own ``gather`` topic, which every other member reads (the
broker fans it out). Every member then holds the very same bits, the whole
batch's gradients, and steps the same optimizer.

[Note: the all-gather is one publish]
On the testbed's slow devices the sum is CPU-bound on the members, and the
send path (the client library, TLS, the socket) costs the most per byte. A
member sends ``g - 1`` chunks in the reduce-scatter and publishes its summed
chunk once, ``g`` chunks a step (``P`` bytes of a ``P``-byte vector) instead
of the ``2 (g - 1)`` of sending the sum to each member alone; it still receives
``2 (g - 1)`` chunks. The broker pays the fan-out, and each receiver's link
carries what it did before, so the ring model's link term stands
(:mod:`coordinator.planner.predict` prices the CPU of both sides).

[Note: pieces of a chunk]
A broker forwards a message only once it has all of it, so a chunk sent as one
frame crosses the sender's link and then the receiver's, one after the other:
twice the time of one link. So a chunk travels as frames of at most
:data:`PIECE_BYTES`, each carrying its element range ``[lo, hi)`` of the chunk
as its rows; the receiver's link carries one piece while the sender's carries
the next, and a chunk of ``k`` pieces takes about ``1 + 1/k`` times one link's
time (``bench/group_reduce.py`` measures it against the planner's ring model).
Member ``i`` sends to members ``i + 1, i + 2, ...`` (mod ``g``) in that order, so
that at any moment each member's link receives from one other, not all from one.
Each piece also costs both ends a fixed part of CPU (the frame, the publish, the
inbox), which a slow device pays at its share of a core: through a broker here a
sum's bytes cost 3.8-4.0 ns each in pieces of 256 KiB and 2.0-2.8 in pieces of
1 MiB. So a chunk goes in about :data:`PIECES_PER_CHUNK` pieces, each at least
:data:`MIN_PIECE_BYTES` and at most :data:`PIECE_BYTES` (:func:`piece_elements`):
a chunk of 1 MiB keeps four pieces of 256 KiB and its links overlapped, one of vgg11's
9 MB chunks over four members goes in nine of 1 MiB at 0.5-0.7 of the CPU a byte.

[Note: a small sum goes whole]
Every frame costs both ends a fixed part of CPU, however little it holds, and a ring
member handles ``3 g - 2`` chunks a step: eight Pi 4 holders summing cnn-digits'
first convolution (2.3 kB) pay 22 frames each for it, which their share of a core
feels far more than the bytes. A vector of at most :data:`WHOLE_SUM_BYTES` is
summed whole instead: each member publishes its whole vector once on its ``gather``
topic and takes the ``g - 1`` others', ``g`` frames, and adds the ``g`` vectors in
member order, as a chunk's owner does, so every member holds the same bits as the
ring would give. It receives ``g - 1`` vectors instead of ``2 (g - 1) / g`` of one:
at 64 KiB and eight members, 448 KiB, which costs a free core about what the 14
frames it saves do. Nothing goes early: the vector leaves when the backward is done.
:func:`sum_load` says what each way costs a member, for the planner.

[Note: the sum overlapped with the backward]
A piece of the reduce-scatter can go as soon as the gradients it holds are final, and
in the step's last backward the last units' gradients are final first: the chunks of
the vector's tail go while the first units still compute, as DDP's buckets do. So the
stage arms its sum (:meth:`GroupSum.arm`) just before its last backward: each
parameter's post-accumulate-grad hook marks it final, and a piece all of whose
parameters (and, on the last stage, the loss, known by then) are final is sent at
once. After the backward :meth:`GroupSum.sum` sends what is left (the pieces of
parameters that got no gradient, counted as zeros) and sums as before, in member
order, so the bits are the same as without the overlap. ``early_bytes`` says how much
of the reduce-scatter went while the backward still ran, and ``early_s`` and
``early_cpu_s`` what sending it took inside the backward (wall and this thread's CPU
seconds): part of the sum, not of the compute, so the stage leaves them out of the
backward's compute and out of what its throttle stretches ([Note: a block's own
seconds] in :mod:`edge.runtime.stage`).

This is the MQTT-side counterpart of :class:`edge.server.data_parallel.DataParallel`
(which averages copies of a stage over torch.distributed), and runs at the same
place: its sum ends after the step's last backward.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from torch.utils.hooks import RemovableHandle

from edge.transport.base import Channel, Transport
from edge.transport.inbox import Expected, Inbox
from edge.wire.frames import Codec, Kind, encode_frame
from edge.wire.groups import chunk_size, sum_traffic
from edge.wire.messages import StageAssignment

__all__ = [
    "MIN_PIECE_BYTES",
    "PIECES_PER_CHUNK",
    "PIECE_BYTES",
    "WHOLE_SUM_BYTES",
    "GroupSum",
    "piece_elements",
    "sum_load",
    "sums_whole",
]

PIECE_BYTES = 1 << 20
"""The largest frame a chunk travels in (see [Note: pieces of a chunk])."""
MIN_PIECE_BYTES = 256 << 10
"""The smallest piece of a chunk larger than it."""
PIECES_PER_CHUNK = 8
"""Pieces a chunk is cut into between those sizes."""


def piece_elements(chunk: int) -> int:
    """The float32 elements of each piece of a chunk of ``chunk`` elements (the last
    may be shorter): see [Note: pieces of a chunk]."""
    wanted = math.ceil(chunk / PIECES_PER_CHUNK)
    return max(MIN_PIECE_BYTES // 4, min(PIECE_BYTES // 4, wanted))


WHOLE_SUM_BYTES = 64 << 10
"""A flat vector at most this large is summed whole ([Note: a small sum goes whole])."""


def sums_whole(numel: int, members: int) -> bool:
    """Whether a group of ``members`` sums a ``numel``-element vector whole: every member
    derives it from the vector's size alone, so all agree ([Note: a small sum goes
    whole])."""
    return members > 1 and numel * 4 <= WHOLE_SUM_BYTES


def sum_load(numel: int, members: int) -> tuple[int, float, float]:
    """What one member of a group of ``members`` handles in a step's sum of a
    ``numel``-element vector: the frames it sends and takes, and the fractions of the
    vector's bytes it sends and receives; nothing for a group of one.

    Ring (:func:`edge.wire.groups.sum_traffic`): the ``g - 1`` chunks it sends, its
    summed chunk's publish and the ``2 (g - 1)`` chunks it takes, each in
    :func:`piece_elements` pieces; the whole vector out, ``2 (g - 1) / g`` of it in.
    Whole ([Note: a small sum goes whole]): one publish of the vector and the ``g - 1``
    others' taken; the vector out once, ``g - 1`` times in. Each frame costs both ends
    a fixed part of CPU ([Note: pieces of a chunk]): what binds where the vector is
    small and the members many ([Note: a small sum over many members is its frames] in
    :mod:`coordinator.planner.predict`)."""
    if members <= 1:
        return 0, 0.0, 0.0
    if sums_whole(numel, members):
        return members, 1.0, float(members - 1)
    chunk = chunk_size(numel, members)
    pieces = math.ceil(chunk / piece_elements(chunk))
    sent, received = sum_traffic(members)
    return (members + 2 * (members - 1)) * pieces, sent, received


class GroupSum:
    """Sums ``params``' gradients (and the loss) over the group of stage ``a``."""

    def __init__(
        self,
        a: StageAssignment,
        transport: Transport,
        params: list[torch.nn.Parameter],
    ) -> None:
        self.a = a
        self.transport = transport
        self.params = params
        self.members = a.group_size
        numel = sum(p.numel() for p in params) + int(a.is_last)
        self.whole = sums_whole(numel, self.members)
        """Whether the vector goes whole ([Note: a small sum goes whole])."""
        self.chunk = numel if self.whole else chunk_size(numel, self.members)
        """Elements of each member's chunk of the flat vector (summed whole: all of it)."""
        step = piece_elements(self.chunk)
        self.pieces = [(lo, min(lo + step, self.chunk)) for lo in range(0, self.chunk, step)]
        """The element ranges of a chunk that travel as one frame each."""
        self.bytes_sent = 0
        """Bytes sent by the last :meth:`sum`."""
        self.started = 0.0
        """When the last :meth:`sum` started (Unix seconds): with the other members' own,
        what this member waited for the last of them (:func:`edge.wire.groups.sum_waits`)."""
        self.cpu_s = 0.0
        """CPU seconds of this whole process (the client's network thread included) during
        the last :meth:`sum`."""
        self.early_bytes = 0
        """Bytes of the last step's reduce-scatter sent while its last backward still ran
        ([Note: the sum overlapped with the backward])."""
        self.early_s = 0.0
        """Wall seconds the last step's early sends took (inside its last backward)."""
        self.early_cpu_s = 0.0
        """CPU seconds of the thread that sent them (the compute thread) in those sends."""
        self._spans = _param_spans(params)
        self._loss_at = self._spans[-1][1] if self._spans else 0  # the loss's element
        self._armed: _Armed | None = None

    @property
    def expected(self) -> dict[Kind, Expected]:
        """What the group's members send this one: a chunk per member and kind."""
        chunk = Expected((self.chunk,), frozenset({torch.float32}), tuple(self.pieces))
        if self.whole:  # every member's whole vector, on its gather topic
            return {Kind.GATHER: chunk}
        return {Kind.REDUCE: chunk, Kind.GATHER: chunk}

    def arm(self, step: int, loss: float | None) -> None:
        """Before ``step``'s last backward: send each reduce-scatter piece as soon as its
        gradients are final (``loss``: the member's loss on the last stage, else
        ``None``). See [Note: the sum overlapped with the backward]."""
        self.disarm()
        self.bytes_sent = self.early_bytes = 0
        self.early_s = self.early_cpu_s = 0.0
        if self.whole:  # it goes once every gradient is final: after the backward
            return
        armed = _Armed(step, loss, self._pieces_to_send(loss))
        self._armed = armed
        for i, p in enumerate(self.params):
            armed.handles.append(p.register_post_accumulate_grad_hook(self._final(i)))
        self._send_ready(armed)

    def disarm(self) -> None:
        """Stop sending on gradients' hooks (the backward ended, or the step failed)."""
        if self._armed is not None:
            for handle in self._armed.handles:
                handle.remove()
            self._armed = None

    def sum(self, inbox: Inbox, step: int, loss: float | None) -> float | None:
        """Replace every gradient by the group's sum; the group's loss (``None`` off the
        last stage). A parameter without a gradient counts as zeros, so every member
        sums the same vector."""
        armed = self._armed if self._armed is not None and self._armed.step == step else None
        self.disarm()
        if armed is None:
            self.bytes_sent = self.early_bytes = 0
            self.early_s = self.early_cpu_s = 0.0
        self.started, cpu0 = time.time(), time.process_time()
        try:
            return self._sum(inbox, step, loss, armed.sent if armed is not None else set())
        finally:
            self.cpu_s = time.process_time() - cpu0

    def _final(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            armed = self._armed
            if armed is not None and index not in armed.final:
                armed.final.add(index)
                self._send_ready(armed)

        return hook

    def _pieces_to_send(self, loss: float | None) -> dict[tuple[int, int], set[int]]:
        """Each piece this member sends in the reduce-scatter, ``(owner, lo)``, and the
        parameters it waits for (the loss's element is ready when ``loss`` is known)."""
        g, me, c = self.members, self.a.member, self.chunk
        out: dict[tuple[int, int], set[int]] = {}
        for k in ((me + j) % g for j in range(1, g)):
            for lo, hi in self.pieces:
                start, end = k * c + lo, k * c + hi
                needs = {i for i, (a, b) in enumerate(self._spans) if a < end and start < b}
                if loss is None and self.a.is_last and start <= self._loss_at < end:
                    needs.add(-1)  # never final: the piece waits for the sum
                out[(k, lo)] = needs
        return out

    def _send_ready(self, armed: _Armed) -> None:
        """Send every piece whose parameters are all final, in the staggered order (their
        wall and CPU seconds to ``early_s`` and ``early_cpu_s``)."""
        t0, cpu0 = time.perf_counter(), time.thread_time()
        try:
            self._send_final(armed)
        finally:
            self.early_s += time.perf_counter() - t0
            self.early_cpu_s += time.thread_time() - cpu0

    def _send_final(self, armed: _Armed) -> None:
        for key, needs in armed.waiting.items():
            if key in armed.sent or not needs <= armed.final:
                continue
            owner, lo = key
            hi = next(h for start, h in self.pieces if start == lo)
            piece = self._elements(owner * self.chunk + lo, owner * self.chunk + hi, armed.loss)
            before = self.bytes_sent
            self._send_piece(Kind.REDUCE, armed.step, piece, lo, owner)
            self.early_bytes += self.bytes_sent - before
            armed.sent.add(key)

    def _elements(self, start: int, end: int, loss: float | None) -> torch.Tensor:
        """Elements ``[start, end)`` of this member's flat vector, from the gradients as
        they are (the same values :meth:`_sum` flattens)."""
        out = torch.zeros(end - start, dtype=torch.float32)
        for p, (a, b) in zip(self.params, self._spans, strict=True):
            if a < end and start < b and p.grad is not None:
                lo, hi = max(a, start), min(b, end)
                flat = p.grad.detach().reshape(-1)[lo - a : hi - a]
                out[lo - start : hi - start] = flat.float().cpu()
        if loss is not None and start <= self._loss_at < end:
            out[self._loss_at - start] = loss
        return out

    def _sum(
        self, inbox: Inbox, step: int, loss: float | None, sent: set[tuple[int, int]]
    ) -> float | None:
        if self.whole:
            return self._sum_whole(inbox, step, loss)
        a, g, me, c = self.a, self.members, self.a.member, self.chunk
        grads, vector = self._flat(loss, c * g)
        others = [(me + j) % g for j in range(1, g)]  # staggered: see [Note: pieces of a chunk]
        for k in others:  # reduce-scatter: chunk k to its owner, what the backward left
            for lo, hi in self.pieces:
                if (k, lo) not in sent:
                    self._send_piece(Kind.REDUCE, step, vector[k * c + lo : k * c + hi], lo, k)
        timeout = a.recv_timeout_s
        mine = torch.zeros(c, dtype=torch.float32)
        for i in range(g):  # in member order, on every owner: the same bits everywhere
            if i == me:
                mine += vector[me * c : (me + 1) * c]
                continue
            for lo, hi in self.pieces:
                mine[lo:hi] += inbox.take(Kind.REDUCE, step, i, timeout, first=lo).tensor
        self._send(Kind.GATHER, step, mine)  # all-gather: once, for everyone else
        vector[me * c : (me + 1) * c] = mine
        for i in range(g):
            if i != me:
                for lo, hi in self.pieces:
                    got = inbox.take(Kind.GATHER, step, i, timeout, first=lo).tensor
                    vector[i * c + lo : i * c + hi] = got
        return self._set_grads(grads, vector, loss)

    def _flat(self, loss: float | None, size: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The gradients (zeros for a parameter without one) and the flat vector of them
        and the loss, zero-padded to ``size`` elements."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        parts = [t.detach().reshape(-1).float().cpu() for t in grads]
        if loss is not None:
            parts.append(torch.tensor([loss], dtype=torch.float32))
        vector = torch.zeros(size, dtype=torch.float32)
        torch.cat(parts, out=vector[: sum(t.numel() for t in parts)])
        return grads, vector

    def _sum_whole(self, inbox: Inbox, step: int, loss: float | None) -> float | None:
        """[Note: a small sum goes whole]: publish the vector once, take the others', and
        add all ``g`` in member order, as a chunk's owner does: the same bits."""
        a, me = self.a, self.a.member
        grads, vector = self._flat(loss, self.chunk)
        self._send(Kind.GATHER, step, vector)
        total = torch.zeros(self.chunk, dtype=torch.float32)
        for i in range(self.members):
            if i == me:
                total += vector
            else:
                total += inbox.take(Kind.GATHER, step, i, a.recv_timeout_s, first=0).tensor
        return self._set_grads(grads, total, loss)

    def _set_grads(
        self, grads: list[torch.Tensor], vector: torch.Tensor, loss: float | None
    ) -> float | None:
        """Every parameter's gradient from the summed ``vector``; the summed loss."""
        at = 0
        for p, t in zip(self.params, grads, strict=True):
            summed = vector[at : at + t.numel()].view_as(t).to(t.dtype)
            if p.grad is None:
                p.grad = summed.to(p.device, copy=True)
            else:
                p.grad.copy_(summed)
            at += t.numel()
        return float(vector[at].item()) if loss is not None else None

    def _send(self, kind: Kind, step: int, chunk: torch.Tensor, member: int = 0) -> None:
        """One chunk, piece by piece, on this member's own topic: a ``REDUCE`` chunk to
        ``member`` of the stage, a ``GATHER`` chunk to every other member at once; each
        frame's microbatch names the sender too, its rows the piece's elements."""
        for lo, hi in self.pieces:
            self._send_piece(kind, step, chunk[lo:hi], lo, member)

    def _send_piece(
        self, kind: Kind, step: int, piece: torch.Tensor, lo: int, member: int = 0
    ) -> None:
        """One piece of a chunk, its elements from ``lo`` of the chunk (see :meth:`_send`)."""
        a = self.a
        channel: Channel = "reduce" if kind == Kind.REDUCE else "gather"
        frame = encode_frame(kind, a.job, step, a.member, piece, Codec.RAW, first=lo)
        self.transport.send(a.job, a.stage, channel, frame, member, sender=a.member)
        self.bytes_sent += len(frame)


class _Armed:
    """A step's reduce-scatter while its last backward runs: what each piece waits for,
    the parameters final so far, the pieces sent, and the hooks to remove."""

    def __init__(
        self, step: int, loss: float | None, waiting: dict[tuple[int, int], set[int]]
    ) -> None:
        self.step, self.loss, self.waiting = step, loss, waiting
        self.final: set[int] = set()
        self.sent: set[tuple[int, int]] = set()
        self.handles: list[RemovableHandle] = []


def _param_spans(params: list[torch.nn.Parameter]) -> list[tuple[int, int]]:
    """Each parameter's elements ``[start, end)`` in the flat vector, in order."""
    spans, at = [], 0
    for p in params:
        spans.append((at, at + p.numel()))
        at += p.numel()
    return spans
