"""A slow fault multiplies a device's own throttle (:meth:`StageKeeper.throttle`): an
emulated Pi computing at ``--slowdown`` 30 that is made 3x slower runs at 90, not at a
full-speed core's 3 (the testbed's software and scalar methods start agents throttled)."""

from __future__ import annotations

from pathlib import Path

from edge.runtime.keeper import StageKeeper, StageSettings
from edge.transport.mqtt import MqttTransport
from edge.transport.settings import MqttSettings


def _keeper(tmp_path: Path, slowdown: float) -> StageKeeper:
    transport = MqttTransport(MqttSettings(url="mqtt://127.0.0.1:1"))  # never connected
    settings = StageSettings(device_id="pi", data_dir=tmp_path, slowdown=slowdown)
    return StageKeeper(
        transport, settings, report=lambda _e: None, announce=lambda: None, wake=lambda: None
    )


def test_a_slow_fault_multiplies_the_devices_own_throttle(tmp_path: Path) -> None:
    keeper = _keeper(tmp_path, 30.0)
    assert keeper.slowdown == 30.0
    keeper.throttle(3.0)
    assert keeper.slowdown == 90.0
    keeper.throttle(2.0)  # each fault from the device's own speed, not compounded
    assert keeper.slowdown == 60.0
    assert _keeper(tmp_path, 1.0).slowdown == 1.0
