"""A testbed's broker accounts in its state directory, and what ``down`` removes of them.

With the broker running, tests/e2e/test_testbed.py checks the rest: anonymous
clients refused, agents' credentials, rights that follow a job's plan.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from cryptography import x509

from coordinator.testbed import access, procs
from coordinator.testbed.state import State
from coordinator.testbed.teardown import teardown
from edge.errors import UserError
from edge.transport.credentials import read_credentials
from edge.transport.settings import MqttSettings


def state(directory: Path, broker_url: str) -> State:
    bed = State(dir=directory, id="ab12", token="t0k3n", broker_url=broker_url)
    bed.save()
    return bed


def test_an_anonymous_broker_is_reached_anonymously(tmp_path: Path) -> None:
    bed = state(tmp_path, "mqtt://127.0.0.1:1883")
    assert not access.is_secure(bed)
    assert access.coordinator_login(bed) == MqttSettings(url="mqtt://127.0.0.1:1883")


def test_a_secure_broker_is_reached_as_its_coordinator(tmp_path: Path) -> None:
    bed = state(tmp_path, "mqtts://127.0.0.1:18883")
    with pytest.raises(UserError, match="has no broker accounts") as err:
        access.coordinator_login(bed)
    assert "\n" not in err.value.message
    accounts, tls = access.start_accounts(bed, 18883, ["10.201.7.1", "10.201.7.5"])
    cert = x509.load_pem_x509_certificate(tls.cert.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(ip) for ip in names.get_values_for_type(x509.IPAddress)} == {
        "127.0.0.1",
        "10.201.7.1",
        "10.201.7.5",
    }
    login = access.coordinator_login(bed)
    user, password = accounts.coordinator
    assert (login.url, login.username, login.tls_ca_pem) == (bed.broker_url, user, tls.ca_pem)
    assert login.password is not None and login.password.get_secret_value() == password


def test_credentials_are_private_and_down_removes_them(tmp_path: Path) -> None:
    bed = state(tmp_path / "bed", "mqtts://127.0.0.1:18883")
    accounts, _tls = access.start_accounts(bed, 18883, [])
    path = access.enroll(accounts, bed, "pi", "mqtts://10.201.7.1:18883")
    assert path == bed.dir / "credentials" / "pi.json"
    creds = read_credentials(path)  # the address this agent reaches the broker by
    assert (creds.broker, creds.device_id, creds.ca) == (
        "mqtts://10.201.7.1:18883",
        "pi",
        accounts.ca_pem,
    )
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    ours = tmp_path / f"{procs.PRIVATE_PREFIX}x1"
    other = tmp_path / "not-the-brokers"
    for d in (ours, other):
        d.mkdir()
        bed.intend("private_dirs", str(d))
    teardown(bed)
    assert not (bed.dir / "credentials").exists() and not access.broker_dir(bed).exists()
    assert not ours.exists()
    assert other.is_dir()  # only what procs made, by its name: never what a state file says
