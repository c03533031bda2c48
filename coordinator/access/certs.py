"""The TLS certificates of a broker the coordinator runs: its own small CA.

This module owns making, keeping and reusing them, with the ``cryptography``
package. :func:`broker_tls` returns the files in a directory (the coordinator's
data directory, ``broker/tls``), creating what is missing:

- ``ca.pem`` / ``ca.key``: a CA made for this coordinator (EC P-256, 10 years);
  its certificate goes into every device's credentials file, its key never
  leaves the directory (mode 0600).
- ``server.pem`` / ``server.key``: the broker's certificate, signed by that CA,
  naming every host devices reach the broker by (``localhost``, ``127.0.0.1``
  and the hosts given). A certificate that lacks a host asked for now, or expires
  within 30 days, is made again (same CA, so enrolled devices keep working).

Bring your own instead: pass ``own=(cert, key, ca)`` (PEM files) and they are
used as they are.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from edge.errors import UserError
from edge.files import write_atomic

__all__ = ["BrokerTls", "broker_tls"]

_DAYS_CA = 3650
_DAYS_SERVER = 825
_RENEW_BEFORE = datetime.timedelta(days=30)


@dataclass(frozen=True)
class BrokerTls:
    """PEM files for a TLS listener, and the CA's certificate as text."""

    cert: Path
    key: Path
    ca: Path

    @property
    def ca_pem(self) -> str:
        return self.ca.read_text()


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _make_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "edgetrain broker CA")])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=_DAYS_CA))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    write_atomic(directory / "ca.key", _key_pem(key), mode=0o600)
    write_atomic(directory / "ca.pem", cert.public_bytes(serialization.Encoding.PEM))
    return cert, key


def _load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None:
    cert_path, key_path = directory / "ca.pem", directory / "ca.key"
    if not (cert_path.exists() and key_path.exists()):
        return None
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (OSError, ValueError) as exc:
        raise UserError(f"broker CA in {directory}: cannot be read: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise UserError(f"broker CA in {directory}: ca.key is not an EC key")
    return cert, key


def _server_ok(path: Path, ca: x509.Certificate, hosts: list[str]) -> bool:
    """Whether the server certificate at ``path`` exists, was signed by ``ca``, names
    every host in ``hosts`` and stays valid for a while yet."""
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (OSError, ValueError, x509.ExtensionNotFound):
        return False
    if cert.issuer != ca.subject or cert.not_valid_after_utc - _now() < _RENEW_BEFORE:
        return False
    return all(_san(h) in names for h in hosts)


def _make_server(
    directory: Path, ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, hosts: list[str]
) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=_DAYS_SERVER))
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    write_atomic(directory / "server.key", _key_pem(key), mode=0o600)
    write_atomic(directory / "server.pem", cert.public_bytes(serialization.Encoding.PEM))


def broker_tls(
    directory: Path, hosts: list[str] | None = None, own: tuple[Path, Path, Path] | None = None
) -> BrokerTls:
    """The broker's certificate, key and CA: ``own`` (cert, key, ca) if given, else those
    in ``directory``, made or renewed so that the certificate names ``hosts`` too."""
    if own is not None:
        for path in own:
            if not path.is_file():
                raise UserError(f"broker TLS: {path} is not a file")
        return BrokerTls(*own)
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    names = list(dict.fromkeys(["localhost", "127.0.0.1", *(hosts or [])]))
    ca, ca_key = _load_ca(directory) or _make_ca(directory)
    if not _server_ok(directory / "server.pem", ca, names):
        _make_server(directory, ca, ca_key, names)
    return BrokerTls(directory / "server.pem", directory / "server.key", directory / "ca.pem")
