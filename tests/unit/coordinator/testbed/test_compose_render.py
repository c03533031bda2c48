"""The compose renderer and ``testbed compose``: limits from the profiles, stable bytes, errors.

``docker/compose.yaml`` is checked against what the command generates now, so
the shipped file never goes stale; tests/integration/test_compose.py validates
the files with docker-compose itself, and tests/integration/test_command_imports.py
checks that the command imports no FastAPI.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from support.paths import ROOT
from typer.testing import CliRunner

from coordinator.planner.build import parse_fleet
from coordinator.testbed.compose import render_compose
from coordinator.testbed.sizing import EmulatedDevice, emulate
from edge.errors import UserError
from edge.problem import DeviceSpec
from edgetrain.cli.testbed_compose import compose_command

SHIPPED = ROOT / "docker" / "compose.yaml"
SHIPPED_ARGS = ["--devices", "rpi4-4gb:2,jetson-nano,laptop", "--cpus", "4", "--context", ".."]
"""How docker/compose.yaml is generated (its header says the same)."""

FLEET = "rpi4-4gb:2,jetson-nano,laptop"


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The command writes its broker's secrets beside its output, by default in the
    current directory: here a temporary one, never the checkout."""
    monkeypatch.chdir(tmp_path)


def fleet(text: str = FLEET, cpus: float = 4) -> list[EmulatedDevice]:
    return emulate(parse_fleet(text), cpus=cpus)


def services(text: str) -> dict[str, Any]:
    doc = yaml.safe_load(text)
    assert doc["version"] == "2.4"
    return dict(doc["services"])


def invoke(*args: str) -> Any:
    app = typer.Typer()
    app.command()(compose_command)
    return CliRunner().invoke(app, list(args))


def test_rendering_is_deterministic() -> None:
    first = render_compose(fleet())
    assert first == render_compose(fleet())
    assert first.encode() == render_compose(fleet()).encode()


def test_agents_get_the_profiles_cpu_ratios_and_memory() -> None:
    devices = fleet()
    out = services(render_compose(devices))
    assert list(out) == ["mosquitto", "coordinator"] + [f"agent-{e.id}" for e in devices]
    fastest = max(e.source.gflops for e in devices)
    for e in devices:
        agent = out[f"agent-{e.id}"]
        assert agent["cpus"] == pytest.approx(e.cpus, abs=5e-5)
        # The ratio between devices is the catalogue's (1 core for the fastest at this scale).
        assert agent["cpus"] == pytest.approx(e.source.gflops / fastest, abs=5e-5)
        assert agent["mem_limit"] == agent["memswap_limit"] == int(e.source.memory_bytes)
        assert agent["cap_add"] == ["NET_ADMIN"]
        assert agent["depends_on"] == {  # the coordinator creates the agents' accounts
            "mosquitto": {"condition": "service_healthy"},
            "coordinator": {"condition": "service_healthy"},
        }
        command = agent["command"]
        assert command[command.index("--device-id") + 1] == e.id
        # Its own account: the credentials its entry point copies from the mounted secrets.
        assert command[command.index("--credentials") + 1] == "/run/edgetrain/credentials.json"
        assert "--insecure" not in command and "--broker" not in command
        assert agent["volumes"] == [f"./secrets/agent-{e.id}:/run/secrets/edgetrain:ro"]
        assert command[command.index("--threads") + 1] == str(e.threads)
        env = agent["environment"]
        assert float(env["EDGETRAIN_LINK_MBPS"]) == e.bandwidth_mbps
        assert float(env["EDGETRAIN_LINK_LATENCY_MS"]) == e.latency_ms
        announced = DeviceSpec.model_validate_json(env["EDGETRAIN_PROFILE_JSON"])
        assert announced.id == e.id
        assert announced.gflops == e.source.gflops
        assert announced.memory_bytes == e.memory_bytes


def test_scale_and_host_cores_set_the_shares() -> None:
    devices = emulate(parse_fleet("rpi4-4gb:2,jetson-nano,jetson-orin-nano,laptop"), 4, cpus=16)
    out = services(render_compose(devices))
    assert out["agent-jetson-orin-nano"]["cpus"] == 4.0
    assert out["agent-rpi4-4gb-1"]["cpus"] == pytest.approx(4 * 7.2 / 1500, abs=5e-5)


def test_ports_tag_and_build_context() -> None:
    text = render_compose(
        fleet(), image_tag="v1", broker_port=11883, coordinator_port=18000, build_context="."
    )
    out = services(text)
    assert out["mosquitto"]["ports"] == ["127.0.0.1:11883:8883"]
    assert out["coordinator"]["ports"] == ["127.0.0.1:18000:8000"]
    assert out["coordinator"]["image"] == "edgetrain/coordinator:v1"
    assert out["coordinator"]["build"]["target"] == "coordinator"
    assert out["agent-jetson-nano"]["image"] == "edgetrain/agent:v1"
    assert out["agent-jetson-nano"]["build"] == {
        "context": ".",
        "dockerfile": "docker/Dockerfile",
        "target": "agent",
    }
    assert "build" not in services(render_compose(fleet()))["coordinator"]


def test_header_says_how_it_was_generated() -> None:
    text = render_compose(fleet(), generated_by="edgetrain testbed compose --devices x")
    assert text.startswith("# ")
    assert "# Generated by: edgetrain testbed compose --devices x\n" in text
    assert "#   laptop-32gb" in text


def _device(id: str) -> EmulatedDevice:
    spec = DeviceSpec(id=id, gflops=10, memory_bytes=2**30, bandwidth_mbps=100, latency_ms=1)
    return EmulatedDevice(id, spec, 0.5, 2**30, 100.0, 1.0)


@pytest.mark.parametrize(
    ("devices", "options", "message"),
    [
        ([], {}, "no devices"),
        ([_device("a"), _device("a")], {}, "more than once"),
        ([_device("Pi Kitchen")], {}, "compose service name"),
        ([_device("a")], {"broker_port": 0}, "--broker-port"),
        ([_device("a")], {"coordinator_port": 70000}, "--coordinator-port"),
        ([_device("a")], {"broker_port": 8000}, "share host port"),
        ([_device("a")], {"image_tag": "no:colons"}, "--image-tag"),
    ],
)
def test_bad_input_is_one_user_error(
    devices: list[EmulatedDevice], options: dict[str, Any], message: str
) -> None:
    with pytest.raises(UserError, match=message) as err:
        render_compose(devices, **options)
    assert "\n" not in err.value.message


def test_command_prints_the_rendered_file(tmp_path: Path) -> None:
    result = invoke("--devices", FLEET, "--cpus", "4")
    assert result.exit_code == 0, result.output
    expected = render_compose(
        fleet(), generated_by=f"edgetrain testbed compose --devices {FLEET} --cpus 4"
    )
    assert result.stdout == expected
    out = tmp_path / "compose.yaml"
    result = invoke("--devices", FLEET, "--cpus", "4", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    assert out.read_text() == expected


def test_command_header_makes_the_host_cores_explicit() -> None:
    result = invoke("--devices", "jetson-nano", "--scale", "0.5")
    assert result.exit_code == 0, result.output
    assert "--devices jetson-nano --scale 0.5 --cpus " in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--devices", "no-such-device"], "no-such-device"),
        (["--devices", "rpi4-4gb:0"], "count must be at least 1"),
        (["--devices", FLEET, "--cpus", "0"], "--cpus must be positive"),
        (["--devices", FLEET, "--scale", "-1", "--cpus", "4"], "--scale must be positive"),
        (["--devices", FLEET, "--scale", "8", "--cpus", "4"], "lower --scale"),
        (["--devices", "rpi4-4gb,jetson-orin-nano", "--cpus", "4"], "too small to emulate"),
    ],
)
def test_command_bad_fleet_is_one_user_error(args: list[str], message: str) -> None:
    result = invoke(*args)
    assert isinstance(result.exception, UserError), result.output
    assert message in result.exception.message
    assert "\n" not in result.exception.message
    assert result.exception.exit_code == 2


def test_shipped_compose_file_is_what_the_command_generates() -> None:
    result = invoke(*SHIPPED_ARGS)
    assert result.exit_code == 0, result.output
    assert SHIPPED.read_text() == result.stdout, (
        "docker/compose.yaml is stale; regenerate it: "
        f"edgetrain testbed compose {' '.join(SHIPPED_ARGS)} -o docker/compose.yaml"
    )
