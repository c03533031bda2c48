"""Fixtures for end-to-end runs: one broker and one fleet of real agents per module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.markers import NO_MOSQUITTO
from support.mosquitto import find_mosquitto, mosquitto_broker

from coordinator.local.fleet import LocalFleet
from edge.transport.mqtt import MqttSettings, MqttTransport


@pytest.fixture(scope="module")
def module_broker() -> Iterator[str]:
    if find_mosquitto() is None:
        pytest.skip(NO_MOSQUITTO)
    with mosquitto_broker() as broker:
        yield broker.url


@pytest.fixture(scope="module")
def control(module_broker: str) -> Iterator[MqttTransport]:
    transport = MqttTransport(MqttSettings(url=module_broker))
    transport.connect(timeout=10)
    yield transport
    transport.close()


@pytest.fixture(scope="module")
def fleet(module_broker: str, control: MqttTransport) -> Iterator[LocalFleet]:
    """Three agent processes, online, reused by every test of the module (one job at a time)."""
    with LocalFleet(3, module_broker, threads=1) as local:
        local.wait_online(control, timeout=90)
        yield local
