"""The broker's own CA and certificate: made once, reused, renewed for new hosts."""

from __future__ import annotations

import ipaddress
import stat
from pathlib import Path

import pytest
from cryptography import x509

from coordinator.access.certs import broker_tls
from edge.errors import UserError


def _names(path: Path) -> set[str]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(n.value) for n in san}


def test_made_once_then_reused(tmp_path: Path) -> None:
    first = broker_tls(tmp_path / "tls")
    pems = {p: p.read_bytes() for p in (first.cert, first.key, first.ca)}
    assert stat.S_IMODE(first.key.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "tls" / "ca.key").stat().st_mode) == 0o600
    assert _names(first.cert) == {"localhost", "127.0.0.1"}
    again = broker_tls(tmp_path / "tls")
    assert {p: p.read_bytes() for p in (again.cert, again.key, again.ca)} == pems
    assert first.ca_pem.startswith("-----BEGIN CERTIFICATE-----")


def test_a_new_host_renews_the_certificate_under_the_same_ca(tmp_path: Path) -> None:
    first = broker_tls(tmp_path)
    ca, cert = first.ca.read_bytes(), first.cert.read_bytes()
    second = broker_tls(tmp_path, ["edge-gw.lan", "10.0.0.2"])
    assert second.ca.read_bytes() == ca and second.cert.read_bytes() != cert
    assert _names(second.cert) == {"localhost", "127.0.0.1", "edge-gw.lan", "10.0.0.2"}
    issued = x509.load_pem_x509_certificate(second.cert.read_bytes())
    authority = x509.load_pem_x509_certificate(ca)
    issued.verify_directly_issued_by(authority)  # raises if not signed by that CA
    ip = issued.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("10.0.0.2") in ip.get_values_for_type(x509.IPAddress)


def test_own_files_are_used_as_they_are(tmp_path: Path) -> None:
    made = broker_tls(tmp_path / "made")
    own = broker_tls(tmp_path / "unused", own=(made.cert, made.key, made.ca))
    assert (own.cert, own.key, own.ca) == (made.cert, made.key, made.ca)
    assert not (tmp_path / "unused").exists()
    with pytest.raises(UserError, match=r"broker TLS: .*nope.pem is not a file"):
        broker_tls(tmp_path, own=(tmp_path / "nope.pem", made.key, made.ca))
