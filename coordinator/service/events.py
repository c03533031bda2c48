"""Live updates inside the coordinator: a small publish/subscribe bus.

Producers (the device registry on the MQTT thread, job workers) call
:meth:`EventBus.publish` from any thread; consumers (the ``/events``
Server-Sent-Events stream, one per browser) each get a bounded queue. A slow
consumer loses its oldest events rather than slowing producers down: live
views are refreshed from the REST API anyway, events only say what changed.

:meth:`EventBus.close` ends every subscription, and any made after it: a stopping
server closes the bus first, so that every open stream ends before the server waits
for its connections (see [Note: event streams end on shutdown] in
:mod:`coordinator.service.serve`).
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

__all__ = ["Event", "EventBus", "Subscription"]


@dataclass(frozen=True)
class Event:
    id: int
    kind: str
    """``device``, ``job``, ``step`` or ``job-event``."""
    data: dict[str, Any]
    ts: float

    def sse(self) -> str:
        """The event as one Server-Sent-Events message."""
        return f"id: {self.id}\nevent: {self.kind}\ndata: {json.dumps(self.data)}\n\n"


class Subscription:
    """One consumer's queue of events."""

    def __init__(self, bus: EventBus, size: int) -> None:
        self._bus = bus
        self._events: deque[Event] = deque(maxlen=size)
        self._cond = threading.Condition()
        self.closed = False

    def _put(self, event: Event) -> None:
        with self._cond:
            self._events.append(event)
            self._cond.notify_all()

    def get(self, timeout: float) -> list[Event]:
        """Events published since the last call; waits up to ``timeout`` for the first."""
        with self._cond:
            if not self._events and not self.closed:
                self._cond.wait(timeout)
            out = list(self._events)
            self._events.clear()
            return out

    def close(self) -> None:
        self._bus._unsubscribe(self)
        with self._cond:
            self.closed = True
            self._cond.notify_all()


class EventBus:
    """Thread-safe fan-out of :class:`Event` to every :class:`Subscription`."""

    def __init__(self, queue_size: int = 1000) -> None:
        self._subs: set[Subscription] = set()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.queue_size = queue_size
        self.closed = False

    def publish(self, kind: str, data: dict[str, Any]) -> Event:
        with self._lock:
            event = Event(id=next(self._ids), kind=kind, data=data, ts=time.time())
            subs = list(self._subs)
        for sub in subs:
            sub._put(event)
        return event

    def subscribe(self) -> Subscription:
        """A new consumer's subscription; already closed when the bus is."""
        sub = Subscription(self, self.queue_size)
        with self._lock:
            if not self.closed:
                self._subs.add(sub)
                return sub
        sub.closed = True
        return sub

    def _unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            self._subs.discard(sub)

    def close(self) -> None:
        """Close every subscription, and every one made later; idempotent."""
        with self._lock:
            self.closed = True
            subs = list(self._subs)
        for sub in subs:
            sub.close()
