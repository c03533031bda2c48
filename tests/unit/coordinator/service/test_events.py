"""The event bus's close: what a stopping server relies on to end its event streams (see
[Note: event streams end on shutdown] in coordinator.service.serve)."""

from __future__ import annotations

import threading
import time

from coordinator.service.events import EventBus


def test_close_wakes_a_waiting_consumer_and_closes_its_subscription() -> None:
    bus = EventBus()
    sub = bus.subscribe()
    waiter = threading.Thread(target=sub.get, args=(30,))
    waiter.start()
    time.sleep(0.1)  # let it wait
    bus.close()
    waiter.join(5)
    assert not waiter.is_alive()
    assert sub.closed
    bus.close()  # idempotent


def test_a_subscription_made_after_close_is_closed_and_gets_nothing() -> None:
    bus = EventBus()
    bus.close()
    sub = bus.subscribe()
    bus.publish("job", {"id": "j1"})
    assert sub.closed
    assert sub.get(timeout=0) == []


def test_events_reach_open_subscriptions_until_close() -> None:
    bus = EventBus()
    sub = bus.subscribe()
    bus.publish("job", {"id": "j1"})
    bus.close()
    bus.publish("job", {"id": "j2"})
    assert [e.data["id"] for e in sub.get(timeout=0)] == ["j1"]
