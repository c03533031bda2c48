"""The broker a command owns, secure by default: TLS, accounts, ACLs that follow the plan.

This module owns starting a broker together with its security, for
``edgetrain coordinator``, ``demo`` and ``train`` (``testbed up`` and
``testbed compose`` write the same files for their own broker processes):

1. the TLS files (:func:`coordinator.access.certs.broker_tls`) and the accounts
   record (:class:`coordinator.access.accounts.BrokerAccounts`) in a directory
   (the coordinator's data directory, or a temporary one for a one-off run);
2. Mosquitto, TLS-only, with the dynamic-security plugin's file written from that
   record (:func:`coordinator.local.broker.start_broker`); without Mosquitto, the
   embedded amqtt broker, TLS-only, whose own plugins hold the same file in memory
   (:mod:`coordinator.local.amqtt_embedded`);
3. one connection of the coordinator's own account, through which accounts and
   rules change while Mosquitto runs (amqtt runs in this process: they change in
   its tables directly, :attr:`coordinator.local.broker.AmqttBroker.tables`).

:meth:`OwnedBroker.settings` gives every other connection of the coordinator the
same login. On a device install (no ``cryptography``), or with ``secure=False``,
the broker is anonymous and plain: :attr:`OwnedBroker.accounts` is ``None``, and
agents need ``--insecure``.

Tested in tests/integration/test_stage_grants.py (each device's rights, on Mosquitto and
on amqtt), tests/integration/test_amqtt_security.py (amqtt where Mosquitto is missing)
and tests/security/test_attacker.py.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

from coordinator.access.accounts import BrokerAccounts
from coordinator.local.broker import (
    HOST,
    MAX_PACKET,
    AmqttBroker,
    BrokerSecurity,
    BrokerStartError,
    RunningBroker,
    start_broker,
)
from edge.errors import UserError
from edge.transport.mqtt import MqttTransport
from edge.transport.settings import MqttSettings

__all__ = ["OwnedBroker", "start_owned_broker"]

log = logging.getLogger("edgetrain.broker")


@dataclass
class OwnedBroker:
    """A running broker, its accounts (``None``: anonymous) and the admin connection."""

    broker: RunningBroker
    accounts: BrokerAccounts | None
    admin: MqttTransport | None

    @property
    def url(self) -> str:
        return self.broker.url

    @property
    def secure(self) -> bool:
        return self.accounts is not None

    def settings(self, **extra: object) -> MqttSettings:
        """MQTT settings of the coordinator's account (anonymous when not secure)."""
        if self.accounts is None:
            return MqttSettings(url=self.url, **extra)  # type: ignore[arg-type]
        return self.accounts.login(self.url).model_copy(update=extra)

    def describe(self) -> str:
        how = "TLS, accounts and ACLs" if self.secure else "anonymous, no TLS"
        return f"{self.broker.describe()}, {how}"

    def stop(self) -> None:
        if self.admin is not None:
            self.admin.close()
            self.admin = None
        self.broker.stop()


def start_owned_broker(
    directory: Path,
    *,
    secure: bool = True,
    prefer: str = "auto",
    port: int | None = None,
    log_dir: Path | None = None,
    hosts: list[str] | None = None,
    bind: str | None = None,
    max_packet: int = MAX_PACKET,
) -> OwnedBroker:
    """Start a broker whose security lives in ``directory`` (see the module docstring).

    ``hosts`` are further names devices reach it by (its certificate names them, and
    credentials files give the first); with any, it listens on every interface unless
    ``bind`` says where. ``max_packet``: the largest message it takes (a broker started
    for one job: :func:`coordinator.engine.spec.largest_message_bytes`). A broker that
    does not start is a one-line :class:`~edge.errors.UserError`.
    """
    bind = bind or ("0.0.0.0" if hosts else HOST)
    if secure and importlib.util.find_spec("cryptography") is None:  # a device install
        log.warning(
            "no TLS for the broker: it needs the cryptography package (pip install "
            "'edgetrain[coordinator]'); the broker is anonymous, anyone who can reach it can "
            "drive its agents"
        )
        secure = False
    if not secure:
        return OwnedBroker(_start(prefer, port, log_dir, None, bind, max_packet), None, None)
    from coordinator.access.certs import broker_tls

    tls = broker_tls(directory / "tls", hosts)
    accounts = BrokerAccounts(directory, "", tls.ca_pem)
    security = BrokerSecurity(tls, accounts.plugin_config())
    broker = _start(prefer, port, log_dir, security, bind, max_packet)
    accounts.broker_url = f"mqtts://{hosts[0]}:{broker.port}" if hosts else broker.url
    owned = OwnedBroker(broker, accounts, None)
    try:
        owned.admin = MqttTransport(owned.settings())
        owned.admin.connect(timeout=15)
        tables = broker.tables if isinstance(broker, AmqttBroker) else None
        accounts.attach(tables or owned.admin)
    except BaseException:
        owned.stop()
        raise
    return owned


def _start(
    prefer: str,
    port: int | None,
    log_dir: Path | None,
    security: BrokerSecurity | None,
    bind: str,
    max_packet: int,
) -> RunningBroker:
    try:
        return start_broker(
            prefer, port, log_dir, security=security, bind=bind, max_packet=max_packet
        )
    except BrokerStartError as exc:
        raise UserError(f"could not start a broker: {str(exc).splitlines()[0]}") from None
