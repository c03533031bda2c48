"""Fixtures of the attacker suite: the secure broker's fleet (the broker and the
coordinator's connection are ``tests/conftest.py``'s ``secure_broker`` and
``secure_control``); the fleet's agents are real processes, each enrolled and logged
in with its own credentials."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from coordinator.local.fleet import AgentRoles, LocalFleet
from coordinator.local.owned import OwnedBroker
from edge.transport.mqtt import MqttTransport


@pytest.fixture(scope="module")
def secure_fleet(secure_broker: OwnedBroker, secure_control: MqttTransport) -> Iterator[LocalFleet]:
    """Three enrolled agents, slowed 4x so that a job lasts while it is attacked."""
    with LocalFleet(
        3, secure_broker, threads=1, roles=AgentRoles(slowdowns=[4.0, 4.0, 4.0])
    ) as local:
        local.wait_online(secure_control, timeout=90)
        yield local
