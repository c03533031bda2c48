"""``edgetrain agent`` options from ``EDGETRAIN_*`` environment variables.

Each option has one, named ``EDGETRAIN_`` and the option's name; a value from the
environment is validated as the flag's would be, and a flag given wins. Parsed with
the command's own context (nothing runs) and, for the validation, invoked with typer's
CliRunner up to the first check that fails, before any connection.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from edge.errors import UserError
from edgetrain.cli import app

AGENT = get_command(app).commands["agent"]  # type: ignore[attr-defined]

ENV = {
    "EDGETRAIN_BROKER": "mqtt://broker.lan:1884",
    "EDGETRAIN_DEVICE_ID": "pi-7",
    "EDGETRAIN_PROFILE": "rpi4-4gb",
    "EDGETRAIN_EMULATE": "rpi5-8gb",
    "EDGETRAIN_DATA_DIR": "/srv/edgetrain",
    "EDGETRAIN_THREADS": "3",
    "EDGETRAIN_HEARTBEAT_S": "0.5",
    "EDGETRAIN_MEASURE_SECONDS": "0.2",
    "EDGETRAIN_MEASURE_LOCK": "/run/edgetrain/measure.lock",
    "EDGETRAIN_SLOWDOWN": "4",
    "EDGETRAIN_LINK_MBPS": "100",
    "EDGETRAIN_LINK_LATENCY_MS": "5",
    "EDGETRAIN_USERNAME": "edge",
    "EDGETRAIN_PASSWORD": "s3cret",
    "EDGETRAIN_TLS_CA": "/etc/ssl/ca.pem",
    "EDGETRAIN_LOG_LEVEL": "debug",
    "EDGETRAIN_DEVICE": "cuda:1",
    "EDGETRAIN_PRECISION": "bf16",
    "EDGETRAIN_SERVER": "1",
    "EDGETRAIN_CREDENTIALS": "/etc/edgetrain/creds.json",
    "EDGETRAIN_ALLOW_CODE": "mypkg other.models",
    "EDGETRAIN_DATA": "mine=digits:shard=1/3 csv=rows.csv:label=target",
    "EDGETRAIN_INSECURE": "1",
    "EDGETRAIN_STORE_HOST": "10.0.0.5 gpu-box.lan",  # repeatable: separated by spaces
}
PARSED: dict[str, Any] = {
    "broker": "mqtt://broker.lan:1884",
    "device_id": "pi-7",
    "profile": "rpi4-4gb",
    "emulate": "rpi5-8gb",
    "data_dir": Path("/srv/edgetrain"),
    "threads": 3,
    "heartbeat_s": 0.5,
    "measure_seconds": 0.2,
    "measure_lock": Path("/run/edgetrain/measure.lock"),
    "slowdown": 4.0,
    "link_mbps": 100.0,
    "link_latency_ms": 5.0,
    "username": "edge",
    "password": "s3cret",
    "tls_ca": Path("/etc/ssl/ca.pem"),
    "log_level": "debug",
    "device": "cuda:1",
    "precision": "bf16",
    "server": True,
    "credentials": Path("/etc/edgetrain/creds.json"),
    "allow_code": ["mypkg", "other.models"],
    "data": ["mine=digits:shard=1/3", "csv=rows.csv:label=target"],
    "insecure": True,
    "store_host": ["10.0.0.5", "gpu-box.lan"],
}


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """An environment without the caller's EDGETRAIN_* variables."""
    for name in os.environ:
        if name.startswith("EDGETRAIN_"):
            monkeypatch.delenv(name)
    return monkeypatch


def _parse(*args: str) -> dict[str, Any]:
    with AGENT.make_context("agent", list(args)) as ctx:
        return dict(ctx.params)


def test_every_option_has_its_variable() -> None:
    options = [p for p in AGENT.params if p.param_type_name == "option" and p.name != "help"]
    assert {p.name for p in options} == set(PARSED)
    for option in options:
        flag = option.opts[0]
        want = "EDGETRAIN_" + flag.removeprefix("--").replace("-", "_").upper()
        envvar = option.envvar if isinstance(option.envvar, str) else option.envvar[0]
        assert envvar == want, flag
        assert want in ENV


def test_options_come_from_the_environment_and_flags_win(env: pytest.MonkeyPatch) -> None:
    for name, value in ENV.items():
        env.setenv(name, value)
    assert _parse() == PARSED
    flags = _parse("--broker", "mqtt://other:1883", "--threads", "1", "--device", "cpu")
    assert flags == {**PARSED, "broker": "mqtt://other:1883", "threads": 1, "device": "cpu"}
    env.delenv("EDGETRAIN_PASSWORD")
    env.setenv("EDGETRAIN_MQTT_PASSWORD", "older")  # the variable's name before
    assert _parse()["password"] == "older"


def test_a_value_from_the_environment_is_checked_as_a_flags_is(env: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    env.setenv("EDGETRAIN_BROKER", "mqtt://127.0.0.1:9")
    env.setenv("EDGETRAIN_THREADS", "0")
    done = runner.invoke(app, ["agent"])
    assert done.exit_code == 2 and "Invalid value for '--threads'" in done.output, done.output
    env.delenv("EDGETRAIN_THREADS")
    env.setenv("EDGETRAIN_LINK_LATENCY_MS", "-5")
    done = runner.invoke(app, ["agent"])
    assert isinstance(done.exception, UserError)
    assert done.exception.message == "--link-latency-ms: must be 0 to 60000 (got -5)"
    # The flag wins over the bad variable; the next check is the login: no credentials
    # needs --insecure (from its variable too), and then the variable's device id.
    done = runner.invoke(app, ["agent", "--link-latency-ms", "0"])
    assert isinstance(done.exception, UserError)
    assert done.exception.message.startswith("no credentials for mqtt://127.0.0.1:9: anyone")
    env.setenv("EDGETRAIN_INSECURE", "1")
    env.setenv("EDGETRAIN_DEVICE_ID", "pi/7")
    done = runner.invoke(app, ["agent", "--link-latency-ms", "0"])
    assert isinstance(done.exception, UserError)
    assert done.exception.message == (
        "--device-id: 'pi/7' is not 1-64 of A-Z a-z 0-9 _ . - (starting with a letter or digit)"
    )


def test_an_agent_without_credentials_needs_insecure(env: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    env.setenv("EDGETRAIN_BROKER", "mqtt://127.0.0.1:9")
    done = runner.invoke(app, ["agent"])
    assert isinstance(done.exception, UserError) and done.exception.exit_code == 2
    assert done.exception.message == (
        "no credentials for mqtt://127.0.0.1:9: anyone who can publish on it could drive this "
        "agent; give --credentials FILE (edgetrain fleet enroll), or --insecure to accept that"
    )


def test_an_empty_or_wildcard_allowance_is_refused(env: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    env.setenv("EDGETRAIN_BROKER", "mqtt://127.0.0.1:9")
    for bad, why in (("", "empty"), ("*", "a wildcard")):
        done = runner.invoke(
            app, ["agent", "--insecure", "--allow-code", "ok", "--allow-code", bad]
        )
        assert isinstance(done.exception, UserError) and done.exception.exit_code == 2
        assert done.exception.message.startswith(f"--allow-code: {bad!r} is {why}; "), done.output


def test_a_store_host_is_an_address_or_a_name(env: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    base = ["agent", "--broker", "mqtt://127.0.0.1:9", "--insecure"]
    base += ["--store-host", "[fd00::5]"]
    for bad in ("gpu box", "-x", "10.0.0.5:29500", ""):
        done = runner.invoke(app, [*base, "--store-host", bad])
        assert isinstance(done.exception, UserError), done.output
        assert (
            done.exception.message == f"--store-host: {bad!r} is not an IP address or a host name"
        )
