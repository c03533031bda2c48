"""The secrets of a compose fleet's broker: its TLS files, its accounts, each agent's login.

``edgetrain testbed compose`` writes them with every render, new each time, into a
directory beside the compose file (``secrets/``): the compose file names only paths
(:func:`coordinator.testbed.compose.render_compose`), never a password. The broker is
secure as the coordinator's own is (:mod:`coordinator.local.owned`): TLS only, the
dynamic-security plugin, one account per agent bound to its client id, rights that
follow the plans of the coordinator's jobs. :func:`write_secrets` makes::

    .gitignore      "*": git never takes the directory in
    ca/             the CA and the broker's certificate, naming the broker's service
                    (coordinator.access.certs.broker_tls); stays on this host
    broker/         mounted into the broker: mosquitto.conf (a TLS listener on 8883,
                    the plugin), server.pem, server.key, ca.pem, dynsec.json (the
                    plugin's file: the coordinator's and the health check's
                    accounts, passwords hashed), health.password
    coordinator/    mounted into the coordinator: the accounts record (accounts.json,
                    with every agent's account, and tls/ca.pem), which
                    EDGETRAIN_BROKER_ACCOUNTS names, and api-token: the API's token
                    unless EDGETRAIN_API_TOKEN is set (the entry point exports it)
    agent-<id>/     mounted into that agent: credentials.json

The coordinator creates the agents' accounts in the broker when it attaches to
it ([Note: devices are created live] in :mod:`coordinator.access.accounts`).

Each service's part is mounted read-only at
:data:`~coordinator.testbed.compose.MOUNTED`; its entry point, as root, copies it to
:data:`~coordinator.testbed.compose.INSTALLED` for the user it runs as (the files
here belong to whoever rendered them, mode 0600, in directories of mode 0700).
"""

from __future__ import annotations

import json
import secrets
import shutil
from pathlib import Path
from typing import Any

from coordinator.access.accounts import BrokerAccounts
from coordinator.access.certs import broker_tls
from coordinator.access.dynsec import hash_password
from coordinator.testbed.compose import BROKER_PORT, HEALTH_USER, INSTALLED, agent_dir
from coordinator.testbed.sizing import EmulatedDevice
from edge.errors import UserError
from edge.files import PRIVATE, write_atomic

__all__ = ["BROKER_CONFIG", "MARKER", "write_secrets"]

HEALTH_TOPIC = "$SYS/broker/uptime"
PLUGIN = "/usr/lib/mosquitto_dynamic_security.so"
"""Where the eclipse-mosquitto:2 image has the dynamic-security plugin."""
MARKER = "# Made by edgetrain testbed compose: the broker's secrets. Never commit them.\n*\n"
"""The ``.gitignore`` of a secrets directory; its first line tells a directory
:func:`write_secrets` may replace from any other."""

_MADE = ("ca", "broker", "coordinator")

BROKER_CONFIG = f"""\
# The broker of an emulated fleet (edgetrain testbed compose): TLS only, the accounts
# and ACLs of the dynamic-security plugin. Nobody gets in without an account.
listener {BROKER_PORT}
certfile {INSTALLED}/server.pem
keyfile {INSTALLED}/server.key
plugin {PLUGIN}
plugin_opt_config_file {INSTALLED}/dynsec.json
allow_anonymous false
persistence false
log_dest stdout
log_type error
log_type warning
log_type notice
# Pipelines queue many QoS 1 frames per client; the default (1000) drops them.
max_queued_messages 10000
"""


def _private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def _health(config: dict[str, Any], password: str) -> None:
    """Add the health check's account to the plugin's file ``config``."""
    role = {
        "rolename": HEALTH_USER,
        "acls": [
            {"acltype": "subscribeLiteral", "topic": HEALTH_TOPIC, "allow": True},
            {"acltype": "publishClientReceive", "topic": HEALTH_TOPIC, "allow": True},
        ],
    }
    config["roles"].append(role)
    client = {"username": HEALTH_USER, **hash_password(password)}
    config["clients"].append({**client, "roles": [{"rolename": HEALTH_USER}]})


def _clear(directory: Path) -> None:
    """Make ``directory`` an empty secrets directory, refusing one that is not ours."""
    if directory.exists() and not directory.is_dir():
        raise UserError(f"--secrets-dir {directory}: not a directory")
    marker = directory / ".gitignore"
    ours = marker.is_file() and marker.read_text().startswith(MARKER.splitlines()[0])
    if directory.is_dir() and any(directory.iterdir()) and not ours:
        raise UserError(
            f"--secrets-dir {directory}: not empty and not made by edgetrain testbed compose; "
            "give a new or empty directory"
        )
    for entry in directory.iterdir() if directory.is_dir() else []:
        if entry.name not in _MADE and not entry.name.startswith("agent-"):
            continue
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def write_secrets(devices: list[EmulatedDevice], directory: Path, broker_host: str) -> None:
    """Write new secrets for ``devices`` into ``directory`` (see the module docstring),
    for a broker the services reach as ``broker_host``; what an earlier render left there
    is replaced. A directory that is not empty and was not made here is refused."""
    try:
        _clear(directory)
        _private_dir(directory)
        write_atomic(directory / ".gitignore", MARKER)
        tls = broker_tls(directory / "ca", [broker_host])
        coordinator = _private_dir(directory / "coordinator")
        accounts = BrokerAccounts(coordinator, f"mqtts://{broker_host}:{BROKER_PORT}", tls.ca_pem)
        write_atomic(_private_dir(coordinator / "tls") / "ca.pem", tls.ca_pem, mode=PRIVATE)
        write_atomic(coordinator / "api-token", secrets.token_urlsafe(32), mode=PRIVATE)
        for e in devices:
            creds = accounts.enroll(e.id)
            path = _private_dir(directory / agent_dir(e.id)) / "credentials.json"
            write_atomic(path, creds.to_json(), mode=PRIVATE)
        broker = _private_dir(directory / "broker")
        health = secrets.token_urlsafe(24)
        config = accounts.plugin_config()
        _health(config, health)
        files = {
            "mosquitto.conf": BROKER_CONFIG,
            "server.pem": tls.cert.read_text(),
            "server.key": tls.key.read_text(),
            "ca.pem": tls.ca_pem,
            "dynsec.json": json.dumps(config, indent=1),
            "health.password": health,
        }
        for name, text in files.items():
            write_atomic(broker / name, text, mode=PRIVATE)
    except OSError as exc:
        where = exc.filename or directory
        raise UserError(f"--secrets-dir: cannot write {where}: {exc.strerror or exc}") from None
