"""The dynamic-security plugin in memory, driven by the accounts record as a broker would be.

No broker here: tests/integration/test_amqtt_security.py runs these tables inside the
embedded amqtt broker, with real clients.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.access.accounts import BrokerAccounts
from coordinator.access.dynsec import DynSecError
from coordinator.access.dynsec_tables import DynSecTables, topic_matches
from edge.wire.messages import StageAssignment
from edge.wire.topics import device_cmd, device_probe, device_status, job_weights, stage_topic


@pytest.mark.parametrize(
    ("pattern", "topic", "match"),
    [
        ("a/b", "a/b", True),
        ("a/+", "a/b", True),
        ("a/+", "a/b/c", False),
        ("a/#", "a", True),
        ("a/#", "a/b/c", True),
        ("a/b", "a/+", False),  # a wildcard subscription is not the literal topic
        ("a/+/c", "a/b", False),
        ("edgetrain/#", "other/x", False),
    ],
)
def test_topic_matches(pattern: str, topic: str, match: bool) -> None:
    assert topic_matches(pattern, topic) is match


def test_the_record_logs_in_and_the_commands_follow_the_plan(tmp_path: Path) -> None:
    accounts = BrokerAccounts(tmp_path, "mqtts://gw:8883", None)
    old = accounts.enroll("pi-1").password.get_secret_value()
    tables = DynSecTables(accounts.plugin_config())
    kicked: list[list[str]] = []
    tables.on_kick = kicked.append
    accounts.attach(tables)
    admin, admin_password = accounts.coordinator

    assert tables.login("pi-1", old, "agent-pi-1")
    assert not tables.login("pi-1", old, "agent-pi-2")  # bound to its own client id
    assert not tables.login("pi-1", old + "x", "agent-pi-1")
    assert not tables.login(None, None, "agent-pi-1")  # no anonymous client
    assert tables.login(admin, admin_password, "any-id")
    new = accounts.enroll("pi-1").password.get_secret_value()  # rotation
    assert tables.login("pi-1", new, "agent-pi-1") and not tables.login("pi-1", old, "agent-pi-1")

    assert tables.allowed("pi-1", "publishClientSend", device_status("pi-1"))
    assert not tables.allowed("pi-1", "publishClientSend", device_status("pi-2"))
    assert not tables.allowed("pi-1", "publishClientSend", device_cmd("pi-1"))
    assert tables.allowed("pi-1", "subscribe", device_cmd("pi-1"))
    assert not tables.allowed("pi-1", "subscribe", "edgetrain/devices/+/cmd")
    # Its transport probe goes to itself through the broker, and only to itself.
    for acl in ("publishClientSend", "subscribe", "publishClientReceive"):
        assert tables.allowed("pi-1", acl, device_probe("pi-1"))
        assert not tables.allowed("pi-1", acl, device_probe("pi-2"))
    assert tables.allowed(admin, "subscribe", "edgetrain/#")
    assert tables.allowed(admin, "publishClientSend", device_cmd("pi-1"))
    assert not tables.allowed(admin, "publishClientSend", "elsewhere/x")

    a = StageAssignment(
        job="j1", stage=1, num_stages=2, start=1, end=3, model="mlp", dataset="digits",
        steps=1, batch_size=4,
    )  # fmt: skip
    accounts.grant("j1", [("pi-1", a)])
    assert tables.allowed("pi-1", "publishClientSend", job_weights("j1", 1))
    assert tables.allowed("pi-1", "publishClientSend", stage_topic("j1", 0, "bwd"))
    assert tables.allowed("pi-1", "publishClientReceive", stage_topic("j1", 1, "fwd"))
    assert not tables.allowed("pi-1", "publishClientSend", stage_topic("j1", 1, "fwd"))
    with pytest.raises(DynSecError, match="addRoleACL: ACL with this topic already exists"):
        accounts.grant("j1", [("pi-1", a)])  # as Mosquitto answers
    accounts.release("j1")
    assert not tables.allowed("pi-1", "publishClientSend", job_weights("j1", 1))
    assert not tables.allowed("pi-1", "publishClientReceive", stage_topic("j1", 1, "fwd"))
    assert kicked == []  # rule changes disconnect nobody

    accounts.revoke("pi-1")
    assert kicked == [["pi-1"]]
    assert not tables.login("pi-1", new, "agent-pi-1")
    assert not tables.allowed("pi-1", "publishClientSend", device_status("pi-1"))
    with pytest.raises(DynSecError, match="deleteClient: Client not found"):
        tables.call({"command": "deleteClient", "username": "pi-1"})


def test_unknown_commands_are_refused_and_the_rest_applied(tmp_path: Path) -> None:
    tables = DynSecTables(BrokerAccounts(tmp_path, "", None).plugin_config())
    with pytest.raises(DynSecError, match="nope: Unknown command"):
        tables.call(
            {"command": "createRole", "rolename": "r", "acls": []},
            {"command": "nope"},
        )
    with pytest.raises(DynSecError, match="createRole: Role already exists"):  # it was made
        tables.call({"command": "createRole", "rolename": "r"})
    with pytest.raises(DynSecError, match="createClient: Missing password"):
        tables.call({"command": "createClient", "username": "u", "roles": []})
