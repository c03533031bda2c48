"""MQTT v5 clients on every broker the project starts (issue 31, item 5).

Agents speak MQTT 3.1.1; a user's own tools may speak v5. A paho-mqtt 2.x client with
``protocol=MQTTv5`` logs in with a device's account (the project's own accounts and
rules: :mod:`coordinator.access.accounts`), subscribes to the one topic a device may
both read and write (its own probe topic), publishes there and gets its message back,
on:

- the Mosquitto that ``edgetrain train``, ``coordinator`` and ``demo`` start
  (:func:`coordinator.local.owned.start_owned_broker`; ``testbed up`` writes the same
  config): nothing announced in CONNACK, so no limit but MQTT's own
  ([Note: the broker's packet limit] in :mod:`coordinator.local.broker`), and the
  largest frame an agent sends still passes (slow);
- a Mosquitto started for one job (``max_packet``): its limit announced as Maximum
  Packet Size, and kept;
- Mosquitto with the config ``testbed compose`` writes for its broker's container (no
  Docker engine here: this machine's Mosquitto, only the paths and port changed),
  once a coordinator's accounts attached to it created the agents' accounts;
- the embedded amqtt broker, which speaks MQTT 3.1.1 only: a v5 client is refused at
  once with CONNACK 0x01 (paho: Unsupported Protocol Version), secure or anonymous,
  while the same login over 3.1.1 gets in.
"""

from __future__ import annotations

import os
import queue
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode
from support.markers import needs_mosquitto
from support.mosquitto import owned_mosquitto
from support.waiting import until

import coordinator.local.broker as broker_mod
from coordinator.access.accounts import BrokerAccounts
from coordinator.local.broker import (
    HOST,
    find_dynsec_plugin,
    find_mosquitto,
    free_port,
    running_broker,
    start_broker,
)
from coordinator.local.owned import OwnedBroker, start_owned_broker
from coordinator.planner.build import parse_fleet
from coordinator.testbed.compose import BROKER_PORT, INSTALLED
from coordinator.testbed.compose_secrets import PLUGIN, write_secrets
from coordinator.testbed.sizing import emulate
from edge.transport.credentials import Credentials, device_client_id, read_credentials
from edge.transport.mqtt import MqttTransport
from edge.transport.settings import MqttSettings, parse_broker_url, tls_context
from edge.wire.topics import device_probe

TIMEOUT = 10.0
DEVICE = "v5-tool"

Test = TypeVar("Test", bound=Callable[..., None])


def on_mosquitto(test: Test) -> Test:
    """``needs_mosquitto`` on one test: the amqtt ones here need no Mosquitto."""
    for mark in needs_mosquitto:
        test = mark(test)
    return test


class Client:
    """A paho client (callback API v2) of ``protocol``, its network loop in a thread:
    its CONNACK, SUBACKs, disconnects and messages in queues, waited for, never slept on."""

    def __init__(
        self,
        url: str,
        client_id: str,
        settings: MqttSettings | None = None,
        protocol: mqtt.MQTTProtocolVersion = mqtt.MQTTv5,
    ) -> None:
        self.events: queue.Queue[tuple[str, object, object]] = queue.Queue()
        self.messages: queue.Queue[tuple[str, bytes]] = queue.Queue()
        c = mqtt.Client(
            callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
            client_id=client_id,
            protocol=protocol,
        )
        c.reconnect_delay_set(60, 60)  # one answer per test: no quick retries
        if settings is not None and settings.username is not None:
            assert settings.password is not None
            c.username_pw_set(settings.username, settings.password.get_secret_value())
        if url.startswith("mqtts://"):
            assert settings is not None, "TLS needs the broker's CA"
            c.tls_set_context(tls_context(settings))
        c.on_connect = lambda _c, _u, _f, rc, props: self.events.put(("connack", rc, props))
        c.on_subscribe = lambda _c, _u, _m, rcs, _p: self.events.put(("suback", rcs, None))
        c.on_disconnect = lambda _c, _u, _f, rc, _p: self.events.put(("disconnect", rc, None))
        c.on_message = lambda _c, _u, msg: self.messages.put((msg.topic, bytes(msg.payload)))
        _scheme, host, port = parse_broker_url(url)
        c.connect(host, port, keepalive=30)
        c.loop_start()
        self.mqtt = c
        rc, props = self.wait("connack")
        assert isinstance(rc, ReasonCode) and isinstance(props, Properties)
        self.reason, self.properties = rc, props

    def wait(self, kind: str) -> tuple[object, object]:
        """The next event of ``kind`` (others skipped) within :data:`TIMEOUT`."""
        deadline = time.monotonic() + TIMEOUT
        while (left := deadline - time.monotonic()) > 0:
            try:
                got, value, extra = self.events.get(timeout=left)
            except queue.Empty:
                break
            if got == kind:
                return value, extra
        raise AssertionError(f"no {kind} within {TIMEOUT} s")

    def round_trip(self, topic: str, payload: bytes) -> bytes:
        """Subscribe to ``topic``, publish ``payload`` there at QoS 1; what came back."""
        self.mqtt.subscribe(topic, qos=1)
        codes, _ = self.wait("suback")
        assert isinstance(codes, list) and not any(c.is_failure for c in codes), codes
        info = self.mqtt.publish(topic, payload, qos=1)
        info.wait_for_publish(timeout=TIMEOUT)
        assert info.is_published(), topic
        got_topic, got = self.messages.get(timeout=TIMEOUT)
        assert got_topic == topic
        return got

    def close(self) -> None:
        self.mqtt.disconnect()
        self.mqtt.loop_stop()


@contextmanager
def client(
    url: str,
    client_id: str,
    settings: MqttSettings | None = None,
    protocol: mqtt.MQTTProtocolVersion = mqtt.MQTTv5,
) -> Iterator[Client]:
    c = Client(url, client_id, settings, protocol)
    try:
        yield c
    finally:
        c.close()


def _round_trips(url: str, creds: Credentials) -> Client:
    """A v5 client logged in as ``creds``' device, its own probe topic there and back."""
    with client(url, device_client_id(creds.device_id), creds.settings()) as c:
        assert not c.reason.is_failure, c.reason
        payload = b"v5 " + os.urandom(16)
        assert c.round_trip(device_probe(creds.device_id), payload) == payload
        return c


@on_mosquitto
def test_a_v5_client_uses_the_owned_mosquitto() -> None:
    with owned_mosquitto() as owned:
        assert owned.accounts is not None
        creds = owned.accounts.enroll(DEVICE).model_copy(update={"broker": owned.url})
        c = _round_trips(owned.url, creds)
        # MQTT's own limit: nothing announced (paho refused 268,435,460 as malformed).
        assert not hasattr(c.properties, "MaximumPacketSize")


@on_mosquitto
def test_a_jobs_limit_is_announced_and_kept() -> None:
    limit = 1 << 20
    broker = start_broker("mosquitto", max_packet=limit)
    try:
        with client(broker.url, "v5-limited") as c:
            assert not c.reason.is_failure, c.reason
            assert getattr(c.properties, "MaximumPacketSize", None) == limit
            assert c.round_trip("edgetrain/v1/probe", b"x" * (limit // 2)) == b"x" * (limit // 2)
        with client(broker.url, "v311-over", protocol=mqtt.MQTTv311) as big:
            big.mqtt.publish("edgetrain/v1/probe", b"x" * (limit + 1), qos=1)
            big.wait("disconnect")  # Mosquitto drops a client that sends more
    finally:
        broker.stop()


@on_mosquitto
@pytest.mark.slow  # 256 MiB through the broker: about 12 s here
def test_the_largest_frame_an_agent_sends_passes_the_default_mosquitto() -> None:
    with running_broker("mosquitto") as broker:
        largest = 268_435_455 - 1024  # edge.transport.mqtt's _MAX_PAYLOAD: MQTT's limit
        got: queue.Queue[int] = queue.Queue()
        receiver = MqttTransport(MqttSettings(url=broker.url))
        sender = MqttTransport(MqttSettings(url=broker.url))
        try:
            receiver.connect(timeout=TIMEOUT)
            receiver.subscribe("edgetrain/v1/big", lambda _t, payload: got.put(len(payload)))
            sender.connect(timeout=TIMEOUT)
            sender.publish("edgetrain/v1/big", bytes(largest), qos=1)
            assert got.get(timeout=120) == largest
        finally:
            sender.close()
            receiver.close()


@contextmanager
def compose_mosquitto(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """Mosquitto with the ``mosquitto.conf`` that ``testbed compose`` writes for its broker,
    its paths and port moved here; its URL and the secrets directory."""
    binary, plugin = find_mosquitto(), find_dynsec_plugin()
    assert binary is not None
    if plugin is None:
        pytest.skip("mosquitto's dynamic-security plugin is not installed")
    secrets = tmp_path / "secrets"
    write_secrets(emulate(parse_fleet("rpi4-4gb"), cpus=4), secrets, "mosquitto")
    conf = (secrets / "broker" / "mosquitto.conf").read_text()
    installed = Path(tempfile.mkdtemp(prefix="edgetrain-compose-broker-"))
    port = free_port(HOST)
    proc: subprocess.Popen[bytes] | None = None
    try:
        # As the container's entry point does: a copy Mosquitto's own user may read.
        files = [shutil.copy(p, installed) for p in (secrets / "broker").iterdir()]
        broker_mod._give_to_mosquitto(installed, *(Path(f) for f in files))
        for old, new in (
            (INSTALLED, str(installed)),
            (PLUGIN, plugin),
            (f"listener {BROKER_PORT}\n", f"listener {port} {HOST}\n"),
        ):
            assert old in conf, old
            conf = conf.replace(old, new)
        (installed / "mosquitto.conf").write_text(conf)
        log_path = tmp_path / "mosquitto.log"
        with log_path.open("ab") as log:
            proc = subprocess.Popen(
                [binary, "-c", str(installed / "mosquitto.conf")],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )

        def listening() -> bool:
            assert proc is not None and proc.poll() is None, log_path.read_text()
            with socket.socket() as s:
                return s.connect_ex((HOST, port)) == 0

        assert until(listening, TIMEOUT, 0.05), f"mosquitto did not listen on {HOST}:{port}"
        yield f"mqtts://{HOST}:{port}", secrets
    finally:
        if proc is not None:
            proc.terminate()  # this pid only
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        shutil.rmtree(installed, ignore_errors=True)


@on_mosquitto
def test_a_v5_client_uses_the_compose_brokers_config(tmp_path: Path) -> None:
    with compose_mosquitto(tmp_path) as (url, secrets):
        assert "max_packet_size" not in (secrets / "broker" / "mosquitto.conf").read_text()
        ca = (secrets / "broker" / "ca.pem").read_text()
        accounts = BrokerAccounts(secrets / "coordinator", url, ca)
        admin = MqttTransport(accounts.login(url))  # as the compose coordinator starts
        admin.connect(timeout=TIMEOUT)
        try:
            accounts.attach(admin)
            (device,) = accounts.devices()
            creds = read_credentials(secrets / f"agent-{device}" / "credentials.json")
            c = _round_trips(url, creds.model_copy(update={"broker": url}))
            assert not hasattr(c.properties, "MaximumPacketSize")
        finally:
            admin.close()


@pytest.fixture(scope="module")
def owned_amqtt() -> Iterator[OwnedBroker]:
    with tempfile.TemporaryDirectory(prefix="edgetrain-amqtt-v5-") as tmp:
        owned = start_owned_broker(Path(tmp) / "broker", prefer="amqtt")
        try:
            yield owned
        finally:
            owned.stop()


def test_amqtt_refuses_a_v5_client_at_once(owned_amqtt: OwnedBroker) -> None:
    assert owned_amqtt.broker.kind == "amqtt" and owned_amqtt.accounts is not None
    creds = owned_amqtt.accounts.enroll(DEVICE).model_copy(update={"broker": owned_amqtt.url})
    # Before, amqtt read a v5 CONNECT's login as 3.1.1's and waited for bytes that never
    # came: no answer at all.
    with client(owned_amqtt.url, device_client_id(DEVICE), creds.settings()) as c:
        assert c.reason == ReasonCode(mqtt.PacketTypes.CONNACK, "Unsupported protocol version")
        c.wait("disconnect")
    with client(
        owned_amqtt.url, device_client_id(DEVICE), creds.settings(), protocol=mqtt.MQTTv311
    ) as c:  # the same login in MQTT 3.1.1
        assert not c.reason.is_failure, c.reason
        assert c.round_trip(device_probe(DEVICE), b"3.1.1") == b"3.1.1"


def test_the_anonymous_amqtt_refuses_a_v5_client_too() -> None:
    with running_broker("amqtt") as broker:  # the testbed's, without Mosquitto
        with client(broker.url, "v5-anonymous") as c:
            assert c.reason == ReasonCode(mqtt.PacketTypes.CONNACK, "Unsupported protocol version")
        with client(broker.url, "v311-anonymous", protocol=mqtt.MQTTv311) as c:
            assert c.round_trip("edgetrain/v1/probe", b"3.1.1") == b"3.1.1"
