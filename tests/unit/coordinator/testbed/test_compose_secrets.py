"""The broker secrets of ``testbed compose``: beside the file, never in it, new each render.

tests/integration/test_compose_broker.py runs a real Mosquitto with them.
"""

from __future__ import annotations

import base64
import hashlib
import json
import stat
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from typer.testing import CliRunner

from coordinator.planner.build import parse_fleet
from coordinator.testbed.compose import HEALTH_USER
from coordinator.testbed.compose_secrets import BROKER_CONFIG, MARKER, write_secrets
from coordinator.testbed.sizing import EmulatedDevice, emulate
from edge.errors import UserError
from edge.transport.credentials import Credentials, read_credentials
from edgetrain.cli.testbed_compose import compose_command

FLEET = "rpi4-4gb:2,jetson-nano,laptop"


def devices(text: str = FLEET) -> list[EmulatedDevice]:
    return emulate(parse_fleet(text), cpus=4)


def invoke(*args: str) -> Any:
    app = typer.Typer()
    app.command()(compose_command)
    return CliRunner().invoke(app, list(args))


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def credentials(secrets: Path) -> dict[str, Credentials]:
    return {
        e.id: read_credentials(secrets / f"agent-{e.id}" / "credentials.json") for e in devices()
    }


def test_the_file_names_the_secrets_and_holds_none(tmp_path: Path) -> None:
    out = tmp_path / "compose.yaml"
    result = invoke("--devices", FLEET, "--cpus", "4", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert "broker secrets (never commit them)" in result.stderr
    text, secrets = out.read_text(), tmp_path / "secrets"
    record = json.loads((secrets / "coordinator" / "accounts.json").read_text())
    creds = credentials(secrets)
    passwords = [
        record["coordinator"]["password"],
        (secrets / "broker" / "health.password").read_text(),
        (secrets / "coordinator" / "api-token").read_text(),
        *(c.password.get_secret_value() for c in creds.values()),
    ]
    assert len(set(passwords)) == len(passwords) == 3 + len(devices())
    plugin_text = (secrets / "broker" / "dynsec.json").read_text()
    for password in passwords:
        assert password not in text and password not in plugin_text
    services = yaml.safe_load(text)["services"]
    assert services["mosquitto"]["volumes"] == ["./secrets/broker:/run/secrets/edgetrain:ro"]
    assert "./secrets/coordinator:/run/secrets/edgetrain:ro" in services["coordinator"]["volumes"]
    # Every agent: its own account, in a file only the renderer may read.
    ca = (secrets / "broker" / "ca.pem").read_text()
    for device, c in creds.items():
        path = secrets / f"agent-{device}" / "credentials.json"
        assert mode(path) == 0o600 and mode(path.parent) == 0o700
        assert (c.broker, c.device_id, c.username, c.ca) == (
            "mqtts://mosquitto:8883",
            device,
            device,
            ca,
        )
    # The coordinator's record: every agent's account, whose password is its credentials'
    # (the coordinator creates them in the broker as it starts).
    assert {d: e["password"] for d, e in record["devices"].items()} == {
        d: c.password.get_secret_value() for d, c in creds.items()
    }
    # The plugin's file: the coordinator's account and the health check's (which reads
    # uptime), each password hashed as the plugin hashes them (PBKDF2-SHA512).
    plugin = json.loads(plugin_text)
    clients = {c["username"]: c for c in plugin["clients"]}
    assert set(clients) == {"edgetrain-coordinator", HEALTH_USER}
    for user, password in (
        ("edgetrain-coordinator", record["coordinator"]["password"]),
        (HEALTH_USER, (secrets / "broker" / "health.password").read_text()),
    ):
        entry = clients[user]
        digest = hashlib.pbkdf2_hmac(
            "sha512", password.encode(), base64.b64decode(entry["salt"]), entry["iterations"]
        )
        assert base64.b64decode(entry["password"]) == digest
    roles = {r["rolename"]: r["acls"] for r in plugin["roles"]}
    assert {(a["acltype"], a["topic"]) for a in roles[HEALTH_USER]} == {
        ("subscribeLiteral", "$SYS/broker/uptime"),
        ("publishClientReceive", "$SYS/broker/uptime"),
    }
    assert plugin["defaultACLAccess"]["publishClientSend"] is False
    # Private, and out of git.
    assert (secrets / ".gitignore").read_text() == MARKER
    for path in secrets.rglob("*"):
        if path.is_dir():
            assert mode(path) == 0o700, path
        elif path.name not in (".gitignore", "ca.pem", "server.pem"):
            assert mode(path) == 0o600, path


def test_the_broker_listens_with_tls_and_the_plugin_only() -> None:
    lines = [line for line in BROKER_CONFIG.splitlines() if not line.startswith("#")]
    assert lines[:7] == [
        "listener 8883",
        "certfile /run/edgetrain/server.pem",
        "keyfile /run/edgetrain/server.key",
        "plugin /usr/lib/mosquitto_dynamic_security.so",
        "plugin_opt_config_file /run/edgetrain/dynsec.json",
        "allow_anonymous false",
        "persistence false",
    ]


def test_each_render_makes_new_secrets_and_the_same_file(tmp_path: Path) -> None:
    out = tmp_path / "compose.yaml"
    assert invoke("--devices", FLEET, "--cpus", "4", "-o", str(out)).exit_code == 0
    first_text, first = out.read_text(), credentials(tmp_path / "secrets")
    assert invoke("--devices", FLEET, "--cpus", "4", "-o", str(out)).exit_code == 0
    assert out.read_text() == first_text
    again = credentials(tmp_path / "secrets")
    for device, c in again.items():
        assert c.password != first[device].password and c.ca != first[device].ca
    # A smaller fleet: the agents that left lose their secrets.
    write_secrets(devices("laptop"), tmp_path / "secrets", "mosquitto")
    assert sorted(p.name for p in (tmp_path / "secrets").iterdir()) == [
        ".gitignore",
        "agent-laptop-32gb",
        "broker",
        "ca",
        "coordinator",
    ]


def test_a_directory_not_made_here_is_refused_and_left_alone(tmp_path: Path) -> None:
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "agent-diary.txt").write_text("mine")
    with pytest.raises(UserError, match="not made by edgetrain testbed compose") as err:
        write_secrets(devices(), mine, "mosquitto")
    assert "\n" not in err.value.message
    assert sorted(p.name for p in mine.iterdir()) == ["agent-diary.txt"]
    result = invoke("--devices", FLEET, "--cpus", "4", "--secrets-dir", str(tmp_path / "x:y"))
    assert isinstance(result.exception, UserError), result.output
    assert "--secrets-dir" in result.exception.message


def test_a_secrets_dir_elsewhere_is_named_as_given(tmp_path: Path) -> None:
    out = tmp_path / "fleet" / "compose.yaml"
    out.parent.mkdir()
    inside = invoke(
        "--devices",
        "laptop",
        "--cpus",
        "4",
        "-o",
        str(out),
        "--secrets-dir",
        str(out.parent / "s" / "t"),
    )
    assert inside.exit_code == 0, inside.output
    volumes = yaml.safe_load(out.read_text())["services"]["agent-laptop-32gb"]["volumes"]
    assert volumes == ["./s/t/agent-laptop-32gb:/run/secrets/edgetrain:ro"]
    assert f"--secrets-dir {out.parent / 's' / 't'}" in out.read_text()
    elsewhere = tmp_path / "vault"
    outside = invoke(
        "--devices", "laptop", "--cpus", "4", "-o", str(out), "--secrets-dir", str(elsewhere)
    )
    assert outside.exit_code == 0, outside.output
    volumes = yaml.safe_load(out.read_text())["services"]["agent-laptop-32gb"]["volumes"]
    assert volumes == [f"{elsewhere}/agent-laptop-32gb:/run/secrets/edgetrain:ro"]
    assert (elsewhere / "agent-laptop-32gb" / "credentials.json").is_file()
