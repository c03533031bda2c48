"""Mosquitto's dynamic-security plugin, in memory: for a broker that runs in this process.

This module owns the plugin's *semantics* for the embedded amqtt broker
(:mod:`coordinator.local.amqtt_embedded`), which has no such plugin:

- :class:`DynSecTables` starts from the very file the plugin starts from
  (:meth:`coordinator.access.accounts.BrokerAccounts.plugin_config`: clients with
  PBKDF2-SHA512 hashes, the client id each is bound to, roles, deny by default);
- :meth:`DynSecTables.call` applies the commands :class:`~coordinator.access.dynsec.DynSec`
  would send over MQTT (``createClient``, ``deleteClient``, ``setClientPassword``,
  ``createRole``, ``deleteRole``, ``addRoleACL``, ``removeRoleACL``), with the
  plugin's answers and errors, so that :class:`~coordinator.access.accounts.BrokerAccounts`
  stays the one definition of who may do what, whichever broker runs;
- :meth:`~DynSecTables.login` and :meth:`~DynSecTables.allowed` are the checks the
  broker's plugins make on every connection, publish, subscription and delivery.

As in Mosquitto (see [Note: dynamic security kicks on role changes]),
``deleteClient`` and ``deleteRole`` disconnect the clients concerned (through
:attr:`DynSecTables.on_kick`, which the broker sets), ACL changes do not. Calls
come from the coordinator's threads and checks from the broker's loop: a lock
guards the tables, and nobody waits for the broker while holding it.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import hmac
import threading
from collections.abc import Callable
from typing import Any

from coordinator.access.dynsec import DynSecError, hash_password

__all__ = ["ACL_TYPES", "DynSecTables", "topic_matches"]

ACL_TYPES = (
    "publishClientSend",
    "publishClientReceive",
    "subscribeLiteral",
    "subscribePattern",
    "unsubscribeLiteral",
    "unsubscribePattern",
)
_DEFAULT_KEY = {  # defaultACLAccess's key for each kind of check
    "publishClientSend": "publishClientSend",
    "publishClientReceive": "publishClientReceive",
    "subscribe": "subscribe",
    "unsubscribe": "unsubscribe",
}


def topic_matches(pattern: str, topic: str) -> bool:
    """Whether the MQTT filter ``pattern`` (``+``, ``#``) matches ``topic``; wildcards in
    ``topic`` are plain characters (a subscription filter checked against a pattern)."""
    want, got = pattern.split("/"), topic.split("/")
    for i, level in enumerate(want):
        if level == "#":
            return i == len(want) - 1
        if i >= len(got) or (level != "+" and level != got[i]):
            return False
    return len(want) == len(got)


def _check(stored: dict[str, Any], password: str) -> bool:
    try:
        salt = base64.b64decode(stored["salt"])
        digest = base64.b64decode(stored["password"])
        iterations = int(stored["iterations"])
    except (KeyError, TypeError, ValueError):
        return False
    mine = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)
    return hmac.compare_digest(mine, digest)


class DynSecTables:
    """Accounts and roles of one broker, in the plugin's own format (see the module docstring).

    ``config`` is the plugin's configuration file (copied, not kept).
    """

    def __init__(self, config: dict[str, Any]) -> None:
        self._lock = threading.Lock()
        self._clients: dict[str, dict[str, Any]] = {}
        self._roles: dict[str, list[dict[str, Any]]] = {}
        config = copy.deepcopy(config)
        for client in config.get("clients", []):
            self._clients[client["username"]] = client
        for role in config.get("roles", []):
            self._roles[role["rolename"]] = list(role.get("acls", []))
        self._default: dict[str, bool] = {
            "publishClientSend": False,
            "publishClientReceive": False,
            "subscribe": False,
            "unsubscribe": True,
            **config.get("defaultACLAccess", {}),
        }
        self.on_kick: Callable[[list[str]], None] | None = None
        """Disconnects the clients of these user names (set by the broker once it runs)."""

    # -- the checks ----------------------------------------------------------------------

    def login(self, username: str | None, password: str | None, client_id: str | None) -> bool:
        """Whether this CONNECT may log in: a known account, its password, and the client
        id its account is bound to (if any). No user name: refused (no anonymous client)."""
        if not username:
            return False
        with self._lock:
            client = self._clients.get(username)
            if client is None or client.get("disabled"):
                return False
            bound = client.get("clientid")
            stored = {k: client.get(k) for k in ("password", "salt", "iterations")}
        if bound and bound != client_id:
            return False
        return _check(stored, password or "")

    def allowed(self, username: str | None, kind: str, topic: str) -> bool:
        """Whether ``username`` may ``kind`` (``publishClientSend``, ``publishClientReceive``,
        ``subscribe``, ``unsubscribe``) on ``topic`` (a subscription filter for the last
        two): the first of its roles' rules that matches decides, else the default."""
        if kind not in _DEFAULT_KEY:
            raise ValueError(f"unknown ACL check {kind!r}")
        with self._lock:
            client = self._clients.get(username or "")
            if client is None:
                return False
            for acl in self._acls_of(client):
                if self._applies(acl, kind, topic):
                    return bool(acl.get("allow", False))
            return self._default[_DEFAULT_KEY[kind]]

    def _acls_of(self, client: dict[str, Any]) -> list[dict[str, Any]]:
        roles = sorted(client.get("roles", []), key=lambda r: -int(r.get("priority", -1)))
        out: list[dict[str, Any]] = []
        for role in roles:
            acls = self._roles.get(role["rolename"], [])
            out += sorted(acls, key=lambda a: -int(a.get("priority", -1)))
        return out

    @staticmethod
    def _applies(acl: dict[str, Any], kind: str, topic: str) -> bool:
        t, pattern = acl.get("acltype"), str(acl.get("topic", ""))
        if kind in ("subscribe", "unsubscribe"):
            if t == f"{kind}Literal":
                return pattern == topic
            return t == f"{kind}Pattern" and topic_matches(pattern, topic)
        return t == kind and topic_matches(pattern, topic)

    # -- the commands --------------------------------------------------------------------

    def call(self, *commands: dict[str, Any]) -> list[dict[str, Any]]:
        """Apply ``commands`` in order and return the plugin's answers; any refused raises
        :class:`~coordinator.access.dynsec.DynSecError` (the others took effect)."""
        answers: list[dict[str, Any]] = []
        kick: list[str] = []
        with self._lock:
            for command in commands:
                name = str(command.get("command", ""))
                try:
                    kick += self._apply(name, command)
                    answers.append({"command": name})
                except _Refused as exc:
                    answers.append({"command": name, "error": str(exc)})
                except KeyError as exc:
                    answers.append({"command": name, "error": f"Missing {exc.args[0]}"})
        if kick and self.on_kick is not None:  # outside the lock: the broker's loop checks
            self.on_kick(sorted(set(kick)))
        for answer in answers:
            if "error" in answer:
                raise DynSecError(f"{answer['command']}: {answer['error']}")
        return answers

    def _apply(self, name: str, c: dict[str, Any]) -> list[str]:
        """One command (lock held); the user names to disconnect."""
        if name == "createClient":
            if c["username"] in self._clients:
                raise _Refused("Client already exists")
            roles = [dict(r) for r in c.get("roles", [])]
            if any(r["rolename"] not in self._roles for r in roles):
                raise _Refused("Role not found")
            self._clients[c["username"]] = {
                "username": c["username"],
                "clientid": c.get("clientid"),
                "roles": roles,
                **hash_password(str(c["password"])),
            }
        elif name == "deleteClient":
            if self._clients.pop(c["username"], None) is None:
                raise _Refused("Client not found")
            return [c["username"]]
        elif name == "setClientPassword":
            client = self._clients.get(c["username"])
            if client is None:
                raise _Refused("Client not found")
            client.update(hash_password(str(c["password"])))
        elif name == "createRole":
            if c["rolename"] in self._roles:
                raise _Refused("Role already exists")
            self._roles[c["rolename"]] = [dict(a) for a in c.get("acls", [])]
        elif name == "deleteRole":
            if self._roles.pop(c["rolename"], None) is None:
                raise _Refused("Role not found")
            holders = []
            for user, client in self._clients.items():
                kept = [r for r in client.get("roles", []) if r["rolename"] != c["rolename"]]
                if len(kept) != len(client.get("roles", [])):
                    client["roles"] = kept
                    holders.append(user)
            return holders
        elif name == "addRoleACL":
            acls = self._role(c["rolename"])
            if c["acltype"] not in ACL_TYPES:
                raise _Refused("Invalid acltype")
            if any(a["acltype"] == c["acltype"] and a["topic"] == c["topic"] for a in acls):
                raise _Refused("ACL with this topic already exists")
            acls.append({k: c[k] for k in ("acltype", "topic", "allow", "priority") if k in c})
        elif name == "removeRoleACL":
            acls = self._role(c["rolename"])
            kept = [a for a in acls if (a["acltype"], a["topic"]) != (c["acltype"], c["topic"])]
            if len(kept) == len(acls):
                raise _Refused("ACL not found")
            acls[:] = kept
        else:
            raise _Refused("Unknown command")
        return []

    def _role(self, name: str) -> list[dict[str, Any]]:
        if name not in self._roles:
            raise _Refused("Role not found")
        return self._roles[name]


class _Refused(Exception):
    """A command the plugin would answer with an error."""
