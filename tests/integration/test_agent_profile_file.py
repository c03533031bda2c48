"""``edgetrain agent --profile FILE.json`` and the link-shaping options, as a real process.

A good file is announced under ``--device-id``; a bad one ends the agent with
status 2 and one line naming the file and the field, before it connects.
tests/unit/edge/profiling/test_device_file.py reads the files directly.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.catalog import DEVICE
from support.mosquitto import Broker
from support.waiting import until

from edge.problem import DeviceSpec
from edge.transport.mqtt import MqttSettings, MqttTransport
from edge.wire.topics import device_profile


def _agent(broker: str, tmp: Path, *args: str) -> subprocess.Popen[str]:
    cmd = [
        sys.executable,
        "-m",
        "edgetrain.cli",
        "agent",
        "--broker",
        broker,
        "--data-dir",
        str(tmp / "data"),
        "--heartbeat-s",
        "0.2",
        "--threads",
        "1",
        "--measure-seconds",
        "0.05",
        "--insecure",
        *args,
    ]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True
    )


@pytest.fixture
def control(mosquitto: Broker) -> Iterator[MqttTransport]:
    transport = MqttTransport(MqttSettings(url=mosquitto.url))
    transport.connect(timeout=10)
    yield transport
    transport.close()


def _announced(control: MqttTransport, device: str) -> list[DeviceSpec]:
    seen: list[DeviceSpec] = []
    control.subscribe(
        device_profile(device), lambda _t, p: seen.append(DeviceSpec.model_validate_json(p))
    )
    return seen


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, out
    return out


def test_the_agent_announces_the_file_under_its_device_id(
    mosquitto: Broker, control: MqttTransport, tmp_path: Path
) -> None:
    path = tmp_path / "dev.json"
    path.write_text(json.dumps(DEVICE))
    seen = _announced(control, "emu-7")
    proc = _agent(mosquitto.url, tmp_path, "--device-id", "emu-7", "--profile", str(path))
    try:
        assert until(lambda: bool(seen) or proc.poll() is not None, 60)
    finally:
        out = _stop(proc)
    assert seen, out
    assert seen[-1] == DeviceSpec.model_validate(DEVICE | {"id": "emu-7"})


def test_a_bad_file_stops_the_agent_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(DEVICE | {"latency_ms": -2}))
    # No broker listens there: the file is checked before connecting.
    proc = _agent("mqtt://127.0.0.1:9", tmp_path, "--device-id", "emu-8", "--profile", str(path))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert out.strip().splitlines() == [
        f"error: --profile {path}: latency_ms: Input should be greater than or equal to 0 (got -2)"
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--link-mbps", "0"], "error: --link-mbps: must be a positive number (got 0)"),
        (["--link-latency-ms", "-5"], "error: --link-latency-ms: must be 0 to 60000 (got -5)"),
    ],
)
def test_bad_link_options_are_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    proc = _agent("mqtt://127.0.0.1:9", tmp_path, "--device-id", "emu-9", *args)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and out.strip().splitlines() == [message]


def test_a_shaped_agent_announces_the_shaped_link(
    mosquitto: Broker, control: MqttTransport, tmp_path: Path
) -> None:
    seen = _announced(control, "emu-10")
    proc = _agent(
        mosquitto.url,
        tmp_path,
        "--device-id",
        "emu-10",
        "--link-mbps",
        "5",
        "--link-latency-ms",
        "20",
    )
    try:
        assert until(lambda: bool(seen) or proc.poll() is not None, 60)
    finally:
        out = _stop(proc)
    assert seen, out
    assert seen[-1].bandwidth_mbps <= 5 and seen[-1].latency_ms >= 20
    assert "emulating a link of 5 Mbit/s, 20 ms" in out
