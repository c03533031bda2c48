"""The coordinator's settings: one pydantic-settings class read from the environment.

Every field is read from ``EDGETRAIN_<NAME>`` (``EDGETRAIN_PORT``,
``EDGETRAIN_API_TOKEN``, ...); an empty variable counts as unset. The one-line
docstring under each field is its description, so it doubles as help text.
Outside ``development`` a placeholder API token (``changethis``, ``secret``,
anything shorter than 16 characters) is refused, as full-stack-fastapi-template
refuses its default secrets; in development it is only warned about.

No instance is cached at module level: :func:`get_settings` reads the
environment each time it is called, and tests construct :class:`Settings`
directly with the values they need.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from edge.errors import UserError, describe_validation_error

if TYPE_CHECKING:
    from edge.transport.settings import MqttSettings

__all__ = ["MIN_TOKEN_LENGTH", "PLACEHOLDER_SECRETS", "Environment", "Settings", "get_settings"]

Environment = Literal["development", "production"]

MIN_TOKEN_LENGTH = 16
PLACEHOLDER_SECRETS = frozenset(
    {"changeme", "changethis", "change-me", "change_me", "secret", "password", "token", "test"}
)


class Settings(BaseSettings):
    """Everything the coordinator service can be told, from ``EDGETRAIN_*`` variables."""

    model_config = SettingsConfigDict(
        env_prefix="EDGETRAIN_",
        env_ignore_empty=True,
        extra="ignore",
        use_attribute_docstrings=True,
        validate_default=True,
        # A refused token must not appear in the error text (or in a log of it).
        hide_input_in_errors=True,
    )

    host: str = "127.0.0.1"
    """Address the API listens on."""
    port: int = Field(default=8000, ge=0, le=65535)
    """TCP port the API listens on (0: any free port)."""
    broker_url: str | None = None
    """MQTT broker, e.g. mqtts://host:8883; unset starts the embedded broker (Mosquitto with
    TLS, accounts and ACLs in data_dir/broker; anonymous amqtt without Mosquitto)."""
    broker_username: str | None = None
    """The coordinator's account on a broker it does not start (EDGETRAIN_BROKER_USERNAME)."""
    broker_password: SecretStr | None = None
    """Its password (EDGETRAIN_BROKER_PASSWORD); never shown."""
    broker_ca: Path | None = None
    """CA file that signed that broker's certificate (EDGETRAIN_BROKER_CA); the system's when
    unset. Enrolment goes into credentials files as the CA to trust."""
    broker_hosts: list[str] = []
    """Further names or addresses devices reach the embedded broker by (its TLS certificate
    names them; the first goes into credentials files); it then listens on all interfaces."""
    broker_port: int | None = Field(default=None, ge=1, le=65535)
    """Port of the embedded broker (unset: a free one)."""
    data_dir: Path = Path("~/.edgetrain/coordinator")
    """Folder for the database (edgetrain.db) and the trained models."""
    api_token: SecretStr | None = None
    """Bearer token that mutating endpoints require; unset leaves the API open."""
    api_read_auth: bool = False
    """Require the token on reads too (EDGETRAIN_API_READ_AUTH=1)."""
    heartbeat_timeout_s: float = Field(default=3.0, gt=0, allow_inf_nan=False)
    """Seconds without a heartbeat after which a device counts as offline."""
    environment: Environment = "development"
    """development or production; production refuses placeholder secrets."""
    testbed_state: Path | None = None
    """A testbed's state directory: jobs' kill and join faults then act on its agents
    (edgetrain testbed up starts its coordinator so); unset, only slow faults."""

    @field_validator("data_dir")
    @classmethod
    def _expand_home(cls, value: Path) -> Path:
        return value.expanduser()

    @field_validator("testbed_state")
    @classmethod
    def _expand_testbed(cls, value: Path | None) -> Path | None:
        return None if value is None else value.expanduser()

    @model_validator(mode="after")
    def _check_token(self) -> Settings:
        problem = _weak_secret(self.api_token)
        if problem is None:
            return self
        # The message names the field and its variable and never echoes the secret.
        message = (
            f"api_token: EDGETRAIN_API_TOKEN {problem}; "
            "set a random one, e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'"
        )
        if self.environment == "development":
            warnings.warn(message, stacklevel=2)
            return self
        raise ValueError(f"{message} (refused because environment is {self.environment})")

    @property
    def token(self) -> str | None:
        """The API token in clear, or ``None`` when the API is open."""
        return None if self.api_token is None else self.api_token.get_secret_value()

    def broker_settings(self) -> MqttSettings:
        """How the coordinator logs in to the broker at ``broker_url`` (one it did not start)."""
        from edge.transport.settings import MqttSettings

        if self.broker_url is None:
            raise ValueError("no broker_url: the coordinator starts its own broker")
        return MqttSettings(
            url=self.broker_url,
            username=self.broker_username,
            password=self.broker_password,
            tls_ca=self.broker_ca,
        )

    @property
    def db_path(self) -> Path:
        return self.data_dir / "edgetrain.db"


def _weak_secret(secret: SecretStr | None) -> str | None:
    """Why ``secret`` is a placeholder, or ``None`` when it is unset or good enough."""
    if secret is None:
        return None
    value = secret.get_secret_value().strip().lower()
    if value in PLACEHOLDER_SECRETS or "changeme" in value or "changethis" in value:
        return "is a placeholder value"
    if len(value) < MIN_TOKEN_LENGTH:
        return f"is shorter than {MIN_TOKEN_LENGTH} characters"
    return None


def get_settings(**overrides: Any) -> Settings:
    """Settings from the environment, with ``overrides`` (e.g. command-line flags) on top.

    An override of ``None`` is dropped, so a flag that was not given leaves the
    environment's value in place. An invalid value raises
    :class:`~edge.errors.UserError` with one line naming the field. Nothing is
    cached: each call reads the environment anew.
    """
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        raise UserError(describe_validation_error(exc, "settings")) from None
