"""The one interface every tensor transport implements, and the inbox behind it.

A transport moves encoded frames (:mod:`edge.wire.frames`) to a stage of a job.
A stage :meth:`Transport.attach`\\ es to get its :class:`Inbox`, then takes the
frames it needs by ``(kind, step, microbatch)`` in whatever order its schedule
asks for them; frames may arrive in any order.

[Note: QoS and ordering]
Activations and gradients travel at MQTT QoS 1: at least once, so a frame may
be delivered twice (a retransmission after a reconnect). The inbox keeps the
key of every frame it has accepted in the steps still open and ignores a
repeat; keys of steps the stage has finished are forgotten
(:meth:`Inbox.forget_before`). Nothing relies on delivery order between
topics: labels for the last stage and activations from the stage before it are
matched by key, not by arrival.

Every frame that cannot be used (malformed, for another job or stage,
duplicated) is dropped with a warning and counted in :attr:`Inbox.dropped`;
nothing a peer sends can crash a stage.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Literal, Protocol, runtime_checkable

from edge.wire.frames import Frame, FrameError, Kind, decode_frame

__all__ = ["Channel", "Inbox", "InboxClosed", "Transport"]

Channel = Literal["fwd", "bwd"]
log = logging.getLogger(__name__)

_EXPECTED = {"fwd": (Kind.ACTIVATION, Kind.LABELS), "bwd": (Kind.GRADIENT,)}


class InboxClosed(RuntimeError):
    """The inbox was closed (job cancelled or transport shut down) while waiting."""


class Inbox:
    """Frames addressed to one stage of one job, waiting to be taken by key."""

    def __init__(self, job: str, stage: int) -> None:
        self.job = job
        self.stage = stage
        self._frames: dict[tuple[int, int, int], Frame] = {}
        self._seen: set[tuple[int, int, int]] = set()
        self._cond = threading.Condition()
        self._closed = False
        self._floor = 0
        self.dropped: Counter[str] = Counter()
        """Frames dropped, by reason (``bad-magic``, ``duplicate``, ``wrong-job``...)."""
        self.frames_received = 0
        self.bytes_received = 0

    def deliver(self, data: bytes | bytearray | memoryview, channel: Channel) -> bool:
        """Decode and file one frame; returns whether it was kept."""
        try:
            frame = decode_frame(data)
        except FrameError as exc:
            return self._drop(exc.reason, str(exc))
        if frame.job != self.job:
            return self._drop("wrong-job", f"frame for job {frame.job!r}")
        if frame.kind not in _EXPECTED[channel]:
            return self._drop("wrong-kind", f"{frame.kind.name} on {channel}")
        with self._cond:
            if frame.step < self._floor or frame.key in self._seen:
                self.dropped["duplicate"] += 1
                return False
            self._seen.add(frame.key)
            self._frames[frame.key] = frame
            self.frames_received += 1
            self.bytes_received += frame.nbytes
            self._cond.notify_all()
        return True

    def _drop(self, reason: str, detail: str) -> bool:
        self.dropped[reason] += 1
        log.warning(
            "dropped frame for job %s stage %d: %s",
            self.job,
            self.stage,
            detail,
            extra={"job": self.job, "stage": self.stage, "reason": reason},
        )
        return False

    def take(self, kind: Kind, step: int, microbatch: int, timeout: float | None = None) -> Frame:
        """Wait for the frame ``(kind, step, microbatch)`` and remove it from the inbox."""
        key = (int(kind), step, microbatch)
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
            return self._frames.pop(key)

    def forget_before(self, step: int) -> None:
        """Steps before ``step`` are done: drop their keys, refuse their late repeats."""
        with self._cond:
            self._floor = max(self._floor, step)
            self._seen = {k for k in self._seen if k[1] >= step}
            for key in [k for k in self._frames if k[1] < step]:
                del self._frames[key]

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


@runtime_checkable
class Transport(Protocol):
    """Moves frames between the stages of jobs. Implementations: in-process, MQTT."""

    name: str

    def attach(self, job: str, stage: int) -> Inbox:
        """Start receiving frames for ``stage`` of ``job``; returns its inbox."""
        ...

    def detach(self, job: str, stage: int) -> None:
        """Stop receiving for ``stage`` of ``job`` and close its inbox."""
        ...

    def send(self, job: str, stage: int, channel: Channel, frame: bytes) -> None:
        """Deliver an encoded frame to ``stage`` of ``job`` on ``channel``."""
        ...

    def close(self) -> None:
        """Release everything; inboxes are closed."""
        ...
