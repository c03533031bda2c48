"""The embedded amqtt broker, secure: TLS, accounts and ACLs that follow the plan, as Mosquitto.

The broker is the one ``edgetrain train`` and ``coordinator`` start on a machine
without Mosquitto (:func:`coordinator.local.owned.start_owned_broker` with
``prefer="amqtt"``). A short version of tests/security/test_attacker.py's attacks,
made with paho clients over TLS (the real CA: TLS is not the bar): anonymous and
wrong-password logins are refused at CONNACK; an enrolled device ("mallory") is
refused publishing on another device's command and status topics and on a job's
topics, subscribing to them, and taking over another device's client id (which
leaves the victim connected and subscribed); a will on another's topic is refused
at CONNACK. Grants open exactly a stage's topics and ``release`` closes them;
revocation disconnects the device and it cannot log in again. Every refusal is
seen from a spy on the coordinator's account, which may read everything, next to
the same action allowed, so each assertion can fail. Then a real 2-stage job runs
on two agent processes logged in with their credentials files, and ends with the
weights of the plain PyTorch reference.
"""

from __future__ import annotations

import logging
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from support.reference import assert_matches, train_reference
from support.waiting import until

import coordinator.local.broker as broker_mod
from coordinator.access.accounts import BrokerAccounts
from coordinator.engine.options import RunOptions
from coordinator.engine.runners import run_on_agents
from coordinator.engine.spec import JobSpec, new_job_id
from coordinator.local.broker import AmqttBroker
from coordinator.local.fleet import LocalFleet
from coordinator.local.owned import OwnedBroker, start_owned_broker
from coordinator.planner.score import Plan
from edge.transport.credentials import Credentials, device_client_id
from edge.transport.mqtt import MqttTransport
from edge.transport.settings import parse_broker_url, tls_context
from edge.wire.messages import StageAssignment
from edge.wire.topics import (
    TOPIC_ROOT,
    device_cmd,
    device_status,
    job_events,
    stage_topic,
)

TIMEOUT = 5.0
MARK = b"ATTACK-amqtt"


@pytest.fixture(scope="module")
def owned() -> Iterator[OwnedBroker]:
    with tempfile.TemporaryDirectory(prefix="edgetrain-amqtt-") as tmp:
        broker = start_owned_broker(Path(tmp) / "broker", prefer="amqtt")
        try:
            yield broker
        finally:
            broker.stop()


class Client:
    """A paho client over the broker's TLS; its CONNACK, SUBACKs and messages in a queue."""

    def __init__(
        self,
        owned: OwnedBroker,
        creds: Credentials | None,
        client_id: str,
        will: str | None = None,
    ) -> None:
        self.events: queue.Queue[tuple[str, object]] = queue.Queue()
        self.messages: queue.Queue[tuple[str, bytes]] = queue.Queue()
        c = mqtt.Client(
            callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
            client_id=client_id,
            protocol=mqtt.MQTTv311,
        )
        if creds is not None:
            c.username_pw_set(creds.username, creds.password.get_secret_value())
        if will is not None:
            c.will_set(will, MARK, qos=1)
        c.tls_set_context(tls_context(owned.settings()))
        c.on_connect = lambda _c, _u, _f, rc, _p: self.events.put(("connack", rc))
        c.on_subscribe = lambda _c, _u, _m, rcs, _p: self.events.put(("suback", rcs))
        c.on_disconnect = lambda _c, _u, _f, rc, _p: self.events.put(("disconnect", rc))
        c.on_message = lambda _c, _u, msg: self.messages.put((msg.topic, bytes(msg.payload)))
        _scheme, host, port = parse_broker_url(owned.url)
        c.connect(host, port, keepalive=30)
        c.loop_start()
        self.mqtt = c
        self.accepted = not self.wait("connack").is_failure  # type: ignore[attr-defined]

    def wait(self, kind: str) -> object:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            try:
                got, value = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if got == kind:
                return value
        raise AssertionError(f"no {kind} within {TIMEOUT} s")

    def subscribe(self, topic: str) -> bool:
        """Whether the broker granted the subscription."""
        self.mqtt.subscribe(topic, qos=1)
        codes = self.wait("suback")
        return not all(code.is_failure for code in codes)  # type: ignore[attr-defined]

    def publish(self, topic: str, payload: bytes) -> None:
        info = self.mqtt.publish(topic, payload, qos=1)
        info.wait_for_publish(timeout=TIMEOUT)
        assert info.is_published(), topic

    def close(self) -> None:
        self.mqtt.disconnect()
        self.mqtt.loop_stop()


class Spy:
    """The coordinator's account, reading everything under the product's topics."""

    def __init__(self, owned: OwnedBroker) -> None:
        self.seen: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.everything: list[tuple[str, bytes]] = []
        self.transport = MqttTransport(owned.settings())
        self.transport.connect(timeout=10)
        self.transport.subscribe(f"{TOPIC_ROOT}/#", self._on_message)

    def _on_message(self, topic: str, payload: bytes) -> None:
        self.everything.append((topic, bytes(payload)))
        self.seen.put((topic, bytes(payload)))

    def next(self, payload: bytes, timeout: float = TIMEOUT) -> str | None:
        """The topic ``payload`` arrived on within ``timeout`` (others skipped), else ``None``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                topic, got = self.seen.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if got == payload:
                return topic


def _assignment(job: str, stage: int) -> StageAssignment:
    return StageAssignment(
        job=job,
        stage=stage,
        num_stages=2,
        start=stage,
        end=stage + 1,
        model="mlp",
        dataset="digits",
        steps=1,
        batch_size=4,
    )


def test_the_embedded_broker_is_secure(owned: OwnedBroker) -> None:
    accounts = owned.accounts
    assert isinstance(owned.broker, AmqttBroker) and isinstance(accounts, BrokerAccounts)
    assert owned.url.startswith("mqtts://") and owned.describe().endswith("TLS, accounts and ACLs")
    victim, mallory = accounts.enroll("victim"), accounts.enroll("mallory")
    spy = Spy(owned)
    v = Client(owned, victim, device_client_id("victim"))
    m: Client | None = None
    try:
        assert v.accepted
        assert v.subscribe(device_cmd("victim"))

        # No anonymous client, no wrong password, no other device's client id (which
        # leaves the victim connected and subscribed), no will on another's topic.
        wrong = Credentials(
            broker=owned.url,
            device_id="victim",
            username="victim",
            password="nope",  # type: ignore[arg-type]
        )
        refused = [
            Client(owned, None, "eve"),
            Client(owned, None, device_client_id("victim")),
            Client(owned, wrong, device_client_id("victim")),
            Client(owned, mallory, device_client_id("victim")),
            Client(owned, mallory, device_client_id("mallory"), will=device_cmd("victim")),
        ]
        assert [c.accepted for c in refused] == [False] * len(refused)
        for c in refused:
            c.close()
        own_will = Client(owned, mallory, device_client_id("mallory"), will=device_status("x"))
        assert not own_will.accepted
        own_will.close()
        m = Client(owned, mallory, device_client_id("mallory"), will=device_status("mallory"))
        assert m.accepted  # a will on its own status topic is fine
        spy.transport.publish(device_cmd("victim"), b"from the coordinator", 1)
        assert v.messages.get(timeout=TIMEOUT) == (device_cmd("victim"), b"from the coordinator")

        # Mallory publishes on the victim's topics and a job's: nobody receives any of it;
        # the victim's own status goes through.
        job = new_job_id()
        accounts.grant(job, [("victim", _assignment(job, 1))])
        for topic in (
            device_cmd("victim"),
            device_status("victim"),
            stage_topic(job, 1, "fwd"),
            job_events(job, "mallory"),
        ):
            m.publish(topic, MARK + topic.encode())
        # Its own status goes through, after all of the above (one client's are in order).
        m.publish(device_status("mallory"), b"mallory online")
        assert spy.next(b"mallory online") == device_status("mallory")
        assert [t for t, p in spy.everything if p.startswith(MARK)] == []
        assert v.messages.empty()
        assert not m.subscribe(stage_topic(job, 1, "fwd"))
        assert not m.subscribe(f"{TOPIC_ROOT}/#")

        # The grant opens the stage's topics to the victim, and release closes them.
        assert v.subscribe(stage_topic(job, 1, "fwd"))
        spy.transport.publish(stage_topic(job, 1, "fwd"), b"activation", 1)
        assert v.messages.get(timeout=TIMEOUT) == (stage_topic(job, 1, "fwd"), b"activation")
        v.publish(stage_topic(job, 0, "bwd"), b"gradient")
        assert spy.next(b"gradient") == stage_topic(job, 0, "bwd")
        accounts.release(job)
        v.publish(stage_topic(job, 0, "bwd"), b"gradient after release")
        spy.transport.publish(stage_topic(job, 1, "fwd"), b"activation after release", 1)
        assert spy.next(b"gradient after release", timeout=1.0) is None
        with pytest.raises(queue.Empty):
            v.messages.get(timeout=1.0)

        # Revocation disconnects the device at once, and it cannot log in again.
        accounts.revoke("victim")
        assert v.wait("disconnect") is not None
        again = Client(owned, victim, device_client_id("victim"))
        assert not again.accepted
        again.close()
    finally:
        for client in (v, m):
            if client is not None:
                client.close()
        spy.transport.close()


def test_each_message_reaches_every_subscriber_while_others_subscribe(owned: OwnedBroker) -> None:
    """amqtt 0.12.1 walked its live subscription table across the ACL plugin's awaits: a
    subscription made meanwhile raised in its broadcast, and the message was lost for
    every subscriber after that point (:meth:`EmbeddedBroker._run_broadcast`). Two
    filters match each message; a third client subscribes to fresh filters throughout."""
    n, topic = 200, f"{TOPIC_ROOT}/fanout"
    got: dict[str, list[bytes]] = {"first": [], "second": []}
    clients = [MqttTransport(owned.settings()) for _ in range(4)]
    first, second, sender, churner = clients
    stop = threading.Event()

    def churn() -> None:
        for i in range(20 * n):  # bounded; ends with the sends
            if stop.is_set():
                return
            churner.subscribe(f"{TOPIC_ROOT}/fresh/{i}", lambda _t, _p: None)

    thread = threading.Thread(target=churn, name="churn")
    try:
        for c in clients:
            c.connect(timeout=10)
        first.subscribe(f"{topic}/#", lambda _t, p: got["first"].append(p))
        second.subscribe(f"{topic}/+", lambda _t, p: got["second"].append(p))
        thread.start()
        for i in range(n):
            sender.publish(f"{topic}/{i}", b"%d" % i, 1)
            time.sleep(0.002)  # below the sender's queue limit, interleaved with the churn
        assert thread.is_alive(), "the churn ended before the sends: nothing overlapped"
        until(lambda: len(got["first"]) + len(got["second"]) == 2 * n, timeout=20)
    finally:
        stop.set()
        if thread.ident is not None:
            thread.join(timeout=30)
        for c in clients:
            c.close()
    assert {k: len(v) for k, v in got.items()} == {"first": n, "second": n}
    assert sorted(got["second"]) == sorted(b"%d" % i for i in range(n))


def test_without_mosquitto_the_owned_broker_is_amqtt_and_secure(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(shutil, "which", lambda *a, **k: None)
    monkeypatch.setattr(broker_mod, "MOSQUITTO_FALLBACK", tmp_path / "no-mosquitto")
    with caplog.at_level(logging.WARNING):
        secure = start_owned_broker(tmp_path / "broker")  # prefer="auto"
    try:
        assert isinstance(secure.broker, AmqttBroker) and secure.secure
        assert secure.url.startswith("mqtts://")
        assert secure.broker.tables is not None
        assert caplog.records == []  # no warning: nothing to warn about
        creds = secure.accounts.enroll("pi-1")  # type: ignore[union-attr]
        clients = [Client(secure, creds, device_client_id("pi-1")), Client(secure, None, "x")]
        assert [c.accepted for c in clients] == [True, False]
        for c in clients:
            c.close()
    finally:
        secure.stop()


def _spec() -> JobSpec:
    return JobSpec(model="mlp", steps=6, batch_size=16, microbatches=2, seed=3)


@pytest.mark.slow
def test_a_job_runs_on_the_embedded_secure_broker(owned: OwnedBroker) -> None:
    """Two agent processes, each logged in with its own credentials file; grants per stage."""
    assert owned.accounts is not None
    control = MqttTransport(owned.settings())
    control.connect(timeout=10)
    try:
        with LocalFleet(2, owned, threads=1) as fleet:
            fleet.wait_online(control, timeout=60)
            assert set(fleet.ids) <= set(owned.accounts.devices())  # each has an account
            plan = Plan.of((fleet.ids[0], 0, 1), (fleet.ids[1], 1, 3))
            result = run_on_agents(
                _spec(), plan, control, options=RunOptions(timeout_s=120, access=owned.accounts)
            )
    finally:
        control.close()
    assert result.rejected == {}
    reference = train_reference("mlp", steps=6, batch_size=16, seed=3)
    assert_matches(result.losses, result.weights, reference)
