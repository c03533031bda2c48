"""Software link shaping in the MQTT transport, through a real Mosquitto.

Two transports play two devices. With ``link_mbps``/``link_latency_ms`` set,
stage frames take about the time the emulated link would; control messages do
not wait behind them; without those settings nothing changes. The whole
transport conformance suite also runs over a shaped pair.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from support.mosquitto import Broker
from support.waiting import until
from test_transport_conformance import Pair, TransportConformance

from edge.transport.inbox import Inbox
from edge.transport.mqtt import MqttSettings, MqttTransport
from edge.wire.frames import Codec, Kind, encode_frame

pytestmark = [pytest.mark.broker, pytest.mark.serial]  # link times asserted

JOB = "job-7"
WAIT_S = 10.0
MBIT = 1e6 / 8


def _frame(mb: int, tensor: torch.Tensor) -> bytes:
    return encode_frame(Kind.ACTIVATION, JOB, 0, mb, tensor, Codec.FP32)


@pytest.fixture
def connect(mosquitto: Broker) -> Iterator[Callable[..., MqttTransport]]:
    """Makes transports connected to ``mosquitto`` and closes every one at the end."""
    made: list[MqttTransport] = []

    def make(**kw: object) -> MqttTransport:
        fast = {"reconnect_min_s": 0.05, "reconnect_max_s": 0.5, "subscribe_timeout_s": WAIT_S}
        transport = MqttTransport(MqttSettings.model_validate({"url": mosquitto.url} | fast | kw))
        made.append(transport)
        transport.connect(timeout=WAIT_S)
        return transport

    yield make
    for transport in made:
        transport.close()


def _send_and_time(
    a: MqttTransport, inbox: Inbox, tensors: list[torch.Tensor], first: int = 0
) -> float:
    """Seconds from the first send until every frame was taken, intact.

    Microbatches are numbered from ``first`` (a repeated key would be a duplicate).
    """
    frames = [_frame(first + i, t) for i, t in enumerate(tensors)]
    t0 = time.monotonic()
    for data in frames:
        a.send(JOB, 1, "fwd", data)
    assert time.monotonic() - t0 < 0.2  # send never waits for the link
    for i, t in enumerate(tensors):
        got = inbox.take(Kind.ACTIVATION, 0, first + i, timeout=WAIT_S)
        assert torch.equal(got.tensor, t)
    return time.monotonic() - t0


def _shaper_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("link-")]


def test_shaped_upload_takes_about_the_link_time(connect: Callable[..., MqttTransport]) -> None:
    a, b = connect(link_mbps=8.0), connect()
    inbox = b.attach(JOB, 1)
    tensors = [torch.randn(25_000) for _ in range(10)]  # 10 frames of 100 kB: 1 s at 8 Mbit/s
    took = _send_and_time(a, inbox, tensors)
    assert a.link is not None
    # The link's thread counts a frame once its publish returned, which the frame, on
    # its way already, may not wait for: the counts catch up (bounded), never overshoot.
    assert until(lambda: a.stats()["link.up.frames"] == 10, timeout=5, interval=0.01)
    nbytes = a.link.up.bytes
    expected = (nbytes - a.link.up.burst_bytes) / (8 * MBIT)
    assert 0.9 * expected <= took <= 1.3 * expected, (took, expected)
    stats = a.stats()
    assert stats["frames_sent"] == 10 and stats["link.up.frames"] == 10
    assert stats["link.up.bytes"] == nbytes and stats["link.up.wait_ms"] >= 800
    assert stats["link.down.frames"] == 0 and b.stats()["frames_received"] == 10


def test_shaped_download_and_latency_each_way(connect: Callable[..., MqttTransport]) -> None:
    a, b = connect(link_latency_ms=100.0), connect(link_latency_ms=100.0, link_mbps=8.0)
    inbox = b.attach(JOB, 1)
    # One small frame: 100 ms up, 100 ms down.
    took = _send_and_time(a, inbox, [torch.ones(4)])
    assert 0.2 <= took <= 0.2 + 0.15
    # Download shaped: 5 frames of 100 kB at 8 Mbit/s, behind the 200 ms of latency.
    tensors = [torch.randn(25_000) for _ in range(5)]
    took = _send_and_time(a, inbox, tensors, first=1)
    assert b.link is not None
    expected = 0.2 + (5 * 100_050 - b.link.down.burst_bytes) / (8 * MBIT)
    assert 0.95 * expected <= took <= 1.3 * expected, (took, expected)
    assert until(lambda: b.stats()["link.down.frames"] == 6, timeout=5, interval=0.01)


def test_without_shaping_nothing_changes(connect: Callable[..., MqttTransport]) -> None:
    before = _shaper_threads()
    a, b = connect(), connect()
    inbox = b.attach(JOB, 1)
    tensors = [torch.randn(25_000) for _ in range(10)]
    took = _send_and_time(a, inbox, tensors)
    assert took < 0.5  # the same megabyte takes a second at 8 Mbit/s
    assert a.link is None and b.link is None and _shaper_threads() == before
    assert not any(key.startswith("link.") for key in a.stats() | b.stats())


def test_control_messages_are_not_shaped(connect: Callable[..., MqttTransport]) -> None:
    a, b = connect(link_mbps=1.0), connect(link_mbps=1.0)
    b.attach(JOB, 1)
    got = threading.Event()
    b.subscribe("edgetrain/v1/devices/a/status", lambda _t, _p: got.set())
    for mb in range(3):
        a.send(JOB, 1, "fwd", _frame(mb, torch.randn(25_000)))  # 2.4 s of link time
    t0 = time.monotonic()
    a.publish("edgetrain/v1/devices/a/status", b"online", 1)
    assert got.wait(WAIT_S)
    assert time.monotonic() - t0 < 0.3
    assert a.link is not None and a.link.up.backlog >= 1
    a.close(flush_timeout=0.1)


def test_close_flushes_the_link_then_stops_its_threads(
    connect: Callable[..., MqttTransport],
) -> None:
    a, b = connect(link_mbps=8.0, link_latency_ms=20.0), connect()
    inbox = b.attach(JOB, 1)
    tensors = [torch.randn(25_000) for _ in range(4)]  # 0.4 s of link time
    for mb, t in enumerate(tensors):
        a.send(JOB, 1, "fwd", _frame(mb, t))
    t0 = time.monotonic()
    a.close(flush_timeout=5.0)
    assert 0.3 <= time.monotonic() - t0 <= 2.0  # still shaped, and bounded
    assert a.link is not None
    assert not {f"link-{a.link.up.name}", f"link-{a.link.down.name}"} & set(_shaper_threads())
    for mb, t in enumerate(tensors):
        assert torch.equal(inbox.take(Kind.ACTIVATION, 0, mb, timeout=WAIT_S).tensor, t)
    with pytest.raises(RuntimeError, match="closed"):
        a.send(JOB, 1, "fwd", _frame(9, torch.ones(1)))


def test_a_full_link_queue_raises_at_send(connect: Callable[..., MqttTransport]) -> None:
    a, b = connect(link_mbps=0.1, max_queued=4), connect()
    b.attach(JOB, 1)
    data = _frame(0, torch.randn(25_000))
    for _ in range(4):
        a.send(JOB, 1, "fwd", data)
    with pytest.raises(ConnectionError, match="frames already wait on the emulated link"):
        a.send(JOB, 1, "fwd", data)
    assert a.stats()["link.up.dropped"] == 1
    a.close(flush_timeout=0.1)  # gives up on the 32 s backlog at once


class TestShapedMqttTransport(TransportConformance):
    """The transport contract holds with shaping on both devices' links."""

    kind = MqttTransport
    names = ("mqtt", "mqtt")

    @pytest.fixture
    def pair(self, connect: Callable[..., MqttTransport]) -> Pair:
        link = {"link_mbps": 2000.0, "link_latency_ms": 2.0}
        return Pair(connect(**link), connect(**link))
