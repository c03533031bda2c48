"""Mosquitto's dynamic-security plugin: its configuration file and its control API.

This module owns speaking the plugin's language; what the accounts and rules
*are* is :mod:`coordinator.access.accounts`.

- :func:`initial_config` is the JSON file the plugin starts from
  (``plugin_opt_config_file``): the coordinator's account, and the devices
  enrolled so far, with passwords stored as the plugin stores them
  (PBKDF2-SHA512, :func:`hash_password`), never in clear. By default nobody may
  publish, subscribe or receive anything; roles grant exact topics.
- :class:`DynSec` sends commands over MQTT to ``$CONTROL/dynamic-security/v1``
  through a connection of the coordinator's account (an admin of the plugin)
  and waits for each answer, so a change is in force when the call returns.

[Note: dynamic security kicks on role changes]
Measured with Mosquitto 2.0.11: ``addClientRole`` and ``deleteRole``
disconnect the clients concerned, while ``addRoleACL`` and ``removeRoleACL``
change a role's rules in place and disconnect nobody. A device mid-job must
not be disconnected (its frames in flight would be lost), so every device has
one role of its own for its whole life, and a job's rights are ACL entries
added to and removed from that role. ``deleteClient`` disconnects the device:
that is revocation.
"""

from __future__ import annotations

import base64
import hashlib
import json
import queue
import secrets
import threading
from typing import Any, Protocol

from edge.transport.mqtt import MqttTransport

__all__ = [
    "ADMIN_ROLE",
    "DynSec",
    "DynSecControl",
    "DynSecError",
    "hash_password",
    "initial_config",
]

CONTROL_TOPIC = "$CONTROL/dynamic-security/v1"
RESPONSE_TOPIC = f"{CONTROL_TOPIC}/response"
ADMIN_ROLE = "edgetrain-coordinator"
_ITERATIONS = 101  # what mosquitto_ctrl and the plugin use


class DynSecError(RuntimeError):
    """The plugin refused a command, or did not answer in time; one line."""


def hash_password(password: str) -> dict[str, Any]:
    """The plugin's stored form of ``password``: PBKDF2-SHA512 with a random salt."""
    salt = secrets.token_bytes(12)
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, _ITERATIONS)
    return {
        "password": base64.b64encode(digest).decode(),
        "salt": base64.b64encode(salt).decode(),
        "iterations": _ITERATIONS,
    }


def _acl(acltype: str, topic: str, allow: bool = True) -> dict[str, Any]:
    return {"acltype": acltype, "topic": topic, "allow": allow}


def admin_acls() -> list[dict[str, Any]]:
    """The coordinator: everything under the product's topics, and the plugin's API."""
    out = []
    for topic in ("edgetrain/#", f"{CONTROL_TOPIC}/#"):
        out.append(_acl("publishClientSend", topic))
        out.append(_acl("publishClientReceive", topic))
        out.append(_acl("subscribePattern", topic))
        out.append(_acl("unsubscribePattern", topic))
    return out


def initial_config(
    admin: str, admin_hash: dict[str, Any], clients: list[dict[str, Any]], roles: list[dict]
) -> dict[str, Any]:
    """The plugin's configuration file: the admin account first, then ``clients`` and
    ``roles`` in the plugin's own format; deny by default."""
    return {
        "clients": [
            {"username": admin, **admin_hash, "roles": [{"rolename": ADMIN_ROLE}]},
            *clients,
        ],
        "roles": [{"rolename": ADMIN_ROLE, "acls": admin_acls()}, *roles],
        "defaultACLAccess": {
            "publishClientSend": False,
            "publishClientReceive": False,
            "subscribe": False,
            "unsubscribe": True,
        },
    }


class DynSecControl(Protocol):
    """What changes a running broker's accounts and rules: :class:`DynSec` (Mosquitto, over
    MQTT) or :class:`coordinator.access.dynsec_tables.DynSecTables` (the embedded broker)."""

    def call(self, *commands: dict[str, Any]) -> list[dict[str, Any]]:
        """Run ``commands``; their answers in order, or :class:`DynSecError` if one was refused."""
        ...


class DynSec:
    """The plugin's control API through ``control`` (connected as the plugin's admin).

    :meth:`call` sends commands and returns the answers once all arrived; any
    command the plugin refused raises :class:`DynSecError` (the others in the same
    call took effect). Calls are serialised.
    """

    def __init__(self, control: MqttTransport, timeout_s: float = 10.0) -> None:
        self.control = control
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._answers: queue.Queue[dict[str, Any]] = queue.Queue()
        self._subscribed = False

    def _on_response(self, _topic: str, payload: bytes) -> None:
        try:
            body = json.loads(payload)
        except ValueError:
            return
        for answer in body.get("responses", []) if isinstance(body, dict) else []:
            if isinstance(answer, dict):
                self._answers.put(answer)

    def call(self, *commands: dict[str, Any]) -> list[dict[str, Any]]:
        """Run ``commands`` (``{"command": ..., ...}``) and return their answers in order."""
        if not commands:
            return []
        with self._lock:
            if not self._subscribed:
                self.control.subscribe(RESPONSE_TOPIC, self._on_response)
                self._subscribed = True
            tag = secrets.token_hex(6)
            sent = [{**c, "correlationData": f"{tag}-{i}"} for i, c in enumerate(commands)]
            self.control.publish(CONTROL_TOPIC, json.dumps({"commands": sent}), 1)
            got: dict[str, dict[str, Any]] = {}
            while len(got) < len(sent):
                try:
                    answer = self._answers.get(timeout=self.timeout_s)
                except queue.Empty:
                    what = commands[len(got)]["command"]
                    raise DynSecError(
                        f"the broker's dynamic-security plugin did not answer {what} "
                        f"within {self.timeout_s:g} s (is it loaded, and this account its admin?)"
                    ) from None
                key = str(answer.get("correlationData", ""))
                if key.startswith(f"{tag}-"):
                    got[key] = answer
        answers = [got[c["correlationData"]] for c in sent]
        for command, answer in zip(commands, answers, strict=True):
            if "error" in answer:
                raise DynSecError(f"{command['command']}: {answer['error']}")
        return answers
