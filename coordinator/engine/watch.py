"""Watching devices: the one subscription to their status, profile and heartbeat topics.

:class:`DeviceFeed` is how anything in the coordinator hears from devices: the
service's registry, a job's :class:`DeviceWatch`, the local fleet waiting for its
agents and the testbed waiting for its own. It subscribes to
``devices/+/status``, ``devices/+/profile`` and ``devices/+/heartbeat``
(:mod:`edge.wire.topics`) for the callbacks it is given, validates each message
(:class:`~edge.wire.messages.DeviceStatus`, :class:`~edge.problem.DeviceSpec`,
:class:`~edge.wire.messages.Heartbeat`), checks that a message naming a device
came from that device's own topic, and hands on ``(device, message)``; anything
else is dropped with one log line. A connection holds one filter per topic, so
one :class:`DeviceFeed` per connection: a job watches on a connection of its own.

:class:`DeviceWatch` says which devices of a job are dead, and since when: a
device is dead when its retained status turns ``offline`` (its MQTT last will,
sent by the broker the moment the connection drops, or its own goodbye;
confirmed after :data:`CONFIRM_S`, as a broker shutting down sends every
client's will) or when no heartbeat came for ``heartbeat_timeout_s`` while the
coordinator itself had the broker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from pydantic import ValidationError

from edge.problem import DeviceSpec
from edge.transport.mqtt import MqttTransport
from edge.wire.messages import DeviceStatus, Heartbeat
from edge.wire.topics import device_heartbeat, device_profile, device_status

__all__ = ["CONFIRM_S", "RECONNECT_GRACE_S", "DeviceFeed", "DeviceWatch"]

log = logging.getLogger(__name__)

CONFIRM_S = 0.3
"""An offline status counts once the broker connection outlived it by this long."""
RECONNECT_GRACE_S = 35.0
"""After the broker came back, heartbeats are not judged for this long (an agent's
reconnect back-off is at most 30 s by default)."""

StatusCallback = Callable[[str, DeviceStatus], None]
ProfileCallback = Callable[[str, DeviceSpec], None]
HeartbeatCallback = Callable[[str, Heartbeat], None]


class DeviceFeed:
    """Validated device messages from ``control``, to the callbacks given (see the module
    docstring). Callbacks run on paho's network thread: quick, and never waiting on it."""

    def __init__(
        self,
        control: MqttTransport,
        *,
        on_status: StatusCallback | None = None,
        on_profile: ProfileCallback | None = None,
        on_heartbeat: HeartbeatCallback | None = None,
    ) -> None:
        self.control = control
        self._routes: list[tuple[str, Callable[[str, bytes], None], int]] = []
        # Profiles before statuses: retained messages arrive in the order of the
        # subscriptions, so a device is known by its profile when its status says online.
        if on_profile is not None:
            self._routes.append((device_profile("+"), self._profile(on_profile), 1))
        if on_status is not None:
            self._routes.append((device_status("+"), self._status(on_status), 1))
        if on_heartbeat is not None:
            self._routes.append((device_heartbeat("+"), self._heartbeat(on_heartbeat), 0))
        self._started = False

    def start(self) -> DeviceFeed:
        """Subscribe (retained statuses and profiles arrive at once); idempotent."""
        if not self._started:
            for topic, deliver, qos in self._routes:
                self.control.subscribe(topic, deliver, qos=qos)
            self._started = True
        return self

    def stop(self) -> None:
        if self._started:
            for topic, _deliver, _qos in self._routes:
                self.control.unsubscribe(topic)
            self._started = False

    def __enter__(self) -> DeviceFeed:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    @staticmethod
    def _device_of(topic: str) -> str:
        return topic.split("/")[-2]

    def _status(self, callback: StatusCallback) -> Callable[[str, bytes], None]:
        def deliver(topic: str, payload: bytes) -> None:
            device = self._device_of(topic)
            try:
                status = DeviceStatus.model_validate_json(payload)
            except ValidationError:
                log.warning("ignored a malformed status on %s", topic)
                return
            if status.device != device:
                log.warning("ignored a status for %s on %s's topic", status.device, device)
                return
            callback(device, status)

        return deliver

    def _profile(self, callback: ProfileCallback) -> Callable[[str, bytes], None]:
        def deliver(topic: str, payload: bytes) -> None:
            device = self._device_of(topic)
            try:
                spec = DeviceSpec.model_validate_json(payload)
            except ValidationError:
                log.warning("ignored a malformed profile from %s", device)
                return
            callback(device, spec)

        return deliver

    def _heartbeat(self, callback: HeartbeatCallback) -> Callable[[str, bytes], None]:
        def deliver(topic: str, payload: bytes) -> None:
            device = self._device_of(topic)
            try:
                beat = Heartbeat.model_validate_json(payload)
            except ValidationError:
                return  # heartbeats are frequent: no log line each
            if beat.device == device:
                callback(device, beat)

        return deliver


class DeviceWatch:
    """Which of ``devices`` are dead, and since when (see the module docstring)."""

    def __init__(
        self, control: MqttTransport, devices: Iterable[str], heartbeat_timeout_s: float = 3.0
    ) -> None:
        self.control = control
        self.timeout_s = heartbeat_timeout_s
        self.devices = set(devices)
        self._seen = dict.fromkeys(self.devices, time.monotonic())
        self.dead: dict[str, tuple[float, str]] = {}
        """Device -> (``time.time()`` of detection, why)."""
        self._lock = threading.Lock()
        self._feed = DeviceFeed(control, on_status=self._on_status, on_heartbeat=self._on_heartbeat)
        self._reconnects = control.reconnects
        self._grace_until = 0.0
        self._heard: dict[str, float] = {}  # only real messages, unlike _seen
        self._suspects: dict[str, tuple[float, float]] = {}
        """Devices reported offline: (when, monotonic) until confirmed (see dead_among)."""

    def __enter__(self) -> DeviceWatch:
        self._feed.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._feed.stop()

    def follow(self, devices: Iterable[str]) -> None:
        """Watch these too (devices that joined); their heartbeat clock starts now."""
        with self._lock:
            for device in devices:
                if device not in self.devices:
                    self.devices.add(device)
                    self._seen[device] = time.monotonic()

    def alive(self, devices: Iterable[str]) -> list[str]:
        """Those of ``devices`` not known to be dead, in their order."""
        with self._lock:
            return [d for d in devices if d not in self.dead]

    def _on_status(self, device: str, status: DeviceStatus) -> None:
        if device not in self.devices:
            return
        # Any offline is news: a running agent replaced the retained status with its
        # own online when it connected, and the last will was set before that.
        with self._lock:
            if status.state == "offline":  # confirmed by dead_among, unless the broker goes
                self._suspects.setdefault(device, (time.time(), time.monotonic()))
            else:
                self._seen[device] = self._heard[device] = time.monotonic()
                self._suspects.pop(device, None)

    def _on_heartbeat(self, device: str, _beat: Heartbeat) -> None:
        if device in self.devices:
            with self._lock:
                self._seen[device] = self._heard[device] = time.monotonic()

    def wait_heard(self, devices: list[str], since: float, timeout: float) -> list[str]:
        """Wait until each of ``devices`` was heard after ``since`` (monotonic); the silent."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                silent = [d for d in devices if self._heard.get(d, -1.0) < since]
            if not silent or time.monotonic() >= deadline:
                return silent
            time.sleep(0.05)

    def _mark(self, device: str, why: str, when: float | None = None) -> None:
        with self._lock:
            self._suspects.pop(device, None)
            if device not in self.dead:
                self.dead[device] = (when or time.time(), why)
                log.warning("device %s is dead: %s", device, why)

    def settle(self, timeout_s: float = 2 * CONFIRM_S) -> None:
        """Wait (at most ``timeout_s``) until no offline report awaits confirmation.

        Devices that die together (two agents killed at once) send their last wills
        milliseconds apart, so the first may be confirmed while the next is still a
        suspect; recovering then would plan over a dead device and recover again.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            self.dead_among(())
            with self._lock:
                if not self._suspects or time.monotonic() >= deadline:
                    return
            time.sleep(0.05)

    def dead_among(self, devices: Iterable[str]) -> list[str]:
        """Those of ``devices`` that are dead, checking heartbeats first.

        Heartbeats are not judged while this side has no broker, and the clocks
        restart when it is back: the silence was the broker's, not the devices'.
        """
        now = time.monotonic()
        if self.control.reconnects != self._reconnects or not self.control.connected:
            # A broker that shuts down publishes every client's last will: offline
            # reports that came just before losing it prove nothing.
            self._reconnects = self.control.reconnects
            with self._lock:
                self._seen = dict.fromkeys(self._seen, now)
                self._suspects.clear()
            # Agents back off between reconnects (up to their reconnect_max_s): give them
            # time to find the broker again before their silence counts.
            self._grace_until = now + RECONNECT_GRACE_S
        with self._lock:
            confirmed = [(d, t) for d, (t, m) in self._suspects.items() if now - m >= CONFIRM_S]
        for device, when in confirmed:
            self._mark(device, "offline (last will or goodbye)", when)
        if self.control.connected and now >= self._grace_until:
            for device, seen in list(self._seen.items()):
                if now - seen > self.timeout_s:
                    self._mark(device, f"no heartbeat for {now - seen:.1f} s")
        with self._lock:
            return [d for d in devices if d in self.dead]
