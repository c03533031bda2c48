"""Who may use a testbed's broker: its TLS files, its accounts, each agent's credentials.

A testbed's broker is secure as the coordinator's own is (:mod:`coordinator.local.owned`)
whenever it is Mosquitto: TLS only, the dynamic-security plugin, one account per agent,
ACLs that follow the plans of the jobs its coordinator runs. This module owns what that
needs in the state directory:

- ``broker/``: the accounts record (``accounts.json``, mode 0600,
  :class:`~coordinator.access.accounts.BrokerAccounts`) and ``broker/tls/``
  (:func:`~coordinator.access.certs.broker_tls`): a CA of the testbed's own and the
  broker's certificate, which names 127.0.0.1 and, under the kernel method, each
  link's host address (agents in a namespace reach the broker through the delay
  proxy there);
- ``credentials/<device>.json`` (mode 0600): what each agent logs in with
  (``edgetrain agent --credentials``), naming the address that agent reaches the
  broker by.

``up`` makes the record and the TLS files and enrols every agent in the record
before the broker starts (:func:`start_accounts`, :func:`enroll`). The broker starts
with the coordinator's account alone, and whoever attaches the accounts to it
creates the agents' accounts through the plugin's API, before any agent starts
([Note: devices are created live] in :mod:`coordinator.access.accounts`): the
coordinator ``up`` starts (``--broker-accounts``), or, without one, the testbed
itself (:func:`attach`). A device that joins later is enrolled by whoever attached
them. The testbed's own connections (waiting for agents, ``status``) log in with
the coordinator's account of that record (:func:`coordinator_login`). Where
Mosquitto is not installed the broker is the embedded amqtt one, anonymous and
plain: agents get ``--insecure`` and ``up`` warns (:func:`secure_possible`).

Tested in tests/unit/coordinator/testbed/test_testbed_access.py and, with the broker
running, tests/e2e/test_testbed.py.
"""

from __future__ import annotations

import logging
from pathlib import Path

from coordinator.access.accounts import BrokerAccounts
from coordinator.access.certs import BrokerTls, broker_tls
from coordinator.local.broker import find_mosquitto
from coordinator.testbed.state import State
from edge.errors import UserError
from edge.files import PRIVATE, write_atomic
from edge.transport.credentials import Credentials
from edge.transport.mqtt import MqttTransport
from edge.transport.settings import MqttSettings

__all__ = [
    "attach",
    "broker_dir",
    "coordinator_login",
    "enroll",
    "is_secure",
    "secure_possible",
    "start_accounts",
    "write_credentials",
]

log = logging.getLogger("edgetrain.testbed")

BROKER_DIR = "broker"
CREDENTIALS_DIR = "credentials"
"""Under the state directory (both removed by ``down``)."""


def secure_possible() -> bool:
    """Whether the testbed's broker will be Mosquitto, and so secure; warns when not."""
    if find_mosquitto() is not None:
        return True
    log.warning(
        "the embedded amqtt broker is anonymous and plain: anyone who can reach the "
        "testbed's broker can drive its agents; install mosquitto for TLS, accounts and ACLs"
    )
    return False


def is_secure(state: State) -> bool:
    """Whether ``state``'s broker was started with TLS and accounts."""
    return state.broker_url.startswith("mqtts://")


def broker_dir(state: State) -> Path:
    """The accounts record (and ``tls/``) of ``state``'s broker."""
    return state.dir / BROKER_DIR


def start_accounts(state: State, port: int, hosts: list[str]) -> tuple[BrokerAccounts, BrokerTls]:
    """The accounts record and TLS files of a broker about to start on 127.0.0.1:``port``,
    whose certificate names ``hosts`` too; credentials name ``mqtts://127.0.0.1:port``
    unless :func:`enroll` is told otherwise."""
    tls = broker_tls(broker_dir(state) / "tls", hosts)
    return BrokerAccounts(broker_dir(state), f"mqtts://127.0.0.1:{port}", tls.ca_pem), tls


def write_credentials(state: State, creds: Credentials) -> Path:
    """Write ``creds`` to ``credentials/<device>.json`` (mode 0600); its path."""
    path = state.dir / CREDENTIALS_DIR / f"{creds.device_id}.json"
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_atomic(path, creds.to_json(), mode=PRIVATE)
    return path


def enroll(accounts: BrokerAccounts, state: State, device: str, broker_url: str) -> Path:
    """Enrol ``device`` and write its credentials naming ``broker_url`` (where it reaches
    the broker); the file's path."""
    creds = accounts.enroll(device).model_copy(update={"broker": broker_url})
    return write_credentials(state, creds)


def _record(state: State) -> BrokerAccounts:
    directory = broker_dir(state)
    if not (directory / "accounts.json").is_file():
        raise UserError(f"the testbed in {state.dir} has no broker accounts in {directory}")
    ca = directory / "tls" / "ca.pem"
    try:
        ca_pem = ca.read_text()
    except OSError as exc:
        raise UserError(f"the testbed's broker CA {ca}: {exc.strerror or exc}") from None
    return BrokerAccounts(directory, state.broker_url, ca_pem)


def coordinator_login(state: State) -> MqttSettings:
    """How the testbed's own connections log in to its broker: the coordinator's account
    and the testbed's CA (anonymous on a broker without TLS)."""
    if not is_secure(state):
        return MqttSettings(url=state.broker_url)
    return _record(state).login(state.broker_url)


def attach(state: State, accounts: BrokerAccounts) -> MqttTransport:
    """Attach ``accounts`` to ``state``'s running broker through a new connection of the
    coordinator's account, which creates every enrolled device there; the connection
    (closing it detaches them)."""
    control = MqttTransport(coordinator_login(state))
    control.connect(timeout=15)
    try:
        accounts.attach(control)
    except BaseException:
        control.close()
        raise
    return control
