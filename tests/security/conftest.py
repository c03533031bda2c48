"""Fixtures of the attacker suite: a secure broker the coordinator owns, and its fleet.

The broker is the one ``edgetrain train`` and ``coordinator`` start (Mosquitto over
TLS with the dynamic-security plugin, :mod:`coordinator.local.owned`); the fleet's
agents are real processes, each enrolled and logged in with its own credentials.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.mosquitto import owned_mosquitto

from coordinator.local.fleet import LocalFleet
from coordinator.local.owned import OwnedBroker
from edge.transport.mqtt import MqttTransport


@pytest.fixture(scope="module")
def secure_broker() -> Iterator[OwnedBroker]:
    with owned_mosquitto("edgetrain-security-") as owned:
        yield owned


@pytest.fixture(scope="module")
def secure_control(secure_broker: OwnedBroker) -> Iterator[MqttTransport]:
    """A connection of the coordinator's own account."""
    transport = MqttTransport(secure_broker.settings())
    transport.connect(timeout=10)
    yield transport
    transport.close()


@pytest.fixture(scope="module")
def secure_fleet(secure_broker: OwnedBroker, secure_control: MqttTransport) -> Iterator[LocalFleet]:
    """Three enrolled agents, slowed 4x so that a job lasts while it is attacked."""
    with LocalFleet(3, secure_broker, threads=1, slowdowns=[4.0, 4.0, 4.0]) as local:
        local.wait_online(secure_control, timeout=90)
        yield local
