"""Software link shaping: one emulated device link, a rate and a delay each way.

This module owns :class:`LinkShaper` (both directions of one device's link) and
:class:`ShapedDirection` (one direction). The emulation testbed uses it when it
cannot use ``tc tbf`` and network namespaces (no root): the MQTT transport
(:mod:`edge.transport.mqtt`) passes the stage frames it sends through
:attr:`LinkShaper.up` and the frames it routes to inboxes through
:attr:`LinkShaper.down`; control messages (status, heartbeats, commands) bypass
it and stay immediate.

[Note: the emulated link]
Each direction is a token bucket of ``mbps`` megabits per second followed by a
delay line of ``latency_ms``, like ``tc tbf`` before a netem delay. A frame
counts as through the bucket when its *last* byte is, as a packetised link
would pass it: the bucket holds at most ``burst_bytes`` (10 ms of rate, at
least one 1500-byte packet) and a larger frame drains it and waits for the rest
at the rate. A frame is released ``latency_ms`` after it is through, in the
order frames were put. So ``n`` bytes put at once on an idle link take
``latency + (n - burst) / rate``, and a 1 MB activation at 10 Mbit/s takes
about 0.8 s even after an idle spell. (A bucket as deep as a whole frame would
let an idle link pass any frame in no time, and understate exactly the
transfers the testbed is meant to slow down.)

The schedule is computed from the time each frame was put (a virtual clock),
not from when the worker thread got round to it, so scheduling jitter on a
loaded machine does not accumulate. Each direction has one worker thread,
started on the first frame, that sleeps on ``time.monotonic`` deadlines
(``Event.wait``, no polling) and then calls ``release`` with the frame. Putting
never blocks: a full queue raises :class:`ConnectionError` at once, as
:meth:`MqttTransport.send <edge.transport.mqtt.MqttTransport.send>` does when
paho's queue is full.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["BURST_S", "MIN_BURST_BYTES", "LinkShaper", "ShapedDirection"]

log = logging.getLogger(__name__)

T = TypeVar("T")
Out = TypeVar("Out")
In = TypeVar("In")

BURST_S = 0.010
"""Bucket depth in seconds of rate (see [Note: the emulated link])."""
MIN_BURST_BYTES = 1500
"""The bucket holds at least one Ethernet packet, as ``tc tbf`` requires."""
_ABORT_JOIN_S = 1.0  # how long close waits for a release in progress once it gives up


class ShapedDirection(Generic[T]):
    """One direction of an emulated link: a bounded queue, a token bucket, a delay.

    ``release(item)`` is called on this direction's worker thread, once per item,
    in the order items were :meth:`put`; an exception from it is logged and
    counted (``release_errors``), never fatal. ``mbps=None`` means no rate limit
    (only the delay). Counters: ``frames``/``bytes`` released, ``wait_s`` (time
    the worker slept waiting for the bucket or the delay), ``held_s`` (the sum
    over frames of put-to-release time), ``dropped`` (refused when full, or
    discarded by :meth:`close`), and :attr:`backlog`.
    """

    def __init__(
        self,
        name: str,
        release: Callable[[T], None],
        *,
        mbps: float | None = None,
        latency_ms: float = 0.0,
        max_queued: int = 256,
        burst_bytes: int | None = None,
    ) -> None:
        if mbps is not None and not (math.isfinite(mbps) and mbps > 0):
            raise ValueError(f"{name}: mbps must be a positive number (got {mbps})")
        if not (math.isfinite(latency_ms) and latency_ms >= 0):
            raise ValueError(f"{name}: latency_ms must be at least 0 (got {latency_ms})")
        if max_queued < 1:
            raise ValueError(f"{name}: max_queued must be at least 1 (got {max_queued})")
        self.name = name
        self.mbps = mbps
        self.latency_s = latency_ms / 1000
        self.max_queued = max_queued
        self._rate = None if mbps is None else mbps * 1e6 / 8  # bytes per second
        default = MIN_BURST_BYTES if self._rate is None else self._rate * BURST_S
        self.burst_bytes = int(max(MIN_BURST_BYTES, burst_bytes or default))
        self._release = release
        self._queue: deque[tuple[float, int, T]] = deque()
        self._cond = threading.Condition()
        self._abort = threading.Event()
        self._closing = False
        self._thread: threading.Thread | None = None
        # The virtual bucket; only the worker touches it.
        self._tokens = float(self.burst_bytes)
        self._clock = -math.inf  # when the bucket last had `_tokens`, and the link was free
        self.frames = self.bytes = self.dropped = self.release_errors = 0
        self.wait_s = self.held_s = 0.0
        self._accepted = self._discarded = 0

    # -- the caller's side ---------------------------------------------------------

    def put(self, item: T, nbytes: int) -> None:
        """Queue ``item`` (``nbytes`` long on the wire) for release; never blocks.

        Raises :class:`ConnectionError` when ``max_queued`` frames already wait and
        :class:`RuntimeError` once closed.
        """
        with self._cond:
            if self._closing:
                raise RuntimeError(f"link {self.name} is closed")
            if len(self._queue) >= self.max_queued:
                self.dropped += 1
                raise ConnectionError(
                    f"link {self.name}: {self.max_queued} frames already wait on the emulated "
                    f"link ({self.describe()}); not sent"
                )
            self._queue.append((time.monotonic(), nbytes, item))
            self._accepted += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"link-{self.name}", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    @property
    def backlog(self) -> int:
        """Frames put and not yet released (queued, or held by the worker)."""
        return self._accepted - self.frames - self.release_errors - self._discarded

    def describe(self) -> str:
        rate = "unlimited" if self.mbps is None else f"{self.mbps:g} Mbit/s"
        return f"{rate}, {self.latency_s * 1000:g} ms"

    def stats(self) -> dict[str, float]:
        return {
            "frames": self.frames,
            "bytes": self.bytes,
            "wait_s": self.wait_s,
            "held_s": self.held_s,
            "dropped": self.dropped,
            "backlog": self.backlog,
        }

    def close(self, timeout: float = 2.0) -> bool:
        """Refuse new frames, keep releasing queued ones (still shaped) for up to
        ``timeout`` s, then stop the worker; whether everything queued was released.

        What is left at the deadline is discarded and counted in ``dropped``. The
        worker is joined for at most ``timeout`` plus one second. Idempotent.
        """
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                self._abort.set()
                thread.join(_ABORT_JOIN_S)
        with self._cond:
            left = len(self._queue)
            self._queue.clear()
            self._discarded += left
            self.dropped += left
        if left:
            log.warning("link %s closed with %d frames not released", self.name, left)
        return not left and self.backlog == 0

    # -- the worker ----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                arrived, nbytes, item = self._queue[0]
            if not self._sleep_until(self._due(arrived, nbytes)):
                return  # closed and out of time: close() discards the queue
            with self._cond:
                self._queue.popleft()
            released = time.monotonic()
            try:
                self._release(item)
            except Exception:
                self.release_errors += 1
                log.exception("link %s: releasing a frame failed", self.name)
                continue
            self.held_s += released - arrived
            self.bytes += nbytes
            self.frames += 1

    def _due(self, arrived: float, nbytes: int) -> float:
        """When the frame put at ``arrived`` leaves the delay line (virtual clock)."""
        if self._rate is None:
            return arrived + self.latency_s
        start = max(arrived, self._clock)  # the link is busy until _clock
        refill = (start - self._clock) * self._rate  # infinite for the first frame
        self._tokens = min(float(self.burst_bytes), self._tokens + refill) - nbytes
        done = start
        if self._tokens < 0:  # the rest of the frame goes at the rate
            done = start - self._tokens / self._rate
            self._tokens = 0.0
        self._clock = done
        return done + self.latency_s

    def _sleep_until(self, deadline: float) -> bool:
        """Sleep until ``deadline`` (monotonic); False if close() gave up meanwhile."""
        start = time.monotonic()
        try:
            while (left := deadline - time.monotonic()) > 0:
                if self._abort.wait(left):
                    return False
            return not self._abort.is_set()
        finally:
            self.wait_s += time.monotonic() - start


class LinkShaper(Generic[Out, In]):
    """Both directions of one device's emulated link (see [Note: the emulated link]).

    ``send`` releases frames going up (device to network), ``deliver`` frames
    coming down (network to device); each direction has the same rate and
    latency, shaped separately, with its own worker thread and queue.
    """

    def __init__(
        self,
        mbps: float | None,
        latency_ms: float,
        *,
        send: Callable[[Out], None],
        deliver: Callable[[In], None],
        max_queued: int = 256,
        name: str = "link",
    ) -> None:
        self.up: ShapedDirection[Out] = ShapedDirection(
            f"{name}/up", send, mbps=mbps, latency_ms=latency_ms, max_queued=max_queued
        )
        self.down: ShapedDirection[In] = ShapedDirection(
            f"{name}/down", deliver, mbps=mbps, latency_ms=latency_ms, max_queued=max_queued
        )

    def describe(self) -> str:
        return self.up.describe()

    def stats(self) -> dict[str, float]:
        """``up.<counter>`` and ``down.<counter>`` (see :class:`ShapedDirection`)."""
        return {f"{d}.{k}": v for d in ("up", "down") for k, v in getattr(self, d).stats().items()}

    def close(self, timeout: float = 2.0) -> bool:
        """Close both directions, draining each within ``timeout``; whether both drained."""
        deadline = time.monotonic() + timeout
        up = self.up.close(timeout)
        return self.down.close(max(0.0, deadline - time.monotonic())) and up
