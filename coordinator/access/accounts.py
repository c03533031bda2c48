"""Who may use the coordinator's broker, and for what: accounts and ACLs that follow the plan.

This module owns the coordinator's side of broker security (the threat model is
in the README's Security section):

- **Accounts.** The coordinator's own (an admin of Mosquitto's dynamic-security
  plugin, :mod:`coordinator.access.dynsec`) and one per enrolled device, bound
  to the client id :func:`~edge.transport.credentials.device_client_id`, so no
  other account can take over a device's session. :meth:`BrokerAccounts.enroll`
  makes (or, for a device enrolled before, rotates) a device's password and
  returns its :class:`~edge.transport.credentials.Credentials`;
  :meth:`~BrokerAccounts.revoke` deletes the account, which disconnects the
  device at once.
- **Rules.** A device's own role lets it publish its status, profile and
  heartbeat and read its command topic; nothing else. While it holds a stage,
  :meth:`~BrokerAccounts.grant` adds exactly that stage's topics
  (:func:`edge.wire.topics.stage_access`) to its role, and
  :meth:`~BrokerAccounts.release` takes them back when the attempt ends: every
  assignment, re-plan and migration of the job engine goes through them
  (:func:`coordinator.engine.runners.run_on_agents`). Only the coordinator's
  account publishes commands.

The record of accounts (``accounts.json`` in the directory, mode 0600, read by
the coordinator only) is the source of the broker's accounts at each start.

[Note: devices are created live]
The plugin disconnects every client of a role whose ACL changes (its
``role__kick_all``), and a job's grants change a device's role. Measured with
Mosquitto 2.0.11: a client loaded from the plugin's file is disconnected by
``addRoleACL``; one made by ``createClient`` with its roles, while the broker
runs, is not (the role does not list it), and its rules still apply. A device
disconnected at an assignment would lose it (clean sessions), so the broker
starts with the coordinator's account only (:meth:`~BrokerAccounts.plugin_config`)
and :meth:`~BrokerAccounts.attach` creates every enrolled device through the API
(for the embedded amqtt broker, the same commands go to its tables,
:class:`~coordinator.access.dynsec_tables.DynSecTables`).
That needs the devices' passwords, so the record keeps them (not hashes): it is
as secret as the coordinator's own password beside them. The plugin stores its
own copy hashed. Should a later Mosquitto list such clients too, grants would
disconnect devices for a moment, and ``tests/security`` would fail.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import threading
from pathlib import Path
from typing import Any

from coordinator.access.dynsec import (
    DynSec,
    DynSecControl,
    DynSecError,
    hash_password,
    initial_config,
)
from edge.errors import UserError
from edge.files import PRIVATE, write_atomic
from edge.transport.credentials import Credentials, device_client_id
from edge.transport.mqtt import MqttTransport
from edge.transport.settings import MqttSettings
from edge.wire.messages import StageAssignment
from edge.wire.topics import (
    device_cmd,
    device_heartbeat,
    device_probe,
    device_profile,
    device_status,
    device_units,
    stage_access,
    valid_device_id,
)

__all__ = ["COORDINATOR_USER", "BrokerAccounts"]

log = logging.getLogger("edgetrain.access")

COORDINATOR_USER = "edgetrain-coordinator"
_Rule = tuple[str, str]  # (acltype, topic)


def _role(device: str) -> str:
    return f"device-{device}"


def _own_rules(device: str) -> list[_Rule]:
    """What a device may always do: announce itself, hear its commands, answer one that
    times its units, and send its transport probe to itself."""
    return [
        ("publishClientSend", device_status(device)),
        ("publishClientSend", device_profile(device)),
        ("publishClientSend", device_heartbeat(device)),
        ("subscribeLiteral", device_cmd(device)),
        ("publishClientReceive", device_cmd(device)),
        ("publishClientSend", device_units(device)),
        ("publishClientSend", device_probe(device)),
        ("subscribeLiteral", device_probe(device)),
        ("publishClientReceive", device_probe(device)),
    ]


def _stage_rules(device: str, a: StageAssignment) -> list[_Rule]:
    sizes = None if a.group_samples is None else [len(g) for g in a.group_samples]
    access = stage_access(
        a.job,
        a.stage,
        a.num_stages,
        device,
        replicate=bool(a.replicate_every or a.handover),
        member=a.member,
        group_sizes=sizes,
        labels_local=a.labels_local,
    )
    rules = [("publishClientSend", t) for t in access.publish]
    for topic in access.read:
        rules += [("subscribeLiteral", topic), ("publishClientReceive", topic)]
    return rules


class BrokerAccounts:
    """The accounts of one broker, recorded in ``directory`` (see the module docstring).

    ``broker_url`` and ``ca_pem`` are what credentials files tell devices: how to
    reach the broker and which CA signed its certificate.
    """

    def __init__(self, directory: Path, broker_url: str, ca_pem: str | None) -> None:
        self.directory = directory
        self.broker_url = broker_url
        self.ca_pem = ca_pem
        self._path = directory / "accounts.json"
        self._lock = threading.Lock()
        self._dynsec: DynSecControl | None = None
        self._granted: dict[str, list[tuple[str, _Rule]]] = {}  # job -> (device, rule)
        self.record = self._load()

    # -- the record --------------------------------------------------------------------

    def _load(self) -> dict[str, Any]:
        if not self._path.exists():
            record = {
                "coordinator": {
                    "username": COORDINATOR_USER,
                    "password": secrets.token_urlsafe(24),
                },
                "devices": {},
            }
            write_atomic(self._path, json.dumps(record, indent=2), mode=PRIVATE)
            return record
        try:
            record = json.loads(self._path.read_text())
        except (OSError, ValueError) as exc:
            raise UserError(f"broker accounts {self._path}: unreadable ({exc})") from None
        ok = isinstance(record, dict) and isinstance(record.get("devices"), dict)
        if not ok or not isinstance(record.get("coordinator"), dict):
            raise UserError(f"broker accounts {self._path}: not an accounts record")
        return record

    def _save(self) -> None:
        write_atomic(self._path, json.dumps(self.record, indent=2), mode=PRIVATE)

    @property
    def coordinator(self) -> tuple[str, str]:
        """The coordinator's own user name and password."""
        c = self.record["coordinator"]
        return str(c["username"]), str(c["password"])

    def login(self, url: str) -> MqttSettings:
        """The coordinator's login on the broker at ``url``, verifying it by :attr:`ca_pem`."""
        user, password = self.coordinator
        return MqttSettings(
            url=url,
            username=user,
            password=password,  # type: ignore[arg-type]
            tls_ca_pem=self.ca_pem,
        )

    def devices(self) -> list[str]:
        """The enrolled devices."""
        with self._lock:
            return sorted(self.record["devices"])

    def plugin_config(self) -> dict[str, Any]:
        """The dynamic-security plugin's file for a broker starting now: the coordinator's
        account only. :meth:`attach` then creates every enrolled device through the
        plugin's API ([Note: devices are created live])."""
        name, password = self.coordinator
        return initial_config(name, hash_password(password), [], [])

    # -- live changes ------------------------------------------------------------------

    def attach(self, control: MqttTransport | DynSecControl) -> None:
        """From now on, apply changes to the running broker through ``control``: a
        connection of the coordinator's account (Mosquitto's plugin), or the tables of
        a broker in this process. First, (re)create every enrolled device in it: one the
        broker already has (another coordinator made it, or its file held it after a
        restart) is deleted first, which disconnects it once, now, rather than at a grant
        ([Note: devices are created live])."""
        self._dynsec = DynSec(control) if isinstance(control, MqttTransport) else control
        with self._lock:
            devices = {d: str(entry["password"]) for d, entry in self.record["devices"].items()}
        stale = [
            {"command": c, key: name}
            for device in sorted(devices)
            for c, key, name in (
                ("deleteClient", "username", device),
                ("deleteRole", "rolename", _role(device)),
            )
        ]
        with contextlib.suppress(DynSecError):  # "not found": the usual case
            self._call(*stale)
        self._call(*[c for d, pw in sorted(devices.items()) for c in self._create(d, pw)])

    @staticmethod
    def _create(device: str, password: str) -> list[dict[str, Any]]:
        acls = [{"acltype": t, "topic": topic, "allow": True} for t, topic in _own_rules(device)]
        return [
            {"command": "createRole", "rolename": _role(device), "acls": acls},
            {
                "command": "createClient",
                "username": device,
                "password": password,
                "clientid": device_client_id(device),
                "roles": [{"rolename": _role(device)}],
            },
        ]

    def _call(self, *commands: dict[str, Any]) -> None:
        if self._dynsec is not None:
            self._dynsec.call(*commands)

    def enroll(self, device: str) -> Credentials:
        """A new password for ``device`` (an account if it had none); its credentials."""
        if not valid_device_id(device):
            raise UserError(
                f"device id {device!r}: use 1-64 of A-Z a-z 0-9 _ . - (starting with a letter "
                "or digit)"
            )
        if device == COORDINATOR_USER:
            raise UserError(f"device id {device!r} is the coordinator's own account")
        password = secrets.token_urlsafe(24)
        with self._lock:
            known = device in self.record["devices"]
            if known:
                self._call(
                    {"command": "setClientPassword", "username": device, "password": password}
                )
            else:
                self._call(*self._create(device, password))
            self.record["devices"][device] = {"password": password}
            self._save()
        log.info("%s device %s", "rotated the password of" if known else "enrolled", device)
        return Credentials(
            broker=self.broker_url,
            device_id=device,
            username=device,
            password=password,  # type: ignore[arg-type]
            ca=self.ca_pem,
        )

    def revoke(self, device: str) -> None:
        """Delete ``device``'s account: it is disconnected and cannot log in again."""
        with self._lock:
            if device not in self.record["devices"]:
                raise UserError(f"device {device!r} is not enrolled")
            self._call(
                {"command": "deleteClient", "username": device},
                {"command": "deleteRole", "rolename": _role(device)},
            )
            del self.record["devices"][device]
            self._save()
        log.info("revoked device %s", device)

    def grant(self, job: str, stages: list[tuple[str, StageAssignment]]) -> None:
        """Let each ``(device, assignment)`` use that stage's topics (for ``job``)."""
        granted: list[tuple[str, _Rule]] = []
        commands = []
        with self._lock:
            for device, a in stages:
                if device not in self.record["devices"]:
                    raise UserError(f"job {job}: device {device} has no account on the broker")
                for rule in _stage_rules(device, a):
                    if (device, rule) in granted:  # a device with two stages of a U
                        continue
                    granted.append((device, rule))
                    commands.append(
                        {
                            "command": "addRoleACL",
                            "rolename": _role(device),
                            "acltype": rule[0],
                            "topic": rule[1],
                            "allow": True,
                        }
                    )
            self._granted.setdefault(job, []).extend(granted)
        self._call(*commands)

    def release(self, job: str) -> None:
        """Take back everything granted for ``job``; a revoked device's rules went with it."""
        with self._lock:
            granted = self._granted.pop(job, [])
            live = set(self.record["devices"])
        commands = [
            {"command": "removeRoleACL", "rolename": _role(device), "acltype": t, "topic": topic}
            for device, (t, topic) in granted
            if device in live
        ]
        try:
            self._call(*commands)
        except DynSecError as exc:  # a device revoked meanwhile: its role is gone
            log.warning("job %s: taking back its topics: %s", job, exc)
