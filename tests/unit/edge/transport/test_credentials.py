"""A device's credentials file: read with one-line errors, turned into a TLS login."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edge.errors import UserError
from edge.transport.credentials import Credentials, read_credentials

CA = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
GOOD = {
    "broker": "mqtts://gw.lan:8883",
    "device_id": "pi-1",
    "username": "pi-1",
    "password": "s3cret-s3cret",
    "ca": CA,
}


def test_a_file_becomes_a_tls_login_bound_to_the_device_client_id(tmp_path: Path) -> None:
    path = tmp_path / "creds.json"
    path.write_text(json.dumps(GOOD))
    creds = read_credentials(path)
    settings = creds.settings(link_mbps=10.0)
    assert settings.url == "mqtts://gw.lan:8883" and settings.username == "pi-1"
    assert settings.password is not None and settings.password.get_secret_value() == "s3cret-s3cret"
    assert settings.tls_ca_pem == CA and settings.client_id == "agent-pi-1"
    assert settings.link_mbps == 10.0
    assert "s3cret" not in repr(creds) and "s3cret" not in repr(settings)
    assert json.loads(creds.to_json()) == GOOD


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"broker": "http://gw"}, "broker"),
        ({"device_id": "pi/1"}, "device_id"),
        ({"ca": "not a pem"}, "ca"),
        ({"password": ""}, "password"),
        ({"extra": 1}, "extra"),
    ],
)
def test_a_bad_file_is_one_line_naming_the_field(
    tmp_path: Path, change: dict[str, object], message: str
) -> None:
    path = tmp_path / "creds.json"
    path.write_text(json.dumps({**GOOD, **change}))
    with pytest.raises(UserError) as err:
        read_credentials(path)
    assert err.value.message.startswith(f"credentials {path}: ") and message in err.value.message
    assert "\n" not in err.value.message


def test_a_missing_or_huge_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="No such file"):
        read_credentials(tmp_path / "none.json")
    big = tmp_path / "big.json"
    big.write_text(" " * (70 * 1024))
    with pytest.raises(UserError, match="larger than 65536 bytes"):
        read_credentials(big)
    assert Credentials.model_validate(GOOD).ca == CA
