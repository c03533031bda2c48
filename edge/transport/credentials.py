"""A device's broker credentials: the file ``edgetrain fleet enroll`` writes.

This module owns that file's format and turning it into :class:`MqttSettings`.
One JSON object, written by the coordinator (mode 0600) and read by
``edgetrain agent --credentials FILE``::

    {"broker": "mqtts://host:8883", "device_id": "pi-1", "username": "pi-1",
     "password": "...", "ca": "-----BEGIN CERTIFICATE-----..."}

``ca`` is the PEM of the authority that signed the broker's certificate: the
agent verifies the broker against it, and against nothing else. The broker binds
each device account to one MQTT client id, :func:`device_client_id`, so nobody
else can take over the device's session.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

from edge.errors import UserError, describe_validation_error
from edge.transport.settings import MqttSettings, parse_broker_url
from edge.wire.topics import valid_device_id

__all__ = ["Credentials", "device_client_id", "read_credentials"]

MAX_FILE_BYTES = 64 * 1024  # a CA chain and a few names


def device_client_id(device_id: str) -> str:
    """The one MQTT client id a device's account may connect with."""
    return f"agent-{device_id}"


class Credentials(BaseModel):
    """One device's account on the broker, and how to trust the broker."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    broker: str
    """``mqtts://host:port`` (``mqtt://`` only for a broker without TLS)."""
    device_id: str
    username: str = Field(min_length=1, max_length=256)
    password: SecretStr = Field(min_length=1)
    ca: str | None = None
    """PEM of the CA that signed the broker's certificate; none: the system's CAs."""

    @field_validator("broker")
    @classmethod
    def _broker(cls, value: str) -> str:
        try:
            parse_broker_url(value)
        except UserError as exc:
            raise ValueError(str(exc)) from None
        return value

    @field_validator("device_id")
    @classmethod
    def _device(cls, value: str) -> str:
        if not valid_device_id(value):
            raise ValueError(f"{value!r} is not a device id ([A-Za-z0-9_.-], at most 64)")
        return value

    @field_validator("ca")
    @classmethod
    def _ca(cls, value: str | None) -> str | None:
        if value is not None and "-----BEGIN CERTIFICATE-----" not in value:
            raise ValueError("is not a PEM certificate")
        return value

    def settings(self, **extra: object) -> MqttSettings:
        """MQTT settings that log in as this device, verifying the broker by ``ca``."""
        return MqttSettings(
            url=self.broker,
            username=self.username,
            password=self.password,
            tls_ca_pem=self.ca,
            client_id=device_client_id(self.device_id),
            **extra,  # type: ignore[arg-type]
        )

    def to_json(self) -> str:
        """The file's text, password in clear: write it with mode 0600."""
        data = self.model_dump(mode="json")
        data["password"] = self.password.get_secret_value()
        return json.dumps(data, indent=2) + "\n"


def read_credentials(path: Path) -> Credentials:
    """Read a credentials file; anything wrong with it is a one-line :class:`UserError`."""
    try:
        with path.open("rb") as f:
            text = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise UserError(f"credentials {path}: {exc.strerror or exc}") from None
    if len(text) > MAX_FILE_BYTES:
        raise UserError(f"credentials {path}: larger than {MAX_FILE_BYTES} bytes")
    try:
        return Credentials.model_validate_json(text)
    except ValidationError as exc:
        raise UserError(f"credentials {path}: {describe_validation_error(exc, 'file')}") from None
