"""Every tensor transport behaves the same: one conformance class, run per implementation.

:class:`TransportConformance` holds the behaviour the runtime relies on; each
``Test*`` subclass supplies a ``pair`` fixture of two endpoints of one transport:

- in-process: one shared object;
- MQTT: two clients of a real Mosquitto, as two devices would be (and again with
  an emulated link on both: tests/integration/test_shaping_mqtt.py);
- dist (torch.distributed): this process is rank 1 of a gloo world of two, and
  ``a`` is a real ``DistTransport`` on rank 0, in a process of its own
  (support.dist_peer, [Note: the neighbour follows] there);
- routed: a server stage (``b``) whose neighbour ``a`` is another server, over
  dist, or an edge device, over the other transport (in-process here).

Where a behaviour cannot apply to a transport, the class says so in ``lacks``, with
the reason, and the tests that need it are reported as skipped with that reason
(see :data:`CAPABILITIES`). What differs by design, frames sent before the
receiver attaches, is tested per implementation, and so are MQTT's own concerns:
reconnecting, URLs, credentials, control traffic on the same client; and the
routed transport's: one inbox filled by both wires.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import ClassVar, Literal, NamedTuple, TypeVar

import pytest
import torch
from support.dist_peer import DistPeer, dist_peer
from support.markers import NO_MOSQUITTO
from support.mosquitto import Broker, find_mosquitto, free_port, mosquitto_broker

from edge.errors import UserError
from edge.transport.base import Transport
from edge.transport.dist import DistTransport, Route
from edge.transport.inbox import Inbox, InboxClosed
from edge.transport.inprocess import InProcessTransport
from edge.transport.mqtt import MqttSettings, MqttTransport, parse_broker_url
from edge.transport.routed import RoutedTransport
from edge.wire.frames import Codec, Kind, encode_frame

JOB = "job-7"
WAIT_S = 10.0  # generous bound for anything asynchronous on a loaded machine


class Pair(NamedTuple):
    """``a`` serves stage 0, ``b`` stage 1 (the same object for the in-process transport)."""

    a: Transport
    b: Transport


Capability = Literal["two-jobs", "groups", "any-channel"]
CAPABILITIES: dict[Capability, str] = {
    "two-jobs": "stages of two jobs attached side by side on one endpoint, each fed its own",
    "groups": "a stage run by a group on these endpoints: members addressed one by one, "
    "and the reduce and gather channels",
    "any-channel": "an endpoint may send a stage a frame on any channel (the garbage test "
    "sends an activation on the gradient channel; without it, a gradient on the "
    "activation channel)",
}
"""What a transport may lack, by name; :attr:`TransportConformance.lacks` says which, and why."""

_Test = TypeVar("_Test", bound=Callable[..., None])


def needs(capability: Capability) -> Callable[[_Test], _Test]:
    """Mark a conformance test as applying only to transports with ``capability``."""

    def mark(test: _Test) -> _Test:
        test.needs = capability  # type: ignore[attr-defined]
        return test

    return mark


def eventually(check: Callable[[], bool], timeout: float = WAIT_S) -> bool:
    """Whether ``check`` becomes true within ``timeout`` s (polled, bounded)."""
    deadline, pause = time.monotonic() + timeout, threading.Event()
    while not check():
        if time.monotonic() > deadline:
            return False
        pause.wait(0.01)
    return True


def frame(kind: Kind, step: int, mb: int, tensor: torch.Tensor, job: str = JOB) -> bytes:
    return encode_frame(kind, job, step, mb, tensor, Codec.FP32)


class TransportConformance:
    """The contract of :class:`edge.transport.base.Transport`; subclasses provide ``pair``."""

    kind: ClassVar[type]
    """The class of ``b``, the endpoint under test."""
    names: ClassVar[tuple[str, str]]
    """The ``name`` of ``a`` and of ``b``."""
    lacks: ClassVar[Mapping[Capability, str]] = {}
    """The :data:`CAPABILITIES` this transport does not have, each with why."""

    @pytest.fixture(autouse=True)
    def _applies(self, request: pytest.FixtureRequest) -> None:
        """Skip, with the transport's reason, a test that needs what it lacks (before its
        pair is made)."""
        capability = getattr(request.function, "needs", None)
        if capability in self.lacks:
            pytest.skip(f"{type(self).__name__} lacks {capability!r}: {self.lacks[capability]}")

    def test_is_a_transport(self, pair: Pair) -> None:
        assert isinstance(pair.a, Transport) and isinstance(pair.b, Transport)
        assert isinstance(pair.b, self.kind)
        assert (pair.a.name, pair.b.name) == self.names

    def test_round_trip_of_activations_labels_and_gradients(self, pair: Pair) -> None:
        in0, in1 = pair.a.attach(JOB, 0), pair.b.attach(JOB, 1)
        act, labels, grad = torch.randn(4, 8), torch.tensor([1, 0, 3, 2]), torch.randn(4, 8)
        pair.a.send(JOB, 1, "fwd", frame(Kind.ACTIVATION, 3, 1, act))
        pair.a.send(JOB, 1, "fwd", frame(Kind.LABELS, 3, 1, labels))
        pair.b.send(JOB, 0, "bwd", frame(Kind.GRADIENT, 3, 1, grad))
        got = in1.take(Kind.ACTIVATION, 3, 1, timeout=WAIT_S)
        assert (got.kind, got.job, got.step, got.microbatch) == (Kind.ACTIVATION, JOB, 3, 1)
        assert torch.equal(got.tensor, act)
        got_labels = in1.take(Kind.LABELS, 3, 1, timeout=WAIT_S).tensor
        assert got_labels.dtype == torch.int64 and torch.equal(got_labels, labels)
        assert torch.equal(in0.take(Kind.GRADIENT, 3, 1, timeout=WAIT_S).tensor, grad)
        assert pair.a.frames_sent >= 2 and pair.a.bytes_sent > act.numel() * 4  # type: ignore[attr-defined]

    def test_codecs_behave_as_on_the_wire(self, pair: Pair) -> None:
        inbox = pair.b.attach(JOB, 1)
        x = torch.linspace(-2, 2, 64)
        for mb, codec in enumerate((Codec.FP16, Codec.BF16, Codec.INT8)):
            pair.a.send(JOB, 1, "fwd", encode_frame(Kind.ACTIVATION, JOB, 0, mb, x, codec))
        for mb, tol in enumerate((1e-3, 1e-2, 2 / 127)):
            got = inbox.take(Kind.ACTIVATION, 0, mb, timeout=WAIT_S).tensor
            assert got.dtype == torch.float32 and not torch.equal(got, x)
            assert torch.allclose(got, x, atol=tol)

    def test_frames_are_taken_in_any_order(self, pair: Pair) -> None:
        inbox = pair.b.attach(JOB, 1)
        sent = {mb: torch.full((3,), float(mb)) for mb in range(6)}
        for mb, t in sent.items():
            pair.a.send(JOB, 1, "fwd", frame(Kind.ACTIVATION, 0, mb, t))
        for mb in reversed(range(6)):
            assert torch.equal(inbox.take(Kind.ACTIVATION, 0, mb, timeout=WAIT_S).tensor, sent[mb])
        assert inbox.pending == 0

    def test_a_repeated_frame_is_dropped_as_duplicate(self, pair: Pair) -> None:
        inbox = pair.b.attach(JOB, 1)
        data = frame(Kind.ACTIVATION, 1, 0, torch.ones(2))
        pair.a.send(JOB, 1, "fwd", data)
        pair.a.send(JOB, 1, "fwd", data)
        inbox.take(Kind.ACTIVATION, 1, 0, timeout=WAIT_S)
        assert eventually(lambda: inbox.dropped["duplicate"] == 1)
        assert inbox.frames_received == 1 and inbox.pending == 0

    def test_a_frame_of_another_job_is_dropped(self, pair: Pair) -> None:
        inbox = pair.b.attach(JOB, 1)
        pair.a.send(JOB, 1, "fwd", frame(Kind.ACTIVATION, 0, 0, torch.ones(2), job="other"))
        pair.a.send(JOB, 1, "fwd", frame(Kind.ACTIVATION, 0, 0, torch.zeros(2)))
        assert torch.equal(inbox.take(Kind.ACTIVATION, 0, 0, timeout=WAIT_S).tensor, torch.zeros(2))
        assert eventually(lambda: inbox.dropped["wrong-job"] == 1)

    def test_garbage_is_counted_and_dropped_without_an_exception(self, pair: Pair) -> None:
        inbox = pair.b.attach(JOB, 1)
        good = frame(Kind.ACTIVATION, 0, 0, torch.ones(5))
        pair.a.send(JOB, 1, "fwd", b"not a frame; " * 20)
        pair.a.send(JOB, 1, "fwd", good[:20])
        corrupt = bytearray(good)
        corrupt[-1] ^= 0xFF
        pair.a.send(JOB, 1, "fwd", bytes(corrupt))
        if "any-channel" not in self.lacks:
            pair.a.send(JOB, 1, "bwd", good)  # an activation on the gradient channel
        else:  # stage 1 hears gradients from stage 2 only: a gradient where activations go
            pair.a.send(JOB, 1, "fwd", frame(Kind.GRADIENT, 0, 0, torch.ones(5)))
        pair.a.send(JOB, 1, "fwd", good)
        assert torch.equal(inbox.take(Kind.ACTIVATION, 0, 0, timeout=WAIT_S).tensor, torch.ones(5))
        want = {"bad-magic": 1, "truncated": 1, "bad-checksum": 1, "wrong-kind": 1}
        assert eventually(lambda: dict(inbox.dropped) == want), inbox.dropped

    def test_take_times_out(self, pair: Pair) -> None:
        inbox = pair.b.attach(JOB, 1)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="step 9 microbatch 2"):
            inbox.take(Kind.ACTIVATION, 9, 2, timeout=0.2)
        assert time.monotonic() - t0 >= 0.2

    def test_detach_closes_the_inbox_and_wakes_a_waiting_take(self, pair: Pair) -> None:
        inbox = pair.b.attach(JOB, 1)
        outcome: list[BaseException] = []

        def wait() -> None:
            try:
                inbox.take(Kind.ACTIVATION, 0, 0, timeout=WAIT_S)
            except BaseException as exc:
                outcome.append(exc)

        waiter = threading.Thread(target=wait)
        waiter.start()
        assert eventually(lambda: waiter.is_alive())
        pair.b.detach(JOB, 1)
        waiter.join(WAIT_S)
        assert not waiter.is_alive() and len(outcome) == 1
        assert isinstance(outcome[0], InboxClosed)
        pair.b.detach(JOB, 1)  # detaching twice is harmless
        assert isinstance(pair.b.attach(JOB, 1), Inbox)  # and the stage can attach again

    def test_attaching_a_stage_twice_is_an_error(self, pair: Pair) -> None:
        pair.b.attach(JOB, 1)
        with pytest.raises(ValueError, match="already attached"):
            pair.b.attach(JOB, 1)

    def test_a_16_mib_tensor_arrives_intact(self, pair: Pair) -> None:
        inbox = pair.b.attach(JOB, 1)
        big = torch.randn(4 << 20)  # 16 MiB of fp32
        pair.a.send(JOB, 1, "fwd", frame(Kind.ACTIVATION, 0, 0, big))
        got = inbox.take(Kind.ACTIVATION, 0, 0, timeout=30.0)
        assert got.tensor.shape == big.shape and torch.equal(got.tensor, big)

    @needs("two-jobs")
    def test_stages_of_two_jobs_do_not_mix(self, pair: Pair) -> None:
        mine, theirs = pair.b.attach(JOB, 1), pair.b.attach("job-8", 1)
        pair.a.send("job-8", 1, "fwd", frame(Kind.ACTIVATION, 0, 0, torch.ones(1), job="job-8"))
        pair.a.send(JOB, 1, "fwd", frame(Kind.ACTIVATION, 0, 0, torch.zeros(1)))
        assert torch.equal(theirs.take(Kind.ACTIVATION, 0, 0, timeout=WAIT_S).tensor, torch.ones(1))
        assert torch.equal(mine.take(Kind.ACTIVATION, 0, 0, timeout=WAIT_S).tensor, torch.zeros(1))

    @needs("groups")
    def test_members_of_a_group_are_addressed_one_by_one(self, pair: Pair) -> None:
        """Two members of stage 1: each gets only its own pieces, and its group's chunks
        on the reduce channel; the same member twice is an error."""
        first, second = pair.b.attach(JOB, 1, 0, members=2), pair.b.attach(JOB, 1, 1, members=2)
        with pytest.raises(ValueError, match="member 1 is already attached"):
            pair.b.attach(JOB, 1, 1, members=2)
        for lo, hi, member in ((0, 3, 0), (3, 4, 1)):
            piece = torch.full((hi - lo, 2), float(lo))
            data = encode_frame(Kind.ACTIVATION, JOB, 0, 0, piece, Codec.FP32, first=lo)
            pair.a.send(JOB, 1, "fwd", data, member)
        chunk = encode_frame(Kind.REDUCE, JOB, 0, 0, torch.ones(5), Codec.RAW)
        pair.b.send(JOB, 1, "reduce", chunk, 1, sender=0)
        got = second.take(Kind.ACTIVATION, 0, 0, timeout=WAIT_S, first=3)
        assert got.samples == (3, 4) and torch.equal(got.tensor, torch.full((1, 2), 3.0))
        assert first.take(Kind.ACTIVATION, 0, 0, timeout=WAIT_S).samples == (0, 3)
        assert torch.equal(second.take(Kind.REDUCE, 0, 0, timeout=WAIT_S).tensor, torch.ones(5))
        assert first.pending == 0 and second.pending == 0
        pair.b.detach(JOB, 1, 1)
        assert second.closed and not first.closed

    @needs("groups")
    def test_a_gather_chunk_is_sent_once_and_reaches_every_other_member(self, pair: Pair) -> None:
        """A group of three on stage 1, member 1 on ``a`` and members 0 and 2 on ``b``: one
        send on member 1's gather topic reaches 0 and 2, not 1; it still reaches 2 once 0
        has detached (the members on ``b`` share the topic)."""
        mine = pair.a.attach(JOB, 1, 1, members=3)
        first, third = pair.b.attach(JOB, 1, 0, members=3), pair.b.attach(JOB, 1, 2, members=3)
        sent = pair.a.frames_sent  # type: ignore[attr-defined]
        pair.a.send(
            JOB,
            1,
            "gather",
            encode_frame(Kind.GATHER, JOB, 0, 1, torch.ones(5), Codec.RAW),
            sender=1,
        )
        for inbox in (first, third):
            assert torch.equal(inbox.take(Kind.GATHER, 0, 1, timeout=WAIT_S).tensor, torch.ones(5))
        # Counted once it left (a shaped link releases it later): after it arrived, one.
        assert pair.a.frames_sent == sent + 1  # type: ignore[attr-defined]
        pair.b.detach(JOB, 1, 0)
        again = encode_frame(Kind.GATHER, JOB, 1, 1, torch.zeros(5), Codec.RAW)
        pair.a.send(JOB, 1, "gather", again, sender=1)
        assert torch.equal(third.take(Kind.GATHER, 1, 1, timeout=WAIT_S).tensor, torch.zeros(5))
        assert mine.pending == 0 and not mine.dropped and not third.dropped

    def test_what_the_runtime_needs_attach_everything_then_send(self, pair: Pair) -> None:
        """Once ``attach`` has returned, every frame sent to that stage is delivered."""
        inbox = pair.b.attach(JOB, 1)
        for mb in range(20):
            pair.a.send(JOB, 1, "fwd", frame(Kind.ACTIVATION, 0, mb, torch.full((2,), mb)))
        for mb in range(20):
            inbox.take(Kind.ACTIVATION, 0, mb, timeout=WAIT_S)

    def test_close_closes_every_inbox(self, pair: Pair) -> None:
        inbox = pair.b.attach(JOB, 1)
        pair.b.close()
        with pytest.raises(InboxClosed):
            inbox.take(Kind.ACTIVATION, 0, 0, timeout=WAIT_S)


class TestInProcessTransport(TransportConformance):
    kind = InProcessTransport
    names = ("inprocess", "inprocess")

    @pytest.fixture
    def pair(self) -> Iterator[Pair]:
        transport = InProcessTransport()
        try:
            yield Pair(transport, transport)
        finally:
            transport.close()

    def test_frames_sent_before_attach_wait_for_the_stage(self, pair: Pair) -> None:
        pair.a.send(JOB, 1, "fwd", frame(Kind.ACTIVATION, 0, 0, torch.ones(3)))
        assert isinstance(pair.a, InProcessTransport) and pair.a.waiting(JOB, 1) == 1
        inbox = pair.b.attach(JOB, 1)
        assert torch.equal(inbox.take(Kind.ACTIVATION, 0, 0, timeout=0).tensor, torch.ones(3))

    def test_the_early_buffer_is_bounded_oldest_dropped(self) -> None:
        transport = InProcessTransport(buffer_frames=3)
        for mb in range(5):
            transport.send(JOB, 1, "fwd", frame(Kind.ACTIVATION, 0, mb, torch.ones(1)))
        assert transport.dropped["buffer-full"] == 2 and transport.waiting(JOB, 1) == 3
        inbox = transport.attach(JOB, 1)
        assert inbox.pending == 3
        with pytest.raises(TimeoutError):
            inbox.take(Kind.ACTIVATION, 0, 0, timeout=0)
        inbox.take(Kind.ACTIVATION, 0, 4, timeout=0)
        transport.close()
        with pytest.raises(RuntimeError, match="closed"):
            transport.send(JOB, 1, "fwd", b"")


def _settings(url: str, **kw: object) -> MqttSettings:
    fast = {"reconnect_min_s": 0.05, "reconnect_max_s": 0.5, "subscribe_timeout_s": WAIT_S}
    return MqttSettings.model_validate({"url": url, **fast, **kw})


@pytest.fixture
def own_brokers() -> None:
    """For tests that start (and restart) brokers themselves."""
    if find_mosquitto() is None:
        pytest.skip(NO_MOSQUITTO)


@pytest.fixture
def connect() -> Iterator[Callable[..., MqttTransport]]:
    """Makes connected MQTT transports and closes every one of them at the end."""
    made: list[MqttTransport] = []

    def make(url: str, timeout: float = WAIT_S, **kw: object) -> MqttTransport:
        transport = MqttTransport(_settings(url, **kw))
        made.append(transport)
        transport.connect(timeout=timeout)
        return transport

    yield make
    for transport in made:
        transport.close()


@pytest.mark.broker
class TestMqttTransport(TransportConformance):
    kind = MqttTransport
    names = ("mqtt", "mqtt")

    @pytest.fixture
    def pair(self, mosquitto: Broker, connect: Callable[..., MqttTransport]) -> Pair:
        return Pair(connect(mosquitto.url), connect(mosquitto.url))

    def test_frames_sent_before_attach_are_lost_after_attach_they_arrive(self, pair: Pair) -> None:
        """Clean sessions: see [Note: MQTT sessions and lost frames] in edge.transport.mqtt."""
        pair.a.send(JOB, 1, "fwd", frame(Kind.ACTIVATION, 0, 0, torch.ones(1)))
        assert isinstance(pair.a, MqttTransport) and pair.a.flush(WAIT_S)
        inbox = pair.b.attach(JOB, 1)
        pair.a.send(JOB, 1, "fwd", frame(Kind.ACTIVATION, 0, 1, torch.ones(1)))
        inbox.take(Kind.ACTIVATION, 0, 1, timeout=WAIT_S)
        with pytest.raises(TimeoutError):
            inbox.take(Kind.ACTIVATION, 0, 0, timeout=0.2)

    def test_counters_and_unroutable_messages(self, pair: Pair) -> None:
        a, b = pair
        assert isinstance(a, MqttTransport) and isinstance(b, MqttTransport)
        inbox = b.attach(JOB, 1)
        data = frame(Kind.ACTIVATION, 0, 0, torch.ones(10))
        a.send(JOB, 1, "fwd", data)
        inbox.take(Kind.ACTIVATION, 0, 0, timeout=WAIT_S)
        assert a.flush(WAIT_S)
        assert a.stats() == {
            "frames_sent": 1,
            "bytes_sent": len(data),
            "frames_received": 0,
            "bytes_received": 0,
            "reconnects": 0,
            "unacked": 0,
        }
        assert b.frames_received == 1 and b.bytes_received == len(data)
        # A subscription nothing routes (white-box: drop the callback behind it) gets
        # messages for a stage that is not attached and for foreign topics: counted, dropped.
        b.subscribe("edgetrain/v1/#", lambda _t, _p: None)
        b._client.message_callback_remove("edgetrain/v1/#")
        a.publish("edgetrain/v1/jobs/job-7/stage/5/fwd", data)
        a.publish("edgetrain/v1/somewhere/else", b"{}")
        assert eventually(lambda: b.dropped == {"unattached": 1, "other-topic": 1}), b.dropped
        assert b.stats()["dropped.unattached"] == 1

    def test_control_messages_share_the_connection(
        self, pair: Pair, connect: Callable[..., MqttTransport], mosquitto: Broker
    ) -> None:
        a, b = pair
        assert isinstance(a, MqttTransport) and isinstance(b, MqttTransport)
        got: list[tuple[str, bytes]] = []

        def fails(_topic: str, _payload: bytes) -> None:
            raise ValueError("a bug in a control handler")

        b.subscribe("edgetrain/v1/devices/+/status", lambda t, p: got.append((t, p)))
        b.subscribe("edgetrain/v1/devices/+/cmd", fails)  # logged and counted, not raised
        inbox = b.attach(JOB, 1)
        a.publish("edgetrain/v1/devices/pi-1/status", '{"state": "online"}', retain=True)
        a.publish("edgetrain/v1/devices/pi-1/cmd", b"{}")
        a.send(JOB, 1, "fwd", frame(Kind.ACTIVATION, 0, 0, torch.ones(1)))
        inbox.take(Kind.ACTIVATION, 0, 0, timeout=WAIT_S)
        status = ("edgetrain/v1/devices/pi-1/status", b'{"state": "online"}')
        assert eventually(lambda: got == [status])
        assert eventually(lambda: b.dropped["callback-error"] == 1)
        late = connect(mosquitto.url)  # a retained status reaches later subscribers
        seen = threading.Event()
        late.subscribe("edgetrain/v1/devices/+/status", lambda _t, _p: seen.set())
        assert seen.wait(WAIT_S)
        b.unsubscribe("edgetrain/v1/devices/+/status")
        a.publish("edgetrain/v1/devices/pi-2/status", b"x")
        a.send(JOB, 1, "fwd", frame(Kind.ACTIVATION, 0, 1, torch.ones(1)))  # sent after it
        inbox.take(Kind.ACTIVATION, 0, 1, timeout=WAIT_S)
        assert got == [status]
        # A control filter that also covers a stage's topic does not take its frames.
        watched: list[str] = []
        b.subscribe("edgetrain/v1/jobs/#", lambda t, _p: watched.append(t))
        a.send(JOB, 1, "fwd", frame(Kind.ACTIVATION, 0, 2, torch.ones(1)))
        inbox.take(Kind.ACTIVATION, 0, 2, timeout=WAIT_S)
        assert eventually(lambda: len(watched) >= 1) and b.dropped["callback-error"] == 1

    def test_last_will_is_published_when_a_client_vanishes(
        self, mosquitto: Broker, connect: Callable[..., MqttTransport]
    ) -> None:
        watcher = connect(mosquitto.url)
        wills = threading.Event()
        watcher.subscribe("edgetrain/v1/devices/pi-9/status", lambda _t, p: wills.set())
        dying = MqttTransport(_settings(mosquitto.url, keepalive=5))
        dying.will_set("edgetrain/v1/devices/pi-9/status", b"offline", qos=1, retain=True)
        dying.connect(WAIT_S)
        with pytest.raises(RuntimeError, match="before connect"):
            dying.will_set("x", b"")
        # Simulate a crash: drop the socket without a DISCONNECT packet.
        dying._client.socket().close()  # type: ignore[union-attr]
        try:
            assert wills.wait(WAIT_S)
        finally:
            dying.close(flush_timeout=0)


@pytest.mark.broker
@pytest.mark.usefixtures("own_brokers")
def test_reconnects_after_a_broker_restart_and_resubscribes(
    connect: Callable[..., MqttTransport],
) -> None:
    with mosquitto_broker() as first:
        port = first.port
        a, b = connect(first.url), connect(first.url)
        inbox = b.attach(JOB, 1)
        a.send(JOB, 1, "fwd", frame(Kind.ACTIVATION, 0, 0, torch.ones(2)))
        inbox.take(Kind.ACTIVATION, 0, 0, timeout=WAIT_S)
    assert eventually(lambda: not a.connected and not b.connected)
    a.send(JOB, 1, "fwd", frame(Kind.ACTIVATION, 0, 1, torch.ones(2)))  # queued, not blocking
    with mosquitto_broker(port=port):
        assert a.wait_ready(WAIT_S) and b.wait_ready(WAIT_S)
        assert a.reconnects == 1 and b.reconnects == 1
        a.send(JOB, 1, "fwd", frame(Kind.ACTIVATION, 0, 2, torch.full((2,), 2.0)))
        got = inbox.take(Kind.ACTIVATION, 0, 2, timeout=WAIT_S)
        assert torch.equal(got.tensor, torch.full((2,), 2.0))
        b.send(JOB, 0, "bwd", frame(Kind.GRADIENT, 0, 2, torch.ones(2)))  # b can still send
        assert b.flush(WAIT_S)


@pytest.mark.broker
def test_a_large_frame_is_sent_from_a_view(
    mosquitto: Broker, connect: Callable[..., MqttTransport]
) -> None:
    """Every piece of a 4 MiB frame leaves the sender's socket from a view of the packet,
    not a copy of what is left of it ([Note: a packet sent in pieces] in
    :mod:`edge.transport.settings`), and arrives whole."""
    a, b = connect(mosquitto.url), connect(mosquitto.url)
    inbox = b.attach(JOB, 1)
    client = a._client
    pieces: list[type] = []
    send = client._sock_send

    def recording(buf: bytes) -> int:
        pieces.append(type(buf))
        return send(buf)

    client._sock_send = recording  # type: ignore[method-assign]
    tensor = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB
    a.send(JOB, 1, "fwd", frame(Kind.ACTIVATION, 0, 0, tensor))
    got = inbox.take(Kind.ACTIVATION, 0, 0, timeout=WAIT_S)
    assert torch.equal(got.tensor, tensor)
    assert pieces and set(pieces) == {memoryview}, pieces


@pytest.mark.parametrize(
    "url",
    ["http://host:1883", "host:1883", "mqtt://", "mqtt://h:99999", "mqtt://u:p@h", "mqtt://h/x"],
)
def test_a_bad_broker_url_is_a_one_line_user_error(url: str) -> None:
    with pytest.raises(UserError) as err:
        MqttTransport(MqttSettings(url=url))
    assert url in err.value.message and "\n" not in err.value.message


def test_broker_urls() -> None:
    assert parse_broker_url("mqtt://10.0.0.5") == ("mqtt", "10.0.0.5", 1883)
    assert parse_broker_url("mqtts://broker.local") == ("mqtts", "broker.local", 8883)
    assert parse_broker_url("tcp://[::1]:1884") == ("mqtt", "::1", 1884)
    with pytest.raises(UserError, match="mqtts://"):
        MqttTransport(MqttSettings(url="mqtt://h", tls_insecure=True))


def test_an_unreachable_broker_is_a_user_error_naming_it() -> None:
    url = f"mqtt://127.0.0.1:{free_port()}"
    transport = MqttTransport(_settings(url))
    t0 = time.monotonic()
    with pytest.raises(UserError, match=r"cannot connect within 0\.5 s") as err:
        transport.connect(timeout=0.5)
    assert url in err.value.message and time.monotonic() - t0 < 3
    transport.close()


@pytest.fixture
def password_file() -> Iterator[Path]:
    """A ``mosquitto_passwd`` file for ``edge``/``s3cret``, readable by the broker's own user."""
    tool = shutil.which("mosquitto_passwd") or "/usr/bin/mosquitto_passwd"
    if not os.path.exists(tool):
        pytest.skip("mosquitto_passwd not found")
    folder = Path(tempfile.mkdtemp(prefix="edgetrain-passwd-"))
    try:
        folder.chmod(0o755)  # Mosquitto reads it after dropping root for its own user
        path = folder / "passwd"
        subprocess.run([tool, "-c", "-b", str(path), "edge", "s3cret"], check=True, timeout=30)
        path.chmod(0o644)
        yield path
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.broker
@pytest.mark.usefixtures("own_brokers")
def test_credentials_are_checked(
    password_file: Path, connect: Callable[..., MqttTransport]
) -> None:
    with mosquitto_broker(password_file=password_file) as broker:
        for creds in ({"username": "edge", "password": "wrong"}, {}):
            with pytest.raises(UserError) as err:
                connect(broker.url, timeout=5.0, **creds)
            assert err.value.message == (
                f"broker {broker.url} refused the connection: Not authorized"
                " (check username and password)"
            )
        good = connect(broker.url, username="edge", password="s3cret")
        inbox = good.attach(JOB, 1)
        good.send(JOB, 1, "fwd", frame(Kind.ACTIVATION, 0, 0, torch.ones(1)))
        inbox.take(Kind.ACTIVATION, 0, 0, timeout=WAIT_S)
        assert "s3cret" not in repr(good.settings)


# -- torch.distributed, and a routed stage on it --------------------------------------------

ROUTE = Route(2, {0: 0, 1: 1})
"""Stage 0 on the peer (rank 0), stage 1 here (rank 1)."""
_ONE_JOB = (
    "each stream is one (source rank, tag) pair whatever the job: a second job's stage "
    "would read the first one's frames (a torch.distributed group serves one job, "
    "edge.server.groups)"
)
_NEIGHBOURS_ONLY = (
    "a channel is a stream from one neighbour: stage 1 hears gradients only from stage 2"
)


@pytest.fixture(scope="module")
def peer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DistPeer]:
    """This process as rank 1 of a gloo world whose rank 0 is a peer process, for the module."""
    with dist_peer(str(tmp_path_factory.mktemp("dist") / "store")) as it:
        yield it


class TestDistTransport(TransportConformance):
    kind = DistTransport
    names = ("dist", "dist")
    lacks: ClassVar[Mapping[Capability, str]] = {
        "two-jobs": _ONE_JOB,
        "groups": "each member of a group is a rank of its own, and the group sums its "
        "gradients with a collective, not with frames (edge.transport.dist; groups over "
        "dist: tests/e2e/test_dist_group_parity.py)",
        "any-channel": _NEIGHBOURS_ONLY,
    }

    @pytest.fixture
    def pair(self, peer: DistPeer) -> Iterator[Pair]:
        own = DistTransport(ROUTE, join_timeout_s=WAIT_S)
        neighbour = peer.neighbour(ROUTE, JOB, 0)
        try:
            yield Pair(neighbour, own)  # type: ignore[arg-type]
        finally:
            neighbour.finish(own, JOB, 1)


class TestRoutedTransportToAServer(TransportConformance):
    """A server stage whose neighbour is another server: every frame over dist."""

    kind = RoutedTransport
    names = ("dist", "dist+inprocess")
    lacks: ClassVar[Mapping[Capability, str]] = {
        "two-jobs": _ONE_JOB,
        "groups": "a hybrid stage runs on one device (RoutedTransport.attach)",
        "any-channel": _NEIGHBOURS_ONLY,
    }

    @pytest.fixture
    def pair(self, peer: DistPeer) -> Iterator[Pair]:
        edge = InProcessTransport()
        own = RoutedTransport(edge, DistTransport(ROUTE, join_timeout_s=WAIT_S))
        neighbour = peer.neighbour(ROUTE, JOB, 0)
        try:
            yield Pair(neighbour, own)  # type: ignore[arg-type]
        finally:
            neighbour.finish(own.dist, JOB, 1)
            edge.close()
        assert edge.frames_sent == 0  # nothing went the edge's way


class TestRoutedTransportToAnEdgeDevice(TransportConformance):
    """A server stage whose neighbour is an edge device: every frame over the other wire
    (in-process here; MQTT on a device), none over dist."""

    kind = RoutedTransport
    names = ("inprocess", "dist+inprocess")
    lacks: ClassVar[Mapping[Capability, str]] = {
        "groups": "a hybrid stage runs on one device (RoutedTransport.attach)"
    }

    @pytest.fixture
    def pair(self, peer: DistPeer) -> Iterator[Pair]:
        edge = InProcessTransport()
        servers = DistTransport(Route(2, {1: 1}))  # stage 0 is not in the dist job
        own = RoutedTransport(edge, servers)
        try:
            yield Pair(edge, own)
        finally:
            own.close()
            edge.close()
        assert servers.frames_sent == 0  # nothing went the servers' way


def test_a_routed_stage_takes_from_both_wires_and_sends_each_frame_on_its_own(
    peer: DistPeer,
) -> None:
    """Stage 0 an edge device (in-process), stage 1 here (routed), stage 2 the peer (dist):
    stage 1's one inbox gets stage 0's activations and stage 2's gradients, and what it
    sends to each goes on the wire that reaches it."""
    route = Route(3, {1: 1, 2: 0})
    edge = InProcessTransport()
    own = RoutedTransport(edge, DistTransport(route, join_timeout_s=WAIT_S))
    neighbour = peer.neighbour(route, JOB, 2)
    try:
        device, inbox = edge.attach(JOB, 0), own.attach(JOB, 1)
        edge.send(JOB, 1, "fwd", frame(Kind.ACTIVATION, 0, 0, torch.ones(3)))
        neighbour.send(JOB, 1, "bwd", frame(Kind.GRADIENT, 0, 0, torch.full((3,), 2.0)))
        got = inbox.take(Kind.ACTIVATION, 0, 0, timeout=WAIT_S).tensor
        assert torch.equal(got, torch.ones(3))
        got = inbox.take(Kind.GRADIENT, 0, 0, timeout=WAIT_S).tensor
        assert torch.equal(got, torch.full((3,), 2.0))
        own.send(JOB, 2, "fwd", frame(Kind.ACTIVATION, 0, 1, torch.full((2,), 3.0)))
        own.send(JOB, 0, "bwd", frame(Kind.GRADIENT, 0, 1, torch.full((2,), 4.0)))
        got = neighbour.attach(JOB, 2).take(Kind.ACTIVATION, 0, 1, timeout=WAIT_S).tensor
        assert torch.equal(got, torch.full((2,), 3.0))
        got = device.take(Kind.GRADIENT, 0, 1, timeout=WAIT_S).tensor
        assert torch.equal(got, torch.full((2,), 4.0))
        assert own.dist.frames_sent == 1 and edge.frames_sent == 2  # one each way on each
        assert inbox.frames_received == 2 and not inbox.dropped
    finally:
        neighbour.finish(own.dist, JOB, 1)
        edge.close()
