"""Agents announce their fixed costs; emulating agents announce the speed they get.

Real parts: ``edgetrain profile`` against a real Mosquitto, and real
``edgetrain agent`` processes (:class:`~coordinator.local.fleet.LocalFleet`) whose
retained profiles are read off the broker. Each must carry
``details["fixed_costs"]`` (per microbatch, per step, per frame, the frame's
including a publish the agent timed on its own connection; see
:mod:`edge.profiling.fixed_costs`), which the planner reads back; an agent given
``--emulate`` announces its measured rate over its slowdown and the catalogue
device's link, memory and power. An agent's per-byte cost is the one it measured
through its own connection and the broker
(:func:`~edge.profiling.fixed_costs.measure_transport_byte_s`), which a plain
:class:`MqttTransport` measures the same way.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.mosquitto import Broker

from coordinator.local.fleet import AgentRoles, LocalFleet
from edge.problem import DeviceSpec
from edge.profiling.catalog import resolve
from edge.profiling.fixed_costs import fixed_costs_of, measure_transport_byte_s
from edge.transport.mqtt import MqttSettings, MqttTransport
from edge.wire.topics import device_probe

pytestmark = pytest.mark.broker
REPO = Path(__file__).resolve().parents[2]
KEYS = {"microbatch_s", "step_s", "frame_s", "byte_s"}
EDGETRAIN = [sys.executable, "-m", "edgetrain.cli"]


def test_a_profile_through_a_broker_carries_the_fixed_costs(mosquitto: Broker) -> None:
    result = subprocess.run(
        [*EDGETRAIN, "profile", "--json", "--seconds", "0.1", "--broker", mosquitto.url],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    details = json.loads(result.stdout)["details"]
    fixed = details["fixed_costs"]
    assert set(fixed) == KEYS and all(v >= 0 for v in fixed.values()), fixed
    assert fixed["byte_s"] > 0  # the transport's CPU per byte was measured
    # A frame costs at least the publish call the broker probe timed.
    assert details["publish_ms"] > 0 and fixed["frame_s"] >= details["publish_ms"] / 1e3
    spec = DeviceSpec.model_validate(json.loads(result.stdout))
    got = fixed_costs_of(spec)
    assert got is not None and got.to_json() == fixed


def test_a_transport_times_its_bytes_through_the_broker(mosquitto: Broker) -> None:
    transport = MqttTransport(MqttSettings(url=mosquitto.url))
    transport.connect(timeout=10)
    try:
        got = measure_transport_byte_s(transport, device_probe("probe-test"), timeout_s=30)
    finally:
        transport.close()
    # Positive, and under a second a MiB: a frame's bytes, not the time of a timeout.
    assert 0 < got * (1 << 20) < 1.0


@pytest.mark.slow
def test_agents_announce_fixed_costs_and_emulate_what_they_run(mosquitto: Broker) -> None:
    control = MqttTransport(MqttSettings(url=mosquitto.url))
    control.connect(timeout=10)
    profiles, slowdowns = ["rpi4-4gb", "laptop"], [4.0, 1.0]
    try:
        with LocalFleet(
            2, mosquitto.url, threads=1, roles=AgentRoles(profiles=profiles, slowdowns=slowdowns)
        ) as fleet:
            announced = fleet.wait_online(control, timeout=90)
    finally:
        control.close()
    for device, name, slowdown in zip(fleet.ids, profiles, slowdowns, strict=True):
        spec, source = announced[device], resolve(name).to_device_spec(power=True)
        assert spec.details is not None and set(spec.details["fixed_costs"]) == KEYS
        fixed = fixed_costs_of(spec)
        # The agent timed a publish on its own connection once connected, and counts it.
        assert fixed is not None and spec.details["publish_ms"] > 0
        assert fixed.frame_s >= spec.details["publish_ms"] / 1e3
        # Its per-byte cost is the one it timed through its connection and the broker.
        per_mib = spec.details["transport_byte_ms_per_mib"]
        assert per_mib > 0 and fixed.byte_s * (1 << 20) * 1e3 == pytest.approx(per_mib)
        assert spec.details["emulates"] == name and spec.details["slowdown"] == slowdown
        assert spec.gflops == spec.details["measured_gflops"] / slowdown
        assert spec.details["emulated_gflops"] == source.gflops
        link = (spec.bandwidth_mbps, spec.latency_ms, spec.watts_busy, spec.watts_idle)
        assert link == (
            source.bandwidth_mbps,
            source.latency_ms,
            source.watts_busy,
            source.watts_idle,
        )
        assert spec.memory_bytes <= source.memory_bytes
