"""How an agent logs in and what it runs with (edge.agent): one-line refusals of options
that conflict or cannot be used, before anything connects.

tests/unit/edgetrain/cli/test_agent_env.py reaches the same checks through the command;
the agent itself runs in tests/e2e/test_agent.py and tests/integration/test_agent_*.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from edge import __version__
from edge.agent import AgentOptions, agent_login
from edge.errors import UserError

CA = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
CREDS = {
    "broker": "mqtts://gw.lan:8883",
    "device_id": "pi-1",
    "username": "pi-1",
    "password": "s3cret-s3cret",
    "ca": CA,
}


@pytest.fixture
def creds(tmp_path: Path) -> Path:
    path = tmp_path / "creds.json"
    path.write_text(json.dumps(CREDS))
    return path


def test_credentials_name_the_broker_the_account_and_the_device(creds: Path) -> None:
    settings, device = agent_login("hostname", credentials=creds)
    assert device == "pi-1" and settings.client_id == "agent-pi-1"
    assert (settings.url, settings.username, settings.tls_ca_pem) == (CREDS["broker"], "pi-1", CA)
    same, _ = agent_login("hostname", "mqtts://gw.lan:8883", credentials=creds)
    assert same == settings


@pytest.mark.parametrize(
    ("broker", "extra", "message"),
    [
        (
            None,
            {"username": "edge"},
            "--credentials: give it alone, not with --username/--password/--tls-ca",
        ),
        (None, {"tls_ca": Path("ca.pem")}, "--credentials: give it alone, not with"),
        ("mqtt://other:1883", {}, "--broker mqtt://other:1883: the credentials are for "),
    ],
)
def test_credentials_come_alone_and_for_their_broker(
    creds: Path, broker: str | None, extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(UserError) as info:
        agent_login("pi-1", broker, credentials=creds, **extra)
    assert info.value.message.startswith(message) and info.value.exit_code == 2


def test_without_credentials_it_needs_a_broker_and_an_account_or_insecure() -> None:
    with pytest.raises(UserError) as info:
        agent_login("pi-1")
    assert info.value.message == "--broker or --credentials: say which broker to connect to"
    with pytest.raises(UserError) as info:
        agent_login("pi-1", "mqtt://127.0.0.1:9")
    assert info.value.message == (
        "no credentials for mqtt://127.0.0.1:9: anyone who can publish on it could drive this "
        "agent; give --credentials FILE (edgetrain fleet enroll), or --insecure to accept that"
    )
    with pytest.raises(UserError, match="broker"):
        agent_login("pi-1", "http://127.0.0.1:9", insecure=True)
    settings, device = agent_login("pi-1", "mqtt://127.0.0.1:9", insecure=True)
    assert (settings.url, settings.username, settings.client_id, device) == (
        "mqtt://127.0.0.1:9",
        None,
        None,  # the agent names its client after the device
        "pi-1",
    )
    settings, _ = agent_login("pi-1", "mqtt://127.0.0.1:9", username="edge", password="pw")
    assert settings.username == "edge" and settings.password is not None


def test_a_device_id_that_cannot_be_one_is_refused(tmp_path: Path) -> None:
    message = (
        "--device-id: 'pi/7' is not 1-64 of A-Z a-z 0-9 _ . - (starting with a letter or digit)"
    )
    with pytest.raises(UserError) as info:
        agent_login("pi/7", "mqtt://127.0.0.1:9", insecure=True)
    assert info.value.message == message
    with pytest.raises(UserError) as info:
        AgentOptions(device_id="pi/7", data_dir=tmp_path)
    assert info.value.message == message


def test_a_store_host_is_an_address_or_a_name(tmp_path: Path) -> None:
    hosts = ("10.0.0.5", "[fd00::5]", "fd00::6", "gpu-box.lan")
    options = AgentOptions(device_id="gpu-1", data_dir=tmp_path, store_hosts=hosts)
    assert options.store_hosts == hosts and options.version == __version__
    for bad in ("gpu box", "-x", "10.0.0.5:29500", ""):
        with pytest.raises(UserError) as info:
            AgentOptions(device_id="gpu-1", data_dir=tmp_path, store_hosts=(*hosts, bad))
        assert info.value.message == f"--store-host: {bad!r} is not an IP address or a host name"
