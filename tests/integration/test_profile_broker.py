"""``edgetrain profile`` against a real Mosquitto: the link is measured, the output is a device.

The measured link is checked against one shaped independently of the profiler,
with the testbed's own parts: the delay proxy (:mod:`coordinator.testbed.proxy`,
its own process; this kernel has no netem) adds a known one-way latency, and
(as root) a network namespace whose veth is shaped with ``tc tbf``
(:mod:`coordinator.testbed.netns`) caps the rate. Each estimate must land within
0.7-1.3 of what the link was shaped to.
"""

from __future__ import annotations

import json
import secrets
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from support.mosquitto import Broker, free_port
from support.waiting import until

from coordinator.testbed import limits, netns
from edge.errors import UserError
from edge.problem import DeviceSpec
from edge.profiling.device import measure_broker_link

pytestmark = pytest.mark.broker
REPO = Path(__file__).resolve().parents[2]
PROXY = [sys.executable, "-m", "coordinator.testbed.proxy"]

LATENCY_MS = 10.0
"""One-way latency the delay proxy adds (each direction)."""
RATE_MBPS = 20.0
"""``tbf`` rate of both directions of the namespace's veth: one 1 MB probe payload is 0.4 s."""


def _edgetrain(
    *args: str, timeout: float = 180, netns_name: str | None = None
) -> subprocess.CompletedProcess[str]:
    # Run from the repository root so the checkout's packages are the ones imported;
    # subprocess.run kills the child by its pid if it overruns the timeout.
    inside = ["ip", "netns", "exec", netns_name] if netns_name else []
    return subprocess.run(
        [*inside, sys.executable, "-m", "edgetrain.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _within(measured: float, shaped: float) -> bool:
    return 0.7 * shaped <= measured <= 1.3 * shaped


@contextmanager
def delay_proxy(listen: str, broker: Broker, delay_ms: float, log_dir: Path) -> Iterator[str]:
    """The testbed's delay proxy from ``listen`` (HOST:PORT) to ``broker``; yields its URL."""
    ready = log_dir / "proxy.ready"
    with (log_dir / "proxy.log").open("w") as log:
        route = [listen, f"{broker.host}:{broker.port}", str(delay_ms)]
        proc = subprocess.Popen(
            [*PROXY, "--route", *route, "--ready-file", str(ready)],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        assert until(lambda: ready.exists() or proc.poll() is not None, 30, 0.02)
        assert proc.poll() is None, (log_dir / "proxy.log").read_text()
        yield f"mqtt://{listen}"
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture
def shaped_namespace() -> Iterator[netns.Link]:
    """A namespace whose veth is shaped to :data:`RATE_MBPS` each way with ``tc tbf``."""
    detection = limits.detect("auto")
    if detection.method != "kernel":
        pytest.skip(f"needs root, ip netns and tc tbf: {detection.reason}")
    tag = f"pb{secrets.token_hex(2)}"
    link = netns.link_names(tag, 0, netns.free_subnet(tag))
    try:
        netns.make_link(link, RATE_MBPS)
        yield link
    finally:
        netns.delete_namespace(link.namespace)
        netns.delete_link(link.host_if)


@pytest.mark.slow
@pytest.mark.serial
def test_profile_measures_a_shaped_link(
    mosquitto: Broker, shaped_namespace: netns.Link, tmp_path: Path
) -> None:
    """The CLI, inside the namespace, through tbf and the proxy to the broker."""
    listen = f"{shaped_namespace.host_ip}:{free_port()}"
    with delay_proxy(listen, mosquitto, LATENCY_MS, tmp_path) as url:
        args = ["--broker", url, "--json", "--seconds", "0.5", "--device-id", "edge-1"]
        result = _edgetrain("profile", *args, netns_name=shaped_namespace.namespace)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)  # exactly one JSON object on stdout
    assert set(data) == {"id", "gflops", "memory_bytes", "bandwidth_mbps", "latency_ms", "details"}
    assert data["id"] == "edge-1" and data["gflops"] > 0
    details = data["details"]
    assert details["link_source"] == "measured-broker" and details["broker"] == url
    assert details["payloads"] == 4  # every bulk payload came back within the probe's deadline
    assert _within(data["latency_ms"], LATENCY_MS), details
    assert _within(data["bandwidth_mbps"], RATE_MBPS), details
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


@pytest.mark.serial
def test_measure_broker_link_directly(mosquitto: Broker, tmp_path: Path) -> None:
    """Latency through the delay proxy alone (no root needed); loopback has no rate to check."""
    with delay_proxy(f"127.0.0.1:{free_port()}", mosquitto, LATENCY_MS, tmp_path) as url:
        link = measure_broker_link(url, payload_bytes=200_000, rounds=10, payloads=3)
    assert _within(link.latency_ms, LATENCY_MS), link
    assert link.rounds == 10 and link.payloads == 3 and link.payload_bytes == 200_000


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
