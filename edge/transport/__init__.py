"""Tensor transports behind one :class:`~edge.transport.base.Transport` protocol.

- :mod:`edge.transport.base`: the protocol every transport implements, and its channels;
- :mod:`edge.transport.inbox`: what a stage keeps of the frames sent to it, and what it drops;
- :mod:`edge.transport.inprocess`: queues in one process, for tests and local runs;
- :mod:`edge.transport.mqtt`: MQTT through a broker (paho-mqtt 2.x);
- :mod:`edge.transport.settings`: how to reach a broker: its URL forms, the client settings;
- :mod:`edge.transport.credentials`: a device's broker credentials file (``fleet enroll``);
- :mod:`edge.transport.shaping`: an emulated link (token bucket and latency) for MQTT;
- :mod:`edge.transport.dist`: torch.distributed point-to-point, between server-tier ranks;
- :mod:`edge.transport.routed`: a server stage with edge neighbours: dist and another wire.
"""

from edge.transport.base import Channel, Transport
from edge.transport.inbox import Inbox, InboxClosed

__all__ = ["Channel", "Inbox", "InboxClosed", "Transport"]
