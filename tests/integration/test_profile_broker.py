"""``edgetrain profile`` against a real Mosquitto: the link is measured, the output is a device."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.mosquitto import Broker, free_port

from edge.errors import UserError
from edge.problem import DeviceSpec
from edge.profiler import measure_broker_link

pytestmark = pytest.mark.broker
REPO = Path(__file__).resolve().parents[2]


def _edgetrain(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    # Run from the repository root so the checkout's packages are the ones imported;
    # subprocess.run kills the child by its pid if it overruns the timeout.
    return subprocess.run(
        [sys.executable, "-m", "edgetrain.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_profile_json_measures_the_link_through_the_broker(mosquitto: Broker) -> None:
    result = _edgetrain(
        "profile", "--json", "--broker", mosquitto.url, "--seconds", "0.5", "--device-id", "edge-1"
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)  # exactly one JSON object on stdout
    assert set(data) == {"id", "gflops", "memory_bytes", "bandwidth_mbps", "latency_ms", "details"}
    assert data["id"] == "edge-1"
    assert data["latency_ms"] > 0 and data["bandwidth_mbps"] > 0 and data["gflops"] > 0
    details = data["details"]
    assert details["link_source"] == "measured-broker"
    assert details["broker"] == mosquitto.url
    assert details["rtt_ms"] == pytest.approx(2 * data["latency_ms"])
    spec = DeviceSpec.model_validate(data)
    assert spec.details == details


def test_profile_table_without_json(mosquitto: Broker) -> None:
    result = _edgetrain("profile", "--broker", mosquitto.url, "--seconds", "0.2")
    assert result.returncode == 0, result.stderr
    assert "measured-broker" in result.stdout and "gflops" in result.stdout


def test_unreachable_broker_is_status_2_and_one_line() -> None:
    url = f"mqtt://127.0.0.1:{free_port()}"  # nothing listens there
    result = _edgetrain("profile", "--json", "--broker", url, "--seconds", "0.2")
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and url in lines[0], result.stderr


def test_bad_broker_url_is_status_2() -> None:
    result = _edgetrain("profile", "--broker", "http://127.0.0.1:1883")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "http://" in result.stderr


def test_measure_broker_link_directly(mosquitto: Broker) -> None:
    link = measure_broker_link(mosquitto.url, payload_bytes=200_000, rounds=5, payloads=3)
    assert link.rtt_ms > 0 and link.latency_ms == pytest.approx(link.rtt_ms / 2)
    assert link.bandwidth_mbps > 0
    assert link.rounds == 5 and link.payloads == 3


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A TCP port that completes the handshake (backlog) but never speaks MQTT."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(4)
        yield f"mqtt://127.0.0.1:{sock.getsockname()[1]}"


def test_a_server_that_never_answers_times_out_as_user_error(silent_server: str) -> None:
    with pytest.raises(UserError) as err:
        measure_broker_link(silent_server, timeout_s=1.0)
    assert silent_server in err.value.message and "\n" not in err.value.message
