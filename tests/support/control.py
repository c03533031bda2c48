"""A stand-in for the coordinator's control connection, for unit tests without a broker.

:class:`HandDelivered` keeps what is subscribed (``subscribe(pattern, callback, qos)``,
as :class:`~edge.transport.mqtt.MqttTransport` takes it) and :meth:`publish` calls the
callbacks whose pattern matches, in the caller's thread, as the broker would deliver.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["HandDelivered"]

Callback = Callable[[str, bytes], None]


class HandDelivered:
    """Subscriptions, and ``publish`` to deliver to them (``+`` matches one topic level)."""

    def __init__(self) -> None:
        self.subscriptions: list[tuple[str, Callback]] = []

    def subscribe(self, pattern: str, callback: Callback, qos: int = 1) -> None:
        self.subscriptions.append((pattern, callback))

    def unsubscribe(self, pattern: str) -> None:
        self.subscriptions = [(p, c) for p, c in self.subscriptions if p != pattern]

    def publish(self, topic: str, payload: bytes) -> None:
        got = topic.split("/")
        for pattern, callback in self.subscriptions:
            want = pattern.split("/")
            if len(want) == len(got) and all(w in ("+", g) for w, g in zip(want, got, strict=True)):
                callback(topic, payload)
