"""Tensor transports behind one :class:`~edge.transport.base.Transport` protocol.

- :mod:`edge.transport.base`: the protocol and the :class:`~edge.transport.base.Inbox`;
- :mod:`edge.transport.inprocess`: queues in one process, for tests and local runs;
- :mod:`edge.transport.mqtt`: MQTT through a broker (paho-mqtt 2.x);
- :mod:`edge.transport.shaping`: an emulated link (token bucket and latency) for it.
"""

from edge.transport.base import Channel, Inbox, InboxClosed, Transport

__all__ = ["Channel", "Inbox", "InboxClosed", "Transport"]
