"""What crossed the wire: a client that keeps every message under the product's topics,
and the tensor frames of one job among them (tests/e2e/test_demo_wire.py,
tests/e2e/test_demo_links.py)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from edge.transport.mqtt import MqttTransport
from edge.transport.settings import MqttSettings
from edge.wire.frames import MAGIC, Frame, decode_frame
from edge.wire.topics import TOPIC_ROOT

Seen = list[tuple[str, bytes]]


@contextlib.contextmanager
def wire_spy(login: MqttSettings) -> Iterator[Callable[[], Seen]]:
    """Subscribe with ``login`` (an account that may read every topic) for the block;
    it gets a function that returns every ``(topic, payload)`` kept so far."""
    lock, seen = threading.Lock(), []

    def keep(topic: str, payload: bytes) -> None:
        with lock:
            seen.append((topic, bytes(payload)))

    def kept() -> Seen:
        with lock:
            return list(seen)

    spy = MqttTransport(login)
    spy.connect(timeout=30)
    try:
        spy.subscribe(f"{TOPIC_ROOT}/#", keep)
        yield kept
    finally:
        spy.close()


def job_frames(seen: Seen, job: str) -> list[Frame]:
    """The tensor frames of ``job`` among ``seen``, decoded."""
    return [decode_frame(p) for t, p in seen if f"/jobs/{job}/" in t and p[:4] == MAGIC]
