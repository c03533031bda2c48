"""The embedded amqtt broker's own parts: its broker class, its security plugins, its config.

This module owns what :func:`coordinator.local.broker.start_broker` runs when there
is no Mosquitto (imported late: a device install has no amqtt):

- :class:`EmbeddedBroker`, amqtt's broker with three fixes. It authenticates a
  CONNECT *before* it looks up the client id's session: amqtt itself first
  deletes (clean session) or takes over the session of that id and only then asks
  its plugins, so anyone who can reach the port could cut a device off with its
  client id and no password. And it closes a client's socket when the broker stops.
  And it delivers each message to every subscriber even while subscriptions change:
  amqtt iterated its live subscription table across the ACL plugin's awaits, so a
  client subscribing or leaving meanwhile made it drop the message for every
  subscriber it had not reached yet (seen as a device missing a frame).
  :meth:`EmbeddedBroker.kick` disconnects the clients of some accounts and forgets
  their sessions (revocation). amqtt speaks MQTT 3.1.1 only, and reads the rest of
  any CONNECT as 3.1.1's: an MQTT v5 one (properties first) is misread, and with a
  login it waits for bytes that never come, the client left without an answer. So the
  protocol level is read first and any other is refused at once with CONNACK 0x01, as
  3.1.1 says (a v5 client reads it as Unsupported Protocol Version).
- :class:`AccountsAuth` and :class:`AccountsAcl`, plugins on amqtt's own plugin API
  that ask a :class:`~coordinator.access.dynsec_tables.DynSecTables` (Mosquitto's
  dynamic-security semantics, in memory): no anonymous client, each password checked
  against the accounts record's PBKDF2 hash, a device only under its own client id,
  and every publish, subscription and delivery checked against its role, rules that
  the coordinator changes while the broker runs. A last will is a publish: one on a
  topic the account may not publish to is refused at CONNECT, as Mosquitto does.
- :func:`broker_config`: a TLS listener with the broker's certificate and those
  plugins, or (no security) plain and anonymous; never a plugin that writes files.

Tested in tests/integration/test_amqtt_security.py (its accounts and ACLs, attacked),
tests/integration/test_broker.py (it as a plain broker) and
tests/integration/test_mqtt5_clients.py::test_amqtt_refuses_a_v5_client_at_once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass
from typing import Any

from amqtt.adapters import ReaderAdapter
from amqtt.broker import Broker
from amqtt.contexts import Action
from amqtt.errors import AMQTTError, MQTTError, NoDataError
from amqtt.mqtt.connack import UNACCEPTABLE_PROTOCOL_VERSION, ConnackPacket
from amqtt.mqtt.connect import ConnectVariableHeader
from amqtt.mqtt.constants import QOS_1, QOS_2
from amqtt.mqtt.packet import CONNECT, MQTTFixedHeader
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
from amqtt.plugins.base import BaseAuthPlugin, BaseTopicPlugin
from amqtt.session import Session
from amqtt.utils import format_client_message, gen_client_id

from coordinator.access.dynsec_tables import DynSecTables
from coordinator.local.broker import BrokerSecurity

__all__ = ["AccountsAcl", "AccountsAuth", "EmbeddedBroker", "broker_config"]

_KIND = {
    Action.PUBLISH: "publishClientSend",
    Action.SUBSCRIBE: "subscribe",
    Action.RECEIVE: "publishClientReceive",
}


@dataclass
class _Tables:
    tables: Any = None
    """The :class:`DynSecTables` to ask (an object: amqtt hands the config over as is)."""


def _tables(config: Any) -> DynSecTables:
    tables = getattr(config, "tables", None)
    if not isinstance(tables, DynSecTables):
        raise TypeError("the accounts plugins need their DynSecTables in 'tables'")
    return tables


class AccountsAuth(BaseAuthPlugin):
    """Logs in the accounts of a :class:`DynSecTables`; refuses everyone else."""

    Config = _Tables

    async def authenticate(self, *, session: Session) -> bool:
        tables = _tables(self.config)
        if not tables.login(session.username, session.password, session.client_id):
            return False
        will = session.will_topic if session.will_flag else None
        return will is None or tables.allowed(session.username, "publishClientSend", will)


class AccountsAcl(BaseTopicPlugin):
    """Lets an account publish, subscribe and receive as its roles say."""

    Config = _Tables

    async def topic_filtering(
        self,
        *,
        session: Session | None = None,
        topic: str | None = None,
        action: Action | None = None,
    ) -> bool:
        if session is None or topic is None or action not in _KIND:
            return False
        return _tables(self.config).allowed(session.username, _KIND[action], topic)


_MQTT_311 = 4
"""The protocol level of MQTT 3.1.1 in a CONNECT, the only one amqtt speaks."""


class _Replay(ReaderAdapter):
    """A reader that gives ``head`` (bytes already read from ``reader``) again first."""

    def __init__(self, head: bytes, reader: ReaderAdapter) -> None:
        self._head = head
        self._reader = reader

    async def read(self, n: int = -1) -> bytes:
        if n < 0:
            head, self._head = self._head, b""
            return head + await self._reader.read(n)
        head, self._head = self._head[:n], self._head[n:]
        return head + (await self._reader.read(n - len(head)) if n > len(head) else b"")

    def feed_eof(self) -> None:
        self._reader.feed_eof()


class EmbeddedBroker(Broker):
    """amqtt's broker, authenticating before any session is touched (module docstring)."""

    async def stream_connected(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, listener_name: str
    ) -> None:
        try:
            await super().stream_connected(reader, writer, listener_name)
        finally:  # amqtt leaves the socket of a client that was mid-disconnect at stop open
            writer.close()

    async def _initialize_client_session(
        self, reader: Any, writer: Any, remote_address: str, remote_port: int
    ) -> tuple[BrokerProtocolHandler, Session]:
        # amqtt 0.12.1's own, with the authentication moved before the session lookup
        # and other protocol levels than 3.1.1's refused first.
        where = format_client_message(address=remote_address, port=remote_port)
        try:
            connect = await self._mqtt_311_only(reader, writer)
            handler, session = await BrokerProtocolHandler.init_from_connect(
                connect, writer, self.plugins_manager
            )
        except MQTTError as exc:
            with contextlib.suppress(OSError):  # refused: the client may hang up first
                await writer.close()
            raise MQTTError(f"invalid connection from {where}: {exc}") from exc
        except (AMQTTError, NoDataError) as exc:
            raise AMQTTError(f"{where}: cannot read a CONNECT: {exc}") from exc
        if not await self._authenticate(session, None):
            handler.attach(session, reader, writer)
            with contextlib.suppress(OSError):  # the client may hang up first
                await handler.mqtt_connack_authorize(False)
                await writer.close()
            raise AMQTTError(
                f"{where}: not authorised (user {session.username!r}, client {session.client_id!r})"
            )
        if session.clean_session:
            if session.client_id:
                await self._delete_session(session.client_id)
            else:
                session.client_id = gen_client_id()
            session.parent = 0
        elif session.client_id in self._sessions:
            old, _ = self._sessions[session.client_id]
            for name in ("will_flag", "will_message", "will_topic", "will_qos", "keep_alive"):
                setattr(old, name, getattr(session, name))
            old.username, old.password = session.username, session.password
            session = old
            session.parent = 1
        else:
            session.parent = 0
        return handler, session

    @staticmethod
    async def _mqtt_311_only(reader: Any, writer: Any) -> ReaderAdapter:
        """Refuse a CONNECT of another protocol level than 3.1.1's before amqtt reads its
        payload (module docstring); else a reader that gives its headers again."""
        fixed = await MQTTFixedHeader.from_stream(reader)
        if fixed is None:
            raise NoDataError("no CONNECT")
        head = fixed.to_bytes()
        if fixed.packet_type == CONNECT:  # anything else: amqtt's own answer
            variable = await ConnectVariableHeader.from_stream(reader, fixed)
            if variable.proto_level != _MQTT_311:
                with contextlib.suppress(OSError):  # the client may hang up first
                    await ConnackPacket.build(0, UNACCEPTABLE_PROTOCOL_VERSION).to_stream(writer)
                raise MQTTError(f"protocol level {variable.proto_level}: MQTT 3.1.1 only")
            head += variable.to_bytes()
        return _Replay(head, reader)

    async def _run_broadcast(self, running_tasks: deque[asyncio.Task[Any]]) -> None:
        # amqtt 0.12.1's own, over a copy of the subscriptions: it iterated the live dict
        # across the ACL plugin's awaits, so a subscription or disconnect meanwhile raised
        # "dictionary changed size during iteration" and the message never reached the
        # subscribers after that point (module docstring).
        broadcast = await self._broadcast_queue.get()
        topic = broadcast["topic"]
        for a_filter, subscriptions in list(self._subscriptions.items()):
            if not self._matches(topic, a_filter):
                continue
            for session, sub_qos in list(subscriptions):
                qos = broadcast.get("qos", sub_qos)
                if not await self._topic_filtering(session, topic=topic, action=Action.RECEIVE):
                    continue
                connected = session.transitions.state == "connected"
                if not connected and not session.clean_session and qos in (QOS_1, QOS_2):
                    if not session.is_anonymous:  # MQTT 3.1.2.4: kept for its return
                        await self._retain_broadcast_message(broadcast, qos, session)
                    continue
                handler = self._get_handler(session) if connected else None
                if handler:
                    publish = handler.mqtt_publish(topic, broadcast["data"], qos, retain=False)
                    running_tasks.append(asyncio.ensure_future(publish))

    async def kick(self, usernames: list[str]) -> None:
        """Disconnect every client logged in as one of ``usernames`` and forget its session."""
        for client_id, (session, handler) in list(self._sessions.items()):
            if session.username in usernames:
                if session.transitions.is_connected():
                    await handler.stop()
                await self._delete_session(client_id)


def broker_config(
    bind: str, port: int, security: BrokerSecurity | None, tables: DynSecTables | None
) -> dict[str, Any]:
    """amqtt's configuration: with ``security``, a TLS listener with its certificate and
    the accounts plugins asking ``tables``; without, plain and anonymous."""
    listener: dict[str, Any] = {"type": "tcp", "bind": f"{bind}:{port}"}
    if security is None or tables is None:
        # Only anonymous auth: no $SYS publisher, no packet/event loggers, no files.
        plugins: dict[str, Any] = {
            "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}
        }
        return {"listeners": {"default": listener}, "plugins": plugins}
    listener.update(ssl=True, certfile=str(security.tls.cert), keyfile=str(security.tls.key))
    plugins = {f"{__name__}.{p.__name__}": {"tables": tables} for p in (AccountsAuth, AccountsAcl)}
    return {"listeners": {"default": listener}, "plugins": plugins}
