"""Tensor frames and JSON control traffic over one MQTT connection (paho-mqtt 2.x).

This module owns :class:`MqttTransport` (its settings and broker URLs are in
:mod:`edge.transport.settings`). One instance is one MQTT client: stages attach to it
to receive frames on ``stage_topic(job, stage, "fwd"|"bwd")`` and send frames at
QoS 1; the agent daemon publishes and subscribes its control topics through the
same instance, so a device keeps one connection (and one last will).

[Note: MQTT sessions and lost frames]
The client uses a clean session (MQTT 3.1.1): the broker forgets our
subscriptions when the connection drops and keeps nothing for us while we are
away. So a frame published to a stage before the broker acknowledged that
stage's subscription is lost: :meth:`MqttTransport.attach` returns only after
the SUBACK, and the runtime attaches every stage before any stage sends. On
every (re)connect all subscriptions are made again, before paho resends the
QoS-1 messages it kept for us; those may then arrive twice, which the inbox
ignores ([Note: QoS and ordering] in :mod:`edge.transport.inbox`). Frames sent
*to* us while we were away are gone, and the ``take`` that waits for one times out.

Sending never waits for the network. paho holds up to ``max_queued`` QoS-1
messages (in flight, or waiting while disconnected) by reference, so memory is
at most ``max_queued`` x frame size; a stage rarely has more than a step's
microbatches outstanding, as it must receive before it sends again. When the
queue is full, :meth:`MqttTransport.send` raises :class:`ConnectionError` at
once rather than block. ``max_inflight`` (100) keeps enough frames on the wire
to fill a fast link.

[Note: no Nagle]
Every connection sets TCP_NODELAY, as the broker does (``set_tcp_nodelay``). With
Nagle's algorithm on, a segment shorter than the path's MSS waits for the
acknowledgement of the one before: over TLS every 16 KiB record is such a
segment, so a 1 MiB frame went out as a string of waits (measured: TLS at 0.4x
of plain through Mosquitto on loopback), and a small control message after a
frame waited too.

With ``link_mbps`` or ``link_latency_ms`` in the settings, the transport
emulates a slower link for its stage frames (the testbed's software method,
[Note: the emulated link] in :mod:`edge.transport.shaping`): :meth:`send`
queues the frame on the shaper's up direction, whose thread publishes it when
the emulated link would have carried it; frames for attached stages wait in
the down direction before reaching their inbox. Control messages are never
shaped. Without those settings there is no shaper, thread or copy at all.

Tested in tests/integration/test_transport_conformance.py::TestMqttTransport (and the
tests after it there: reconnects, broker URLs, credentials), on a real Mosquitto; the
emulated link in tests/integration/test_shaping_mqtt.py.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import ssl
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any, cast

import paho.mqtt.client as mqtt

from edge.errors import UserError
from edge.transport.base import Channel
from edge.transport.inbox import Inbox
from edge.transport.settings import MqttSettings, new_client, parse_broker_url
from edge.transport.shaping import LinkShaper
from edge.wire.topics import parse_stage_topic, stage_topic

__all__ = ["ControlCallback", "MqttSettings", "MqttTransport", "parse_broker_url"]

log = logging.getLogger(__name__)

_Up = tuple[str, bytes | bytearray]  # (topic, frame) waiting on the emulated link
_Down = tuple[Inbox, bytes | bytearray, Channel, int | None]  # (inbox, frame, channel, sender)

ControlCallback = Callable[[str, bytes], None]
"""``callback(topic, payload)`` for a control subscription; runs on paho's network thread."""

_MAX_PAYLOAD = 268_435_455 - 1024  # MQTT's limit on a packet, less the topic and header


def _payload(payload: bytes | bytearray | memoryview | str) -> bytes | bytearray:
    """What paho will publish (it refuses a memoryview); too big for MQTT is a ``ValueError``."""
    data = payload.encode() if isinstance(payload, str) else payload
    if not isinstance(data, bytes | bytearray):
        data = bytes(data)
    if len(data) > _MAX_PAYLOAD:
        raise ValueError(f"{len(data)} bytes exceed MQTT's message limit of 256 MiB")
    return data


_CHANNELS: tuple[Channel, Channel] = ("fwd", "bwd")


def _no_delay(_client: Any, _userdata: Any, sock: Any) -> None:
    """Turn Nagle's algorithm off on a new connection ([Note: no Nagle])."""
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class MqttTransport:
    """Frames for attached stages, and control topics, over one paho client.

    Counters: ``frames_sent``/``bytes_sent``, ``frames_received``/``bytes_received``
    (messages routed to an attached stage's inbox), ``reconnects`` and ``dropped``
    by reason (``other-topic``, ``unattached``, ``queue-full``, ``callback-error``,
    ``link-full``; an inbox counts its own drops); :meth:`stats` gives them all at once. With
    link shaping, :attr:`link` is the :class:`~edge.transport.shaping.LinkShaper`
    and ``frames_sent``/``bytes_sent`` count frames once it released them.
    """

    name = "mqtt"

    def __init__(self, settings: MqttSettings) -> None:
        self.settings = s = settings
        self.url = s.url
        _scheme, self.host, self.port = parse_broker_url(s.url)
        client_id = s.client_id or f"edgetrain-{secrets.token_hex(6)}"
        self._client = c = new_client(s, client_id)
        c.on_connect, c.on_disconnect = self._on_connect, self._on_disconnect
        c.on_subscribe, c.on_publish = self._on_subscribe, self._on_publish
        c.on_message = self._on_message
        c.on_socket_open = _no_delay

        self._cond = threading.Condition()  # guards the subscription state below
        self._inboxes: dict[tuple[str, int, int], Inbox] = {}  # (job, stage, member)
        self._stage_topics: dict[tuple[str, int, int], list[str]] = {}
        self._retired: deque[str] = deque(maxlen=32)  # filters unsubscribed lately
        self._control: dict[str, int] = {}  # topic filter -> QoS
        self._active: set[str] = set()  # filters the broker acknowledged on this connection
        self._pending: dict[int, list[str]] = {}  # SUBSCRIBE mid -> its filters
        self._connected = self._started = self._closed = False
        self._refused: str | None = None
        self._net_thread: int | None = None
        self._pub_lock = threading.Lock()  # a publish and the record of its mid, atomically
        self._unacked: set[int] = set()
        self._acks: deque[int] = deque()  # acknowledged mids, appended by the network thread
        self._counts = threading.Lock()
        self._stop = threading.Event()
        self.frames_sent = self.bytes_sent = self.frames_received = self.bytes_received = 0
        self.reconnects = self._connects = 0
        self.dropped: Counter[str] = Counter()
        self.link: LinkShaper[_Up, _Down] | None = None
        if s.link_mbps is not None or s.link_latency_ms > 0:
            self.link = LinkShaper(
                s.link_mbps,
                s.link_latency_ms,
                send=self._release_up,
                deliver=self._release_down,
                max_queued=s.max_queued,
                name=client_id,
            )

    # -- connection ----------------------------------------------------------------

    def will_set(
        self, topic: str, payload: bytes | str, qos: int = 1, retain: bool = False
    ) -> None:
        """What the broker publishes if this client vanishes; call before :meth:`connect`."""
        if self._started:
            raise RuntimeError("will_set must be called before connect")
        self._client.will_set(topic, payload, qos, retain)

    def connect(self, timeout: float = 10.0) -> None:
        """Connect, retrying with backoff for at most ``timeout`` s; later, keep reconnecting.

        Returns once the broker accepted us and acknowledged every subscription
        made so far. Raises a one-line :class:`UserError` naming the broker if it
        cannot be reached, refuses us, or does not answer in time.
        """
        if self._closed or self._started:
            raise RuntimeError("connect: the transport is already connected or closed")
        deadline, delay = time.monotonic() + timeout, self.settings.reconnect_min_s
        self._refused = None
        with contextlib.suppress(RuntimeError):  # paho refuses it after a failed attempt
            self._client.connect_timeout = max(0.1, min(5.0, timeout))
        while True:
            try:
                self._client.connect(self.host, self.port, self.settings.keepalive)
                break
            except ssl.SSLCertVerificationError as exc:  # retrying will not help
                raise UserError(f"broker {self.url}: certificate not trusted: {exc}") from None
            except OSError as exc:
                if time.monotonic() + delay >= deadline:
                    why = f"cannot connect within {timeout:g} s: {exc}"
                    raise UserError(f"broker {self.url}: {why}") from None
            self._stop.wait(delay)
            delay = min(2 * delay, self.settings.reconnect_max_s)
        self._started = True
        self._client.loop_start()
        with self._cond:
            left = max(0.0, deadline - time.monotonic())
            self._cond.wait_for(lambda: self._refused is not None or self._ready(), left)
            refused, ready, connected = self._refused, self._ready(), self._connected
        if ready:
            return
        self._shutdown_client()
        if refused is not None:
            hint = " (check username and password)" if "authori" in refused.lower() else ""
            raise UserError(f"broker {self.url} refused the connection: {refused}{hint}")
        what = "did not acknowledge the subscriptions" if connected else "no MQTT answer"
        raise UserError(f"broker {self.url}: {what} within {timeout:g} s")

    @property
    def connected(self) -> bool:
        return self._connected

    def wait_ready(self, timeout: float) -> bool:
        """Wait until connected with every subscription acknowledged; whether it is."""
        with self._cond:
            return self._cond.wait_for(self._ready, timeout)

    def _ready(self) -> bool:
        return self._connected and self._wanted() <= self._active

    def _wanted(self) -> set[str]:
        stages = {t for topics in self._stage_topics.values() for t in topics}
        return stages | set(self._control)

    def _on_connect(self, _c: Any, _u: Any, _f: Any, reason: Any, _p: Any) -> None:
        self._net_thread = threading.get_ident()
        with self._cond:
            if reason.is_failure:
                self._refused = str(reason)
            else:
                self._connected, self._refused = True, None
                self._connects += 1
                self.reconnects = self._connects - 1
                self._active.clear()
                self._pending.clear()
                self._subscribe_locked(sorted(self._wanted()))
            self._cond.notify_all()
        if reason.is_failure:
            log.warning("broker %s refused the connection: %s", self.url, reason)
        elif self.reconnects:
            log.info("reconnected to broker %s", self.url)

    def _on_disconnect(self, _c: Any, _u: Any, _f: Any, reason: Any, _p: Any) -> None:
        with self._cond:
            self._connected = False
            self._active.clear()
            self._pending.clear()
            self._cond.notify_all()
        if not self._closed:
            log.warning("lost the broker %s (%s); reconnecting", self.url, reason)

    # -- subscriptions -------------------------------------------------------------

    def _subscribe_locked(self, topics: list[str]) -> None:
        # With self._cond held, which is safe across client.subscribe (it only queues a
        # packet) and makes the mid known before its SUBACK can be handled.
        if topics and self._connected:
            rc, mid = self._client.subscribe([(t, self._control.get(t, 1)) for t in topics])
            if rc == mqtt.MQTT_ERR_SUCCESS and mid is not None:
                self._pending[mid] = topics

    def _on_subscribe(self, _c: Any, _u: Any, mid: int, reasons: list[Any], _p: Any) -> None:
        with self._cond:
            for topic, reason in zip(self._pending.pop(mid, []), reasons, strict=False):
                if reason.is_failure:
                    log.warning("broker %s refused subscription %s: %s", self.url, topic, reason)
                else:
                    self._active.add(topic)
            self._cond.notify_all()

    def _await_subscribed_locked(self, topics: list[str]) -> None:
        if threading.get_ident() == self._net_thread or not self._started:
            return  # a callback cannot wait for its own thread; connect() waits instead
        wait_s = self.settings.subscribe_timeout_s
        if not self._cond.wait_for(lambda: set(topics) <= self._active, wait_s):
            raise TimeoutError(
                f"broker {self.url}: subscription to {topics[0]} not acknowledged in {wait_s:g} s"
            )

    def subscribe(self, topic: str, callback: ControlCallback, qos: int = 1) -> None:
        """Call ``callback(topic, payload)`` for each message on ``topic`` (a filter).

        The callback runs on paho's network thread: it must be quick and must not
        wait for more traffic from this transport. Its exceptions are logged and
        counted (``callback-error``). Kept across reconnects; when connected,
        returns once the broker acknowledged it.
        """

        def deliver(_c: Any, _u: Any, msg: mqtt.MQTTMessage) -> None:
            try:
                callback(msg.topic, bytes(msg.payload))
            except Exception:
                log.exception("control callback for %s failed", topic)
                self._count_drop("callback-error")
            # paho skips on_message when a filter matched: a filter that also covers
            # attached stages' topics must not take their frames from them.
            parsed = parse_stage_topic(msg.topic)
            if parsed is not None and self._inboxes_for(parsed):
                self._on_message(_c, _u, msg)

        self._client.message_callback_add(topic, deliver)
        with self._cond:
            self._control[topic] = qos
            self._subscribe_locked([topic])
            self._await_subscribed_locked([topic])

    def unsubscribe(self, topic: str) -> None:
        """End a control subscription made with :meth:`subscribe`."""
        with self._cond:
            self._control.pop(topic, None)
            self._active.discard(topic)
            self._retired.append(topic)  # messages already on their way are expected
            if self._connected:
                self._client.unsubscribe(topic)
        self._client.message_callback_remove(topic)

    # -- stages --------------------------------------------------------------------

    def attach(self, job: str, stage: int, member: int = 0, *, members: int = 1) -> Inbox:
        """Subscribe to the ``fwd`` and ``bwd`` topics of ``member`` of ``stage`` of ``job``
        (and, in a group of ``members``, its ``reduce`` topic from each other member and
        each other member's ``gather`` topic); its inbox.

        When connected, returns after the broker acknowledged the subscription, so
        every frame sent from then on arrives (or raises :class:`TimeoutError`,
        attaching nothing). Called on paho's thread (from a control callback) it
        cannot wait: call :meth:`wait_ready` from another thread before frames flow.
        """
        key, inbox = (job, stage, member), Inbox(job, stage, member)
        topics = [stage_topic(job, stage, ch, member) for ch in _CHANNELS]
        others = [m for m in range(members) if m != member]
        topics += [stage_topic(job, stage, "reduce", member, m) for m in others]
        topics += [stage_topic(job, stage, "gather", sender=m) for m in others]
        with self._cond:
            if self._closed:
                raise RuntimeError("the MQTT transport is closed")
            if key in self._inboxes:
                raise ValueError(f"job {job} stage {stage} member {member} is already attached")
            self._inboxes[key] = inbox
            self._stage_topics[key] = topics
            self._subscribe_locked(topics)
            try:
                self._await_subscribed_locked(topics)
            except TimeoutError:
                self._forget_locked(key)
                raise
        return inbox

    def detach(self, job: str, stage: int, member: int = 0) -> None:
        """Unsubscribe ``member`` of ``stage`` of ``job`` and close its inbox (a no-op if
        not attached)."""
        with self._cond:
            inbox = self._forget_locked((job, stage, member))
        if inbox is not None:
            inbox.close()

    def _forget_locked(self, key: tuple[str, int, int]) -> Inbox | None:
        # Members of one stage on this client share the gather topics: keep those still wanted.
        topics = sorted(set(self._stage_topics.pop(key, [])) - self._wanted())
        self._active.difference_update(topics)
        inbox = self._inboxes.pop(key, None)
        if inbox is not None and self._connected and topics:
            self._client.unsubscribe(topics)
        return inbox

    def _on_message(self, _c: Any, _u: Any, msg: mqtt.MQTTMessage) -> None:
        """Frames for attached stages to their inboxes; anything else is counted and dropped.

        paho calls this for every message no control filter matches. Stage topics
        are routed here rather than through paho's per-filter dispatch, which costs
        more per message than the whole routing below.
        """
        try:  # never raise here: an exception would end paho's network thread
            parsed = parse_stage_topic(msg.topic)
            inboxes = self._inboxes_for(parsed) if parsed else []
            if parsed is None or not inboxes:
                reason = "other-topic" if parsed is None else "unattached"
                self._count_drop(reason)
                late = any(mqtt.topic_matches_sub(f, msg.topic) for f in self._retired)
                (log.debug if late else log.warning)(
                    "dropped a message from broker %s on %s: %s", self.url, msg.topic, reason
                )
                return
            self.frames_received += 1  # only this thread writes the receive counters
            self.bytes_received += len(msg.payload)
            channel, sender = cast(Channel, parsed[2]), parsed[4]  # the topic's sender
            for inbox in inboxes:
                if self.link is None:
                    inbox.deliver(msg.payload, channel, sender)
                else:
                    self.link.down.put((inbox, msg.payload, channel, sender), len(msg.payload))
        except ConnectionError as exc:  # the emulated link's queue is full
            self._count_drop("link-full")
            log.warning("dropped a frame from broker %s: %s", self.url, exc)
        except Exception:  # a topic that is not UTF-8, or a bug
            log.exception("a message from broker %s could not be routed", self.url)
            self._count_drop("callback-error")

    def _inboxes_for(self, parsed: tuple[str, int, str, int | None, int | None]) -> list[Inbox]:
        """The attached inboxes a stage topic's message is for: its member's, or on
        ``gather`` (no member named) every member of the stage here but the sender."""
        job, stage, _, member, sender = parsed
        if member is not None:
            inbox = self._inboxes.get((job, stage, member))
            return [] if inbox is None else [inbox]
        attached = self._inboxes.copy()  # one step under the GIL: attach may add one meanwhile
        return [
            inbox
            for (j, s, m), inbox in attached.items()
            if j == job and s == stage and m != sender
        ]

    def _count_drop(self, reason: str) -> None:
        with self._counts:
            self.dropped[reason] += 1

    # -- sending -------------------------------------------------------------------

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
        """Publish ``frame`` to ``member`` of ``stage`` of ``job`` at QoS 1 (on ``reduce``, on
        the topic of member ``sender``, which the broker lets only that member publish
        on; on ``gather``, once on ``sender``'s topic, which every other member of the
        stage reads); never waits for the network.

        With link shaping the frame is queued on the emulated link and published
        later; a full link queue raises :class:`ConnectionError` at once.
        """
        topic = stage_topic(job, stage, channel, 0 if channel == "gather" else member, sender)
        if self.link is None:
            self._publish(topic, frame, 1, False, count=True)
            return
        if self._closed:
            raise RuntimeError("the MQTT transport is closed")
        data = _payload(frame)
        self.link.up.put((topic, data), len(data))

    def _release_up(self, item: _Up) -> None:
        # On the shaper's thread, also while close() drains the link.
        try:
            self._publish(item[0], item[1], 1, False, count=True, released=True)
        except ConnectionError as exc:  # counted as queue-full; the receiver's take times out
            log.warning("a frame off the emulated link was lost: %s", exc)

    @staticmethod
    def _release_down(item: _Down) -> None:
        item[0].deliver(item[1], item[2], item[3])

    def publish(self, topic: str, payload: bytes | str, qos: int = 1, retain: bool = False) -> None:
        """Publish a control message. QoS 0 messages are lost while disconnected."""
        self._publish(topic, payload, qos, retain)

    def _publish(
        self,
        topic: str,
        payload: bytes | bytearray | str,
        qos: int,
        retain: bool,
        count: bool = False,
        released: bool = False,
    ) -> None:
        if self._closed and not released:
            raise RuntimeError("the MQTT transport is closed")
        data = _payload(payload)
        with self._pub_lock:
            info = self._client.publish(topic, data, qos, retain)
            if info.rc == mqtt.MQTT_ERR_QUEUE_SIZE:
                self._count_drop("queue-full")
                raise ConnectionError(
                    f"broker {self.url}: {self.settings.max_queued} messages already wait to "
                    f"be sent (is the broker reachable?); not sent: {topic}"
                )
            if qos > 0:
                self._unacked.add(info.mid)
            self._drain_acks_locked()
            if count:
                self.frames_sent += 1
                self.bytes_sent += len(data)

    def _on_publish(self, _c: Any, _u: Any, mid: int, _r: Any, _p: Any) -> None:
        # Runs under paho's message lock, which a sender holds inside publish(): so it
        # takes no lock at all (deque.append is atomic) and wakes nobody (flush polls).
        self._acks.append(mid)

    def _drain_acks_locked(self) -> None:
        # With self._pub_lock held, every mid acknowledged so far has been recorded.
        while self._acks:
            self._unacked.discard(self._acks.popleft())

    def unacked(self) -> int:
        """QoS-1 messages sent and not yet acknowledged by the broker."""
        with self._pub_lock:
            self._drain_acks_locked()
            return len(self._unacked)

    def flush(self, timeout: float) -> bool:
        """Wait until the broker acknowledged everything sent; whether it did in time.

        With link shaping that includes the frames still on the emulated link.
        """
        deadline, pause = time.monotonic() + timeout, threading.Event()
        while self.unacked() or (self.link is not None and self.link.up.backlog):
            if time.monotonic() >= deadline:
                return False
            pause.wait(0.005)
        return True

    def stats(self) -> dict[str, int]:
        """Every counter, drops as ``dropped.<reason>``, and ``unacked``.

        With link shaping also ``link.up.*`` and ``link.down.*``: frames, bytes,
        dropped, backlog, and ``wait_ms``/``held_ms`` (see
        :class:`~edge.transport.shaping.ShapedDirection`).
        """
        names = ("frames_sent", "bytes_sent", "frames_received", "bytes_received", "reconnects")
        out = {name: int(getattr(self, name)) for name in names}
        out["unacked"] = self.unacked()
        if self.link is not None:
            for key, value in self.link.stats().items():
                if key.endswith("_s"):
                    out[f"link.{key[:-2]}_ms"] = round(value * 1000)
                else:
                    out[f"link.{key}"] = int(value)
        with self._counts:
            return out | {f"dropped.{k}": v for k, v in self.dropped.items()}

    # -- shutdown ------------------------------------------------------------------

    def close(self, flush_timeout: float = 2.0) -> None:
        """Wait (bounded) for unacknowledged sends, disconnect, stop paho's thread.

        Every inbox is closed; a second call does nothing. With link shaping, the
        frames still on the emulated link go out (shaped) within ``flush_timeout``
        too, and the shaper's threads stop.
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
            inboxes = list(self._inboxes.values())
            self._inboxes.clear()
            self._stage_topics.clear()
        self._stop.set()
        for inbox in inboxes:
            inbox.close()
        deadline = time.monotonic() + flush_timeout
        if self.link is not None:
            self.link.down.close(0.0)  # the inboxes are closed: nobody would take those
            self.link.up.close(flush_timeout)  # publishes on its own thread, not paho's
        if self._started:
            if self._connected and threading.get_ident() != self._net_thread:
                # paho's thread would wait for its own acks
                self.flush(max(0.0, deadline - time.monotonic()))
            self._shutdown_client()

    def _shutdown_client(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()
        self._started = False
