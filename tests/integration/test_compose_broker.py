"""The broker secrets ``edgetrain testbed compose`` writes, at work in a real Mosquitto.

No Docker engine runs here, so the broker is this machine's Mosquitto started with
the files the compose file mounts into its container: the generated certificate,
key and dynamic-security file (the generated ``mosquitto.conf`` differs only in
its paths, checked in tests/unit/coordinator/testbed/test_compose_secrets.py). On
it: the health check's account reads ``$SYS/broker/uptime`` and nothing else, an
anonymous client is refused, and so is every agent until a coordinator given the
generated accounts record (``EDGETRAIN_BROKER_ACCOUNTS``) has started: it logs in as
the plugin's admin and creates their accounts, and then every agent logs in with
its credentials file.
"""

from __future__ import annotations

import json
import queue
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.markers import needs_mosquitto

from coordinator.access.certs import BrokerTls
from coordinator.local.broker import BrokerSecurity, RunningBroker, start_broker
from coordinator.planner.build import parse_fleet
from coordinator.service.app import start_services
from coordinator.service.settings import Settings
from coordinator.testbed.compose import HEALTH_USER
from coordinator.testbed.compose_secrets import write_secrets
from coordinator.testbed.sizing import EmulatedDevice, emulate
from edge.errors import UserError
from edge.transport.credentials import read_credentials
from edge.transport.mqtt import MqttTransport
from edge.transport.settings import MqttSettings

pytestmark = needs_mosquitto


@pytest.fixture
def fleet() -> list[EmulatedDevice]:
    return emulate(parse_fleet("rpi4-4gb,jetson-nano"), cpus=4)


@pytest.fixture
def secrets(tmp_path: Path, fleet: list[EmulatedDevice]) -> Path:
    where = tmp_path / "secrets"
    write_secrets(fleet, where, "mosquitto")
    return where


@pytest.fixture
def broker(secrets: Path, tmp_path: Path) -> Iterator[RunningBroker]:
    """Mosquitto with the files the compose file gives the broker's container."""
    files = secrets / "broker"
    tls = BrokerTls(files / "server.pem", files / "server.key", files / "ca.pem")
    plugin = json.loads((files / "dynsec.json").read_text())
    running = start_broker("mosquitto", log_dir=tmp_path, security=BrokerSecurity(tls, plugin))
    yield running
    running.stop()


def _connected(settings: MqttSettings) -> MqttTransport:
    transport = MqttTransport(settings)
    transport.connect(timeout=10)
    return transport


def test_the_generated_accounts_are_the_only_way_in(
    secrets: Path, broker: RunningBroker, fleet: list[EmulatedDevice], tmp_path: Path
) -> None:
    ca = (secrets / "broker" / "ca.pem").read_text()
    health = MqttSettings(
        url=broker.url,
        username=HEALTH_USER,
        password=(secrets / "broker" / "health.password").read_text(),  # type: ignore[arg-type]
        tls_ca_pem=ca,
    )
    checker = _connected(health)
    try:
        uptime: queue.Queue[bytes] = queue.Queue()
        checker.subscribe("$SYS/broker/uptime", lambda _t, payload: uptime.put(payload))
        assert uptime.get(timeout=15).endswith(b" seconds")
    finally:
        checker.close()
    nosy = _connected(health.model_copy(update={"subscribe_timeout_s": 2.0}))
    try:  # the same account, for anything else: refused, so never acknowledged
        with pytest.raises(TimeoutError, match="edgetrain/#"):
            nosy.subscribe("edgetrain/#", lambda _t, _p: None)
    finally:
        nosy.close()

    anonymous = MqttTransport(MqttSettings(url=broker.url, tls_ca_pem=ca))
    with pytest.raises(UserError, match="refused the connection"):
        anonymous.connect(timeout=10)

    logins = []
    for e in fleet:
        creds = read_credentials(secrets / f"agent-{e.id}" / "credentials.json")
        assert (creds.broker, creds.device_id, creds.ca) == ("mqtts://mosquitto:8883", e.id, ca)
        logins.append(creds.model_copy(update={"broker": broker.url}).settings())
    with pytest.raises(UserError, match="refused the connection"):  # no account yet
        MqttTransport(logins[0]).connect(timeout=10)

    settings = Settings(
        broker_url=broker.url,
        broker_accounts=secrets / "coordinator",
        data_dir=tmp_path / "coordinator",
    )
    services, stop = start_services(settings)
    try:
        assert services.accounts is not None
        assert services.accounts.devices() == sorted(e.id for e in fleet)
        for login in logins:
            _connected(login).close()
    finally:
        stop()
