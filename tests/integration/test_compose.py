"""docker-compose itself accepts the testbed files: the shipped one and a generated 5-device fleet.

No Docker engine runs here: ``docker-compose config`` (Debian's v1.29, installed
by ``make system-deps``) validates a file against the compose schema, resolves
it and prints it back, without contacting an engine. The printed file is read
back to check what docker-compose made of each agent's limits, and which secrets it
mounts where (the broker's part, the coordinator's accounts record, each agent's
credentials: the secrets directory beside the file).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from typer.testing import CliRunner

from coordinator.planner.build import parse_fleet
from coordinator.testbed.sizing import EmulatedDevice, emulate
from edgetrain.cli.testbed_compose import compose_command

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "docker" / "compose.yaml"
DOCKER_COMPOSE = shutil.which("docker-compose")

pytestmark = pytest.mark.skipif(
    DOCKER_COMPOSE is None,
    reason="docker-compose not installed (make system-deps installs Debian's, as root)",
)


def docker_compose(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert DOCKER_COMPOSE is not None
    # Unset variables the file interpolates, so the result does not depend on the caller.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EDGETRAIN_", "COMPOSE_"))}
    return subprocess.run(
        [DOCKER_COMPOSE, "--file", str(path), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=path.parent,
    )


def validate(path: Path) -> dict[str, Any]:
    """``config -q`` succeeds silently, and ``config`` prints the resolved file."""
    quiet = docker_compose(path, "config", "-q")
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout == ""
    resolved = docker_compose(path, "config")
    assert resolved.returncode == 0, resolved.stderr
    doc = yaml.safe_load(resolved.stdout)
    assert isinstance(doc, dict)
    return doc


def check_fleet(doc: dict[str, Any], devices: list[EmulatedDevice], secrets: Path) -> None:
    """The limits of each agent, and every service's part of the ``secrets`` directory."""
    services = doc["services"]
    agents = {f"agent-{e.id}": e for e in devices}
    assert set(services) == {"mosquitto", "coordinator", *agents}
    for name, e in agents.items():
        agent = services[name]
        assert float(agent["cpus"]) == pytest.approx(e.cpus, abs=5e-5)
        assert int(agent["mem_limit"]) == e.memory_bytes
        assert int(agent["memswap_limit"]) == e.memory_bytes
        assert agent["cap_add"] == ["NET_ADMIN"]
        assert agent["environment"]["EDGETRAIN_LINK_MBPS"] == f"{e.bandwidth_mbps:g}"
        assert agent["volumes"] == [f"{secrets / name}:/run/secrets/edgetrain:ro"]
        assert "--insecure" not in agent["command"]
    assert services["coordinator"]["ports"] == ["127.0.0.1:8000:8000/tcp"]
    assert services["mosquitto"]["ports"] == ["127.0.0.1:8883:8883/tcp"]
    assert services["mosquitto"]["volumes"] == [f"{secrets / 'broker'}:/run/secrets/edgetrain:ro"]
    coordinator = services["coordinator"]
    assert coordinator["environment"] == {
        "EDGETRAIN_API_TOKEN": "",
        "EDGETRAIN_BROKER_URL": "mqtts://mosquitto:8883",
        "EDGETRAIN_BROKER_ACCOUNTS": "/run/edgetrain",
    }
    assert f"{secrets / 'coordinator'}:/run/secrets/edgetrain:ro" in coordinator["volumes"]


def test_shipped_compose_file_validates() -> None:
    doc = validate(SHIPPED)
    # Its secrets: docker/secrets, which the command that generates it writes (not in git).
    devices = emulate(parse_fleet("rpi4-4gb:2,jetson-nano,laptop"), cpus=4)
    check_fleet(doc, devices, SHIPPED.parent / "secrets")
    # The images build from the repository root, relative to docker/.
    build = doc["services"]["agent-jetson-nano"]["build"]
    assert Path(build["context"]) == ROOT
    assert (ROOT / build["dockerfile"]).is_file()
    assert build["target"] == "agent"


def test_generated_five_device_fleet_validates(tmp_path: Path) -> None:
    # The fleet spans 208x (Raspberry Pi 4 to Jetson Orin Nano): 4 cores for the
    # fastest device leave the Pis a share a CPU quota can still enforce.
    fleet = "rpi4-4gb:2,jetson-nano,jetson-orin-nano,laptop"
    path = tmp_path / "compose.yaml"
    app = typer.Typer()
    app.command()(compose_command)
    result = CliRunner().invoke(
        app, ["--devices", fleet, "--scale", "4", "--cpus", "16", "-o", str(path)]
    )
    assert result.exit_code == 0, result.output
    devices = emulate(parse_fleet(fleet), 4, cpus=16)
    assert len(devices) == 5
    doc = validate(path)
    check_fleet(doc, devices, tmp_path / "secrets")
    for e in devices:  # written beside the file
        assert (tmp_path / "secrets" / f"agent-{e.id}" / "credentials.json").is_file()
    assert "build" not in doc["services"]["coordinator"]  # no --context: prebuilt images


def test_docker_compose_rejects_a_broken_file(tmp_path: Path) -> None:
    """The validation has teeth: a misspelt limit is refused."""
    broken = tmp_path / "compose.yaml"
    broken.write_text(SHIPPED.read_text().replace("    mem_limit:", "    mem_limt:", 1))
    result = docker_compose(broken, "config", "-q")
    assert result.returncode != 0
    assert "mem_limt" in result.stderr
