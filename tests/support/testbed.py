"""A testbed's recorded state and its fault actuator, without a testbed running."""

from __future__ import annotations

from pathlib import Path

from coordinator.testbed.actuator import TestbedActuator
from coordinator.testbed.state import State
from edge.transport.mqtt import MqttSettings, MqttTransport

__all__ = ["saved_state", "unconnected_actuator"]


def saved_state(directory: Path) -> State:
    """The state file of a software-method testbed that is up, saved in ``directory``."""
    bed = State(dir=directory, id="ab12", token="t0k3n", phase="up", method="software")
    bed.save()
    return bed


def unconnected_actuator(state: State) -> TestbedActuator:
    """An actuator whose transport never connects: kill and join do not use MQTT (only
    slow does)."""
    return TestbedActuator(state.dir, MqttTransport(MqttSettings(url="mqtt://127.0.0.1:1")))
