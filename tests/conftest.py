"""Fixtures shared by every test suite, and the plugin that keeps the broker marker true."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# tests/ is not a package: make tests/support importable whatever pytest's import mode.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from support.markers import NO_MOSQUITTO, BrokerMarkers
from support.mosquitto import Broker, find_mosquitto, mosquitto_broker, owned_mosquitto

from coordinator.local.owned import OwnedBroker
from edge.transport.mqtt import MqttTransport


def pytest_configure(config: pytest.Config) -> None:
    # See [Note: the broker marker] in support/markers.py.
    config.pluginmanager.register(BrokerMarkers(), "edgetrain-broker-markers")


@pytest.fixture
def mosquitto() -> Iterator[Broker]:
    """A fresh Mosquitto broker on a free loopback port; ``.url`` is ``mqtt://127.0.0.1:PORT``."""
    if find_mosquitto() is None:
        pytest.skip(NO_MOSQUITTO)
    with mosquitto_broker() as broker:
        yield broker


@pytest.fixture(scope="module")
def secure_broker() -> Iterator[OwnedBroker]:
    """The broker ``edgetrain train`` and ``coordinator`` start (Mosquitto over TLS with
    the dynamic-security plugin, :mod:`coordinator.local.owned`), one per test module:
    each device may use only what its grant says."""
    with owned_mosquitto() as owned:
        yield owned


@pytest.fixture(scope="module")
def secure_control(secure_broker: OwnedBroker) -> Iterator[MqttTransport]:
    """A connection to ``secure_broker`` of the coordinator's own account."""
    transport = MqttTransport(secure_broker.settings())
    transport.connect(timeout=10)
    yield transport
    transport.close()
