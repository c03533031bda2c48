"""The broker a command starts when none is given: Mosquitto here, embedded amqtt otherwise.

Both kinds are driven with paho-mqtt 2.x (callback API v2, MQTT 3.1.1) the way
the agent uses a broker: QoS 1 tensor-sized payloads, a retained status and a
last-will ``offline``.
"""

from __future__ import annotations

import os
import queue
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import psutil
import pytest
from support.markers import needs_mosquitto

import coordinator.local.broker as broker_mod
from coordinator.local.broker import (
    BrokerStartError,
    RunningBroker,
    find_mosquitto,
    free_port,
    running_broker,
    start_broker,
)
from edge.errors import UserError

HAS_MOSQUITTO = find_mosquitto() is not None
KINDS = [pytest.param("mosquitto", marks=needs_mosquitto), "amqtt"]
TIMEOUT = 5.0


class Client:
    """A paho client with its network loop in a thread, and waits instead of sleeps."""

    def __init__(
        self, broker: RunningBroker, client_id: str, auth: tuple[str, str] | None = None
    ) -> None:
        self.messages: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
        self._connected = threading.Event()
        self._subscribed = threading.Event()
        self.mqtt = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311
        )
        self.mqtt.on_connect = self._on_connect
        self.mqtt.on_subscribe = lambda c, u, mid, rcs, p: self._subscribed.set()
        self.mqtt.on_message = lambda c, u, msg: self.messages.put(msg)
        if auth is not None:
            self.mqtt.username_pw_set(*auth)
        self.mqtt.connect(broker.host, broker.port, keepalive=30)
        self.mqtt.loop_start()
        assert self._connected.wait(TIMEOUT), f"{client_id} did not connect to {broker.url}"

    def _on_connect(self, c: object, u: object, f: object, rc: mqtt.ReasonCode, p: object) -> None:
        if not rc.is_failure:
            self._connected.set()

    def subscribe(self, topic: str, qos: int = 1) -> None:
        self._subscribed.clear()
        self.mqtt.subscribe(topic, qos=qos)
        assert self._subscribed.wait(TIMEOUT), f"no SUBACK for {topic}"

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None:
        info = self.mqtt.publish(topic, payload, qos=qos, retain=retain)
        info.wait_for_publish(TIMEOUT)
        assert info.is_published()

    def next(self) -> mqtt.MQTTMessage:
        return self.messages.get(timeout=TIMEOUT)

    def close(self) -> None:
        self.mqtt.disconnect()
        self.mqtt.loop_stop()


@pytest.fixture(params=KINDS)
def broker(request: pytest.FixtureRequest) -> Iterator[RunningBroker]:
    with running_broker(prefer=request.param) as running:
        assert running.kind == request.param
        yield running


def _listening_addresses(pid: int, port: int) -> list[str]:
    conns = psutil.Process(pid).net_connections(kind="inet")
    return [c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN and c.laddr.port == port]


def _hide_mosquitto(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(shutil, "which", lambda *a, **k: None)
    monkeypatch.setattr(broker_mod, "MOSQUITTO_FALLBACK", tmp_path / "no-mosquitto")


@pytest.mark.broker
@pytest.mark.skipif(not HAS_MOSQUITTO, reason="mosquitto binary not found")
def test_auto_picks_mosquitto_here() -> None:
    with running_broker() as running:
        assert running.kind == "mosquitto"
        assert running.url == f"mqtt://127.0.0.1:{running.port}"
        line = running.describe()
        assert line.startswith("mosquitto 2.") and running.url in line
        assert f"(pid {running.pid})" in line and "\n" not in line


def test_auto_falls_back_to_amqtt(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _hide_mosquitto(monkeypatch, tmp_path)
    with running_broker() as running:
        assert running.kind == "amqtt"
        assert running.describe().startswith("amqtt ") and running.url in running.describe()


def test_forced_mosquitto_missing_is_a_user_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _hide_mosquitto(monkeypatch, tmp_path)
    with pytest.raises(UserError, match="mosquitto is not installed") as info:
        start_broker(prefer="mosquitto")
    assert "\n" not in info.value.message


def test_unknown_kind_is_a_user_error() -> None:
    with pytest.raises(UserError, match="unknown broker"):
        start_broker(prefer="rabbitmq")


def test_qos1_one_mib_binary_payload(broker: RunningBroker) -> None:
    payload = os.urandom(1 << 20)
    sub, pub = Client(broker, "sub"), Client(broker, "pub")
    try:
        sub.subscribe("edgetrain/v1/jobs/j/stage/1/fwd", qos=1)
        pub.publish("edgetrain/v1/jobs/j/stage/1/fwd", payload, qos=1)
        msg = sub.next()
        assert msg.topic == "edgetrain/v1/jobs/j/stage/1/fwd"
        assert msg.qos == 1 and msg.payload == payload
    finally:
        sub.close()
        pub.close()


def test_retained_message_reaches_a_late_subscriber(broker: RunningBroker) -> None:
    pub = Client(broker, "dev-1")
    pub.publish("edgetrain/v1/devices/dev-1/status", b"online", retain=True)
    pub.close()
    late = Client(broker, "late")
    try:
        late.subscribe("edgetrain/v1/devices/+/status")
        msg = late.next()
        assert (msg.payload, msg.retain) == (b"online", True)
    finally:
        late.close()


def test_last_will_offline_on_abrupt_loss(broker: RunningBroker) -> None:
    topic = "edgetrain/v1/devices/dev-2/status"
    watcher = Client(broker, "watcher")
    watcher.subscribe(topic)
    # The agent's client: a will, then a retained "online"; its loop is driven by hand
    # so that closing its socket (a crash, a cut link) races with nothing.
    agent = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="dev-2")
    agent.will_set(topic, b"offline", qos=1, retain=True)
    agent.connect(broker.host, broker.port, keepalive=30)
    info = agent.publish(topic, b"online", qos=1, retain=True)
    for _ in range(100):
        if info.is_published():
            break
        agent.loop(timeout=0.05)
    assert info.is_published()
    try:
        assert watcher.next().payload == b"online"
        sock = agent.socket()
        assert isinstance(sock, socket.socket)
        sock.close()  # no DISCONNECT: the broker must send the will
        msg = watcher.next()
        assert msg.payload == b"offline"
    finally:
        watcher.close()
    late = Client(broker, "late")
    try:
        late.subscribe(topic)
        msg = late.next()
        assert (msg.payload, msg.retain) == (b"offline", True)
    finally:
        late.close()


@pytest.mark.parametrize("kind", KINDS)
def test_binds_loopback_only_and_stop_leaves_nothing(kind: str) -> None:
    running = start_broker(prefer=kind)
    try:
        addresses = _listening_addresses(running.pid, running.port)
        assert addresses and set(addresses) == {"127.0.0.1"}
    finally:
        running.stop()
    running.stop()  # a second stop does nothing
    with pytest.raises(OSError):
        socket.create_connection((running.host, running.port), timeout=1).close()
    if isinstance(running, broker_mod.MosquittoBroker):
        assert running.proc.poll() is not None and not psutil.pid_exists(running.pid)
        assert not running.conf_path.parent.exists()  # its temporary directory is gone
    else:
        assert isinstance(running, broker_mod.AmqttBroker)
        assert not running.thread.is_alive()
        assert "edgetrain-amqtt-broker" not in {t.name for t in threading.enumerate()}


@pytest.mark.parametrize("kind", KINDS)
def test_restart_on_the_same_port(kind: str) -> None:
    with running_broker(prefer=kind) as first:
        port = first.port
    with running_broker(prefer=kind, port=port) as second:
        assert second.port == port
        Client(second, "again").close()


@pytest.mark.broker
@pytest.mark.skipif(not HAS_MOSQUITTO, reason="mosquitto binary not found")
def test_mosquitto_tries_another_port_when_the_picked_one_is_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        ports = iter([taken, free_port()])
        monkeypatch.setattr(broker_mod, "free_port", lambda host="127.0.0.1": next(ports))
        with running_broker(prefer="mosquitto") as running:
            assert running.port != taken
        with pytest.raises(BrokerStartError, match="Address already in use"):
            start_broker(prefer="mosquitto", port=taken)


@pytest.mark.broker
@pytest.mark.skipif(not HAS_MOSQUITTO, reason="mosquitto binary not found")
@pytest.mark.parametrize("where", ["_listening", "_mosquitto_version"])
def test_an_interrupt_while_mosquitto_starts_leaves_no_process(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """SIGTERM (``SystemExit`` from :mod:`edgetrain.cli.signals`) or Ctrl-C arriving while
    the broker is waited for, or while its version is asked, stops the process started."""
    started: list[subprocess.Popen[bytes]] = []
    commands: list[list[str]] = []
    popen = subprocess.Popen

    def recording(command: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        proc = popen(command, **kwargs)  # type: ignore[call-overload]
        started.append(proc)
        commands.append(command)
        return proc

    def interrupted(*_args: object) -> bool:
        assert started and started[0].poll() is None  # the broker runs: now the signal
        raise SystemExit(143)

    monkeypatch.setattr(broker_mod.subprocess, "Popen", recording)
    monkeypatch.setattr(broker_mod, where, interrupted)
    with pytest.raises(SystemExit):
        start_broker(prefer="mosquitto")
    assert len(started) == 1 and started[0].poll() is not None  # stopped and reaped
    conf = Path(commands[0][2])  # mosquitto -c CONF, in the broker's own directory
    assert not conf.parent.exists()


@pytest.mark.broker
@pytest.mark.skipif(not HAS_MOSQUITTO, reason="mosquitto binary not found")
def test_mosquitto_log_dir_and_password_file(tmp_path: Path) -> None:
    if shutil.which("mosquitto_passwd") is None:
        pytest.skip("mosquitto_passwd not found")
    passwords = tmp_path / "passwd"
    subprocess.run(["mosquitto_passwd", "-c", "-b", str(passwords), "u", "p"], check=True)
    with running_broker(prefer="mosquitto", log_dir=tmp_path, password_file=passwords) as b:
        anonymous = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv311)
        codes: queue.Queue[mqtt.ReasonCode] = queue.Queue()
        anonymous.on_connect = lambda c, u, f, rc, p: codes.put(rc)
        anonymous.connect(b.host, b.port)
        anonymous.loop_start()
        try:
            assert codes.get(timeout=TIMEOUT).is_failure
        finally:
            anonymous.loop_stop()
        assert isinstance(b, broker_mod.MosquittoBroker)
        assert "allow_anonymous false" in b.conf_path.read_text()
        Client(b, "user", auth=("u", "p")).close()
        assert "not authori" in b.log()  # written as it happens, not when mosquitto exits
    assert not b.conf_path.exists()  # its own directory, password copy included, is gone
    assert "New client connected" in (tmp_path / f"mosquitto-{b.port}.log").read_text()


def test_amqtt_refuses_a_password_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="a password file needs mosquitto"):
        start_broker(prefer="amqtt", password_file=tmp_path / "passwd")
