"""Frames between stages that run as threads of one process: tests and local runs.

This module owns :class:`InProcessTransport`, one object shared by every stage
in the process. :meth:`~InProcessTransport.send` hands the encoded bytes to the
destination's :meth:`Inbox.deliver <edge.transport.inbox.Inbox.deliver>` in the
sender's thread, so every frame is decoded and checked exactly as one that came
over the wire, and codecs behave as they do between devices.

Stages may attach in any order. A frame for a stage nobody has attached yet is
not an error: it is kept (at most ``buffer_frames`` per ``(job, stage, member)``, the
oldest dropped with a warning) and delivered when that stage attaches. A frame on
a group's ``gather`` channel goes to every member of the stage but its sender, as
many as the sender said its group has when it attached. This is
stronger than MQTT gives (see :mod:`edge.transport.mqtt`); the runtime must not
rely on it, it only makes local runs forgiving.

Tested in tests/integration/test_transport_conformance.py::TestInProcessTransport.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque

from edge.transport.base import Channel
from edge.transport.inbox import Inbox

__all__ = ["DEFAULT_BUFFER_FRAMES", "InProcessTransport"]

DEFAULT_BUFFER_FRAMES = 1024
"""Frames kept per ``(job, stage)`` that nobody has attached yet."""

log = logging.getLogger(__name__)

_Key = tuple[str, int, int]
_Kept = tuple[bytes, Channel, int | None]  # (frame, channel, sender)


class InProcessTransport:
    """Delivers frames between stages in one process; thread-safe."""

    name = "inprocess"

    def __init__(self, *, buffer_frames: int = DEFAULT_BUFFER_FRAMES) -> None:
        if buffer_frames < 1:
            raise ValueError(f"buffer_frames must be at least 1, got {buffer_frames}")
        self.buffer_frames = buffer_frames
        self._lock = threading.Lock()
        self._inboxes: dict[_Key, Inbox] = {}
        self._waiting: dict[_Key, deque[_Kept]] = {}
        self._members: dict[tuple[str, int], int] = {}  # group size, as attach was told
        self._closed = False
        self.frames_sent = 0
        self.bytes_sent = 0
        self.dropped: Counter[str] = Counter()
        """Frames this transport dropped before any inbox saw them (``buffer-full``)."""

    def attach(self, job: str, stage: int, member: int = 0, *, members: int = 1) -> Inbox:
        """The inbox of ``member`` of ``stage`` of ``job`` (every channel; ``members``
        says whom a ``gather`` frame goes to); frames sent to it earlier are delivered now."""
        key = (job, stage, member)
        with self._lock:
            self._check_open()
            if key in self._inboxes:
                raise ValueError(f"job {job} stage {stage} member {member} is already attached")
            self._members[(job, stage)] = members
            inbox = self._inboxes[key] = Inbox(job, stage, member)
            early = self._waiting.pop(key, deque())
        # Outside the lock: decoding a large frame must not hold up other stages.
        # Frames sent meanwhile go straight to the inbox; order does not matter.
        for data, channel, sender in early:
            inbox.deliver(data, channel, sender)
        return inbox

    def detach(self, job: str, stage: int, member: int = 0) -> None:
        """Stop delivering to ``member`` of ``stage`` of ``job`` and close its inbox (a no-op
        if not attached)."""
        with self._lock:
            inbox = self._inboxes.pop((job, stage, member), None)
        if inbox is not None:
            inbox.close()

    def send(
        self,
        job: str,
        stage: int,
        channel: Channel,
        frame: bytes,
        member: int = 0,
        *,
        sender: int | None = None,
    ) -> None:
        """Deliver ``frame`` to ``member`` of ``stage`` of ``job`` now, or keep it until that
        member attaches; ``sender`` is the sending member on ``reduce`` (as its topic would
        say over MQTT). On ``gather``: to every member of the stage but ``sender``."""
        # An immutable copy: the inbox decodes without copying (see [Note: zero-copy
        # decoding] in edge.wire.frames), so the sender must not be able to change it later.
        data = frame if isinstance(frame, bytes) else bytes(frame)
        now: list[Inbox] = []
        with self._lock:
            self._check_open()
            self.frames_sent += 1
            self.bytes_sent += len(data)
            if channel == "gather":
                members = self._members.get((job, stage), 1)
                to = [m for m in range(members) if m != sender]
            else:
                to = [member]
            for m in to:
                inbox = self._inboxes.get((job, stage, m))
                if inbox is None:
                    self._keep((job, stage, m), (data, channel, sender))
                else:
                    now.append(inbox)
        for inbox in now:
            inbox.deliver(data, channel, sender)

    def _keep(self, key: _Key, item: _Kept) -> None:
        waiting = self._waiting.setdefault(key, deque())
        if len(waiting) >= self.buffer_frames:
            waiting.popleft()
            self.dropped["buffer-full"] += 1
            log.warning(
                "job %s stage %d is not attached and already has %d frames waiting: "
                "dropped the oldest",
                key[0],
                key[1],
                self.buffer_frames,
                extra={"job": key[0], "stage": key[1], "reason": "buffer-full"},
            )
        waiting.append(item)

    def waiting(self, job: str, stage: int, member: int = 0) -> int:
        """Frames kept for ``member`` of ``stage`` of ``job`` until it attaches."""
        with self._lock:
            return len(self._waiting.get((job, stage, member), ()))

    def stats(self) -> dict[str, int]:
        """Counters: frames and bytes sent, and drops by reason (``dropped.<reason>``)."""
        with self._lock:
            out = {"frames_sent": self.frames_sent, "bytes_sent": self.bytes_sent}
            out.update({f"dropped.{k}": v for k, v in self.dropped.items()})
            return out

    def close(self) -> None:
        """Close every inbox and forget kept frames; later sends and attaches raise."""
        with self._lock:
            self._closed = True
            inboxes = list(self._inboxes.values())
            self._inboxes.clear()
            self._waiting.clear()
        for inbox in inboxes:
            inbox.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the in-process transport is closed")
