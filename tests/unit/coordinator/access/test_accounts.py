"""The accounts record: what enrolment keeps, what the broker's plugin file says.

No broker here: creating the devices in a running broker, and changes while it runs,
are tests/security/'s (a real Mosquitto).
"""

from __future__ import annotations

import base64
import hashlib
import json
import stat
from pathlib import Path

import pytest

from coordinator.access.accounts import COORDINATOR_USER, BrokerAccounts
from edge.errors import UserError


def _verifies(entry: dict[str, object], password: str) -> bool:
    salt = base64.b64decode(str(entry["salt"]))
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, int(entry["iterations"]))  # type: ignore[call-overload]
    return base64.b64encode(digest).decode() == entry["password"]


def test_the_record_is_private_and_the_plugin_file_holds_the_coordinator_only(
    tmp_path: Path,
) -> None:
    accounts = BrokerAccounts(tmp_path, "mqtts://gw:8883", "-----BEGIN CERTIFICATE-----x")
    creds = accounts.enroll("pi-1")
    assert (creds.broker, creds.username, creds.device_id) == ("mqtts://gw:8883", "pi-1", "pi-1")
    assert stat.S_IMODE((tmp_path / "accounts.json").stat().st_mode) == 0o600
    config = accounts.plugin_config()
    [admin] = config["clients"]  # devices are created live, once attached
    assert admin["username"] == COORDINATOR_USER and _verifies(admin, accounts.coordinator[1])
    assert accounts.coordinator[1] not in json.dumps(config)  # hashed there
    assert config["defaultACLAccess"] == {
        "publishClientSend": False,
        "publishClientReceive": False,
        "subscribe": False,
        "unsubscribe": True,
    }
    [create_role, create_client] = accounts._create("pi-1", "pw")
    topics = {(a["acltype"], a["topic"]) for a in create_role["acls"]}
    assert ("publishClientSend", "edgetrain/v1/devices/pi-1/status") in topics
    assert ("subscribeLiteral", "edgetrain/v1/devices/pi-1/cmd") in topics
    assert not any("jobs" in t for _kind, t in topics)  # no job's topics until granted
    assert create_client["clientid"] == "agent-pi-1"
    assert create_client["roles"] == [{"rolename": "device-pi-1"}]


def test_rotation_revocation_and_the_record_survive_a_restart(tmp_path: Path) -> None:
    accounts = BrokerAccounts(tmp_path, "mqtts://gw:8883", None)
    old = accounts.enroll("pi-1").password.get_secret_value()
    new = accounts.enroll("pi-1").password.get_secret_value()  # a rotation
    accounts.enroll("pi-2")
    later = BrokerAccounts(tmp_path, "mqtts://gw:8883", None)
    assert later.devices() == ["pi-1", "pi-2"]
    assert later.coordinator == accounts.coordinator
    assert later.record["devices"]["pi-1"]["password"] == new != old
    later.revoke("pi-1")
    assert BrokerAccounts(tmp_path, "", None).devices() == ["pi-2"]
    with pytest.raises(UserError, match="device 'pi-1' is not enrolled"):
        later.revoke("pi-1")


@pytest.mark.parametrize("bad", ["", "a/b", "+", "#", "-x", "x" * 65, "pi 1", COORDINATOR_USER])
def test_a_bad_device_id_is_refused(tmp_path: Path, bad: str) -> None:
    with pytest.raises(UserError, match="device id"):
        BrokerAccounts(tmp_path, "", None).enroll(bad)
    assert json.loads((tmp_path / "accounts.json").read_text())["devices"] == {}


def test_an_unreadable_record_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "accounts.json").write_text("{not json")
    with pytest.raises(UserError, match=r"broker accounts .*accounts.json: unreadable"):
        BrokerAccounts(tmp_path, "", None)
    (tmp_path / "accounts.json").write_text("[]")
    with pytest.raises(UserError, match="not an accounts record"):
        BrokerAccounts(tmp_path, "", None)
