"""The inbox: the frames addressed to one stage of one job, waiting to be taken by key.

This module owns :class:`Inbox` (what a stage keeps of what arrives, and why it drops
the rest), :class:`Expected` (the shape and dtypes one kind of frame must have) and
:class:`InboxClosed`. Every transport (:mod:`edge.transport.base`) files the frames it
receives here with :meth:`Inbox.deliver`; a stage takes the frames it needs by
``(kind, step, microbatch)`` (and, in a group, the first row of the piece) in whatever
order its schedule asks for them; frames may arrive in any order.

[Note: QoS and ordering]
Activations and gradients travel at MQTT QoS 1: at least once, so a frame may
be delivered twice (a retransmission after a reconnect). The inbox keeps the
key of every frame it has accepted in the steps still open and ignores a
repeat; keys of steps the stage has finished are forgotten
(:meth:`Inbox.forget_before`). Nothing relies on delivery order between
topics: labels for the last stage and activations from the stage before it are
matched by key, not by arrival.

[Note: bounded inboxes]
Anyone who can publish on a stage's topics can send it frames, so an inbox
holds only what its stage can use, and decides that from the header before it
pays for the payload ([Note: bounded decoding] in :mod:`edge.wire.frames`):

- the step window: once the stage says which step it runs
  (:meth:`Inbox.expect`, then :meth:`Inbox.forget_before` after each step), a
  frame is kept only for that step or the next one. A synchronous pipeline never
  sends further ahead: a stage starts step ``k + 1`` only once every stage after
  it has sent back its gradients of step ``k``, so a stage that sends to another
  is at most one step ahead of it (stage 0 sends the last stage labels of step
  ``k + 1`` when that stage has finished the backward passes of step ``k``).
  A non-exact group ([Note: DiLoCo in a group] in :mod:`edge.runtime.outer_sync`)
  sums only once in ``H`` steps, and between its sums nothing holds its members
  together: a member that waits in the sum of step ``k`` may hear a faster one's
  chunks of the next sum, step ``k + H``. So the group's kinds are kept up to ``H``
  steps ahead (``group_every``), still for two sums at most;
- the plan: the kinds, microbatches, shapes and dtypes the stage's plan implies
  (:class:`Expected`, given by the stage). A frame that does not match is
  dropped *before* its key is recorded, so a forged frame of the wrong shape
  cannot make the real one a duplicate;
- totals: at most ``max_frames`` frames and ``max_bytes`` bytes held, and no
  frame over ``max_frame_bytes``. Once the plan is known these are exactly what
  two steps of it need, so a stage's own frames never hit them.

Before the stage says what it expects (a transport alone, or the moment between
attach and the stage's first call), any step and shape is kept, within the
default totals.

A group's gradient chunks (``REDUCE`` on the ``reduce`` channel, ``GATHER`` on
``gather``) name their sending member in the ``microbatch`` field; the transport
also says who sent one, from the topic it came on (which only that member may
publish on: :func:`edge.wire.topics.stage_access`),
and a chunk whose claim differs from its topic's is dropped (``wrong-sender``), so
one member cannot pass its chunk off as another's.

Every frame that cannot be used (malformed, for another job or stage,
duplicated, outside the window, not what the plan implies, over a bound) is
dropped with a warning and counted in :attr:`Inbox.dropped` by reason; nothing
a peer sends can crash a stage.

Tested in tests/unit/edge/transport/test_inbox.py (frames delivered straight to an inbox)
and, through every transport, tests/integration/test_transport_conformance.py.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from edge.transport.base import Channel
from edge.wire.frames import (
    MAX_FRAME_BYTES,
    Frame,
    FrameError,
    FrameHeader,
    Kind,
    decode_body,
    prefix_size,
    read_header,
)

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_FRAMES",
    "Expected",
    "Inbox",
    "InboxClosed",
]

log = logging.getLogger(__name__)

_EXPECTED = {
    "fwd": (Kind.ACTIVATION, Kind.LABELS),
    "bwd": (Kind.GRADIENT,),
    "reduce": (Kind.REDUCE,),
    "gather": (Kind.GATHER,),
}
_BY_MEMBER = (Kind.REDUCE, Kind.GATHER)  # their microbatch field names the sending member

DEFAULT_MAX_FRAMES = 4096
"""Frames an inbox holds at most until its stage says what it expects."""
DEFAULT_MAX_BYTES = 1 << 30
"""Bytes an inbox holds at most until its stage says what it expects (1 GiB)."""
_WINDOW = 2  # steps a stage accepts frames for: the one it runs and the next
_QUIET = ("duplicate", "late")  # what QoS 1 redelivery does on its own: logged at debug level
_Key = tuple[int, int, int, int]  # kind, step, microbatch, first row


@dataclass(frozen=True)
class Expected:
    """The shape and dtypes one kind of frame must have, per microbatch, to be kept."""

    shape: tuple[int, ...]
    dtypes: frozenset[torch.dtype]
    """Decoded dtypes allowed (two under bf16 autocast, whose outputs may be either)."""
    pieces: tuple[tuple[int, int], ...] = ()
    """The rows ``[lo, hi)`` each frame may hold, in a group ([Note: groups on the wire]
    in :mod:`edge.wire.groups`): ``shape`` is then the whole block's, a piece's first
    dimension its own rows. Empty: one frame of ``shape``, rows ``[0, shape[0])``."""

    @property
    def max_nbytes(self) -> int:
        """The most a matching frame takes: on the wire, and once decoded.

        On the wire an element is at most 4 bytes unless it travels raw, in its
        own dtype; decoded, it is one of :attr:`dtypes`.
        """
        widest = max([4, *(d.itemsize for d in self.dtypes)])
        return prefix_size(len(self.shape)) + math.prod(self.shape) * widest

    @property
    def frames(self) -> int:
        """Frames of this kind per microbatch: one, or one per piece."""
        return max(1, len(self.pieces))

    @property
    def total_nbytes(self) -> int:
        """The most all of one microbatch's frames of this kind take."""
        return self.max_nbytes + (self.frames - 1) * prefix_size(len(self.shape))

    def __str__(self) -> str:
        names = "|".join(sorted(str(d).removeprefix("torch.") for d in self.dtypes))
        return f"{names} {list(self.shape)}"

    def mismatch(
        self, shape: tuple[int, ...], dtype: torch.dtype, rows: tuple[int, int] | None = None
    ) -> str | None:
        """The drop reason for a tensor of ``shape`` and ``dtype`` holding ``rows`` (``None``:
        not checked), or ``None`` if it fits."""
        if self.pieces:
            if rows is not None and rows not in self.pieces:
                return "wrong-rows"
            first = (rows[1] - rows[0],) if rows is not None else tuple(shape[:1])
            want = (*first, *self.shape[1:])
        else:
            want = self.shape
        if tuple(shape) != want:
            return "wrong-shape"
        if not self.pieces and rows is not None and rows[0] != 0:
            return "wrong-rows"
        if dtype not in self.dtypes:
            return "wrong-dtype"
        return None


@dataclass(frozen=True)
class _Plan:
    """What a stage told its inbox to expect (:meth:`Inbox.expect`)."""

    kinds: Mapping[Kind, Expected | None]
    microbatches: int
    members: int
    group_every: int = 1


def _what(head: FrameHeader) -> str:
    """A dropped frame, for the log (built only when one is dropped)."""
    return f"{head.kind.name} of step {head.step} microbatch {head.microbatch}"


class InboxClosed(RuntimeError):
    """The inbox was closed (job cancelled or transport shut down) while waiting."""


class Inbox:
    """Frames addressed to one stage of one job, waiting to be taken by key.

    See [Note: bounded inboxes] for what it keeps; :attr:`dropped` counts the
    rest by reason.
    """

    def __init__(
        self,
        job: str,
        stage: int,
        member: int = 0,
        *,
        max_frames: int = DEFAULT_MAX_FRAMES,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_frame_bytes: int = MAX_FRAME_BYTES,
    ) -> None:
        if min(max_frames, max_bytes, max_frame_bytes) < 1:
            raise ValueError("an inbox's bounds must be positive")
        self.job = job
        self.stage = stage
        self.member = member
        self.max_frames = max_frames
        self.max_bytes = max_bytes
        self.max_frame_bytes = max_frame_bytes
        self._frames: dict[_Key, Frame] = {}
        self._sizes: dict[_Key, int] = {}
        self._held_bytes = 0
        self._seen: set[_Key] = set()
        self._cond = threading.Condition()
        self._closed = False
        self._floor = 0
        self._windowed = False  # until the stage says which step it runs: any step
        self._plan: _Plan | None = None
        self.dropped: Counter[str] = Counter()
        """Frames dropped, by reason (``bad-magic``, ``duplicate``, ``wrong-shape``...)."""
        self.frames_received = 0
        self.bytes_received = 0

    # -- what the stage expects ---------------------------------------------------

    def expect(
        self,
        kinds: Mapping[Kind, Expected | None],
        *,
        microbatches: int,
        step: int,
        members: int = 1,
        group_every: int = 1,
    ) -> None:
        """From now on keep only ``kinds`` (``None``: that kind, any shape), microbatches
        below ``microbatches`` (the group's gradient kinds: senders below ``members``),
        and steps ``step`` and ``step + 1``; the group's kinds up to ``step +
        group_every``, a group that sums once in that many steps (see [Note: bounded
        inboxes]).

        The totals become what two steps of that take, and frames already held
        that do not fit are dropped and counted.
        """
        if microbatches < 1 or members < 1 or group_every < 1:
            raise ValueError(
                f"microbatches, members and group_every must be at least 1, got "
                f"{microbatches}, {members} and {group_every}"
            )
        largest = [MAX_FRAME_BYTES if spec is None else spec.max_nbytes for spec in kinds.values()]
        frames = nbytes = 0
        for kind, spec in kinds.items():
            times = members if kind in _BY_MEMBER else microbatches
            frames += times * (1 if spec is None else spec.frames)
            nbytes += times * (MAX_FRAME_BYTES if spec is None else spec.total_nbytes)
        with self._cond:
            self._plan = _Plan(dict(kinds), microbatches, members, group_every)
            self.max_frames = max(1, _WINDOW * frames)
            self.max_bytes = max(1, _WINDOW * nbytes)
            self.max_frame_bytes = max(largest, default=1)
            self._floor, self._windowed = step, True
            self._prune_locked(refit=True)

    def forget_before(self, step: int) -> None:
        """The stage runs ``step`` now: forget earlier steps' keys and frames, refuse their
        late repeats, and keep frames of ``step`` and ``step + 1`` only (a non-exact
        group's kinds further: :meth:`expect`)."""
        with self._cond:
            self._floor, self._windowed = max(self._floor, step), True
            self._prune_locked()

    def _prune_locked(self, refit: bool = False) -> None:
        self._seen = {
            k for k in self._seen if self._floor <= k[1] < self._floor + self._reach(k[0])
        }
        for key, frame in list(self._frames.items()):
            if key[1] < self._floor:  # a finished step's: nobody will take it
                self._remove_locked(key)
                continue
            why = self._refusal(frame.kind, frame.step, frame.microbatch)
            if why is None and refit:
                shape, dtype = tuple(frame.tensor.shape), frame.tensor.dtype
                why = self._mismatch(frame.kind, shape, dtype, frame.samples)
            if why is None and refit and self._frames_over(0, 0):
                why = "inbox-full"
            if why is not None:
                self._remove_locked(key)
                self._seen.discard(key)
                self._count_locked(why, f"held {Kind(key[0]).name} of step {key[1]}")

    def _frames_over(self, frames: int, nbytes: int) -> bool:
        return (
            len(self._frames) + frames > self.max_frames
            or self._held_bytes + nbytes > self.max_bytes
        )

    def _refusal(self, kind: Kind, step: int, microbatch: int) -> str | None:
        """Why a frame of this key is not wanted now (window, kind, microbatch), if it is not."""
        if step < self._floor:
            return "late"
        if self._windowed and step >= self._floor + self._reach(kind):
            return "ahead"
        plan = self._plan
        if plan is not None:
            if kind not in plan.kinds:
                return "wrong-kind"
            if microbatch >= (plan.members if kind in _BY_MEMBER else plan.microbatches):
                return "wrong-microbatch"
        return None

    def _reach(self, kind: int) -> int:
        """How many steps from the one it runs a stage keeps frames of ``kind`` for."""
        plan = self._plan
        if plan is not None and kind in _BY_MEMBER:
            return max(_WINDOW, plan.group_every + 1)
        return _WINDOW

    def _mismatch(
        self, kind: Kind, shape: tuple[int, ...], dtype: torch.dtype, rows: tuple[int, int]
    ) -> str | None:
        plan = self._plan
        spec = None if plan is None else plan.kinds.get(kind)
        return None if spec is None else spec.mismatch(shape, dtype, rows)

    # -- receiving ----------------------------------------------------------------

    def deliver(
        self, data: bytes | bytearray | memoryview, channel: Channel, sender: int | None = None
    ) -> bool:
        """Check and file one frame; returns whether it was kept.

        ``sender``: on ``reduce`` and ``gather``, the member whose topic the frame came
        on; a chunk
        must name that member (``None``, or another member: dropped as ``wrong-sender``).
        The header is checked first (job, kind, sender, window, plan, duplicate),
        then the checksum, then the totals; only a frame that passes all of them has
        its key recorded (see [Note: bounded inboxes]).
        """
        try:
            head = read_header(data, self.max_frame_bytes)
        except FrameError as exc:
            return self._drop(exc.reason, str(exc))
        if head.job != self.job:
            return self._drop("wrong-job", f"frame for job {head.job!r}")
        if head.kind not in _EXPECTED[channel]:
            return self._drop("wrong-kind", f"{head.kind.name} on {channel}")
        if head.kind in _BY_MEMBER and head.microbatch != sender:
            return self._drop(
                "wrong-sender", f"{_what(head)} claims member {head.microbatch}, came from {sender}"
            )
        # Unlocked reads of the window, plan and keys: cheap refusals before the
        # checksum. All of it is checked again under the lock before the frame is kept.
        why = self._unwanted(head)
        if why is not None:
            got = f"{str(head.dtype).removeprefix('torch.')} {list(head.shape)}"
            plan = self._plan
            want = plan.kinds.get(head.kind) if plan is not None else None
            return self._drop(why, f"{_what(head)}: {got}" + (f", expected {want}" if want else ""))
        try:
            frame = decode_body(head, data)
        except FrameError as exc:
            return self._drop(exc.reason, f"{_what(head)}: {exc}")
        size = max(head.nbytes, frame.tensor.nbytes)
        with self._cond:
            why = self._unwanted(head)
            if why is None and self._frames_over(1, size):
                why = "inbox-full"
            if why is None:
                self._seen.add(head.key)
                self._frames[head.key] = frame
                self._sizes[head.key] = size
                self._held_bytes += size
                self.frames_received += 1
                self.bytes_received += frame.nbytes
                self._cond.notify_all()
                return True
        return self._drop(why, _what(head))

    def _unwanted(self, head: FrameHeader) -> str | None:
        """Why the frame of ``head`` is not wanted (window, plan, a repeat), if it is not.

        The plan comes before the repeat: a frame the plan refuses never counts
        as the one of its key, whatever arrives after it.
        """
        return (
            self._refusal(head.kind, head.step, head.microbatch)
            or self._mismatch(head.kind, head.shape, head.dtype, head.samples)
            or ("duplicate" if head.key in self._seen else None)
        )

    def _drop(self, reason: str, detail: str) -> bool:
        with self._cond:
            self._count_locked(reason, detail)
        return False

    def _count_locked(self, reason: str, detail: str) -> None:
        self.dropped[reason] += 1
        n = self.dropped[reason]
        # A repeat is what QoS 1 does (see [Note: QoS and ordering]): not worth a warning.
        # Nor is every frame of a flood: the first ten of a reason, then the 16th, 32nd...
        loud = reason not in _QUIET and (n <= 10 or n & (n - 1) == 0)
        (log.warning if loud else log.debug)(
            "dropped frame for job %s stage %d (%s, %d so far): %s",
            self.job,
            self.stage,
            reason,
            n,
            detail,
            extra={"job": self.job, "stage": self.stage, "reason": reason},
        )

    def _remove_locked(self, key: _Key) -> Frame:
        self._held_bytes -= self._sizes.pop(key)
        return self._frames.pop(key)

    # -- taking -------------------------------------------------------------------

    def take(
        self,
        kind: Kind,
        step: int,
        microbatch: int,
        timeout: float | None = None,
        *,
        first: int = 0,
    ) -> Frame:
        """Wait for the frame ``(kind, step, microbatch)`` holding rows from ``first`` on
        and remove it from the inbox."""
        key = (int(kind), step, microbatch, first)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while key not in self._frames:
                if self._closed:
                    raise InboxClosed(f"inbox of job {self.job} stage {self.stage} closed")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"job {self.job} stage {self.stage}: no {kind.name.lower()} for "
                        f"step {step} microbatch {microbatch} within {timeout} s"
                    )
                self._cond.wait(remaining)
            return self._remove_locked(key)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closed

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._frames)

    @property
    def held_bytes(self) -> int:
        """Bytes of the frames held (each the larger of its wire and decoded size)."""
        with self._cond:
            return self._held_bytes

    def stats(self) -> dict[str, int]:
        """Counters: frames and bytes received, held now, and drops as ``dropped.<reason>``."""
        with self._cond:
            out = {
                "frames_received": self.frames_received,
                "bytes_received": self.bytes_received,
                "pending": len(self._frames),
                "held_bytes": self._held_bytes,
            }
            return out | {f"dropped.{k}": v for k, v in self.dropped.items()}
