"""The coordinator's settings: one pydantic-settings class read from the environment.

Every field is read from ``EDGETRAIN_<NAME>`` (``EDGETRAIN_PORT``,
``EDGETRAIN_API_TOKEN``, ...); an empty variable counts as unset. The one-line
docstring under each field is its description, so it doubles as help text.
Outside ``development`` a placeholder API token (``changethis``, ``secret``,
anything shorter than 16 characters) is refused, as full-stack-fastapi-template
refuses its default secrets; in development it is only warned about.

[Note: an open API stays on loopback] Without an API token every mutating
endpoint is open, so a ``host`` that is not a loopback address (127.0.0.0/8,
``::1``, ``localhost``) is refused unless ``api_token`` is set. The rule lives
here, in the one validation every way of starting the service goes through
(``edgetrain coordinator``, ``create_app``, ``serve_in_thread``).

The API answers only requests whose ``Host`` header is a loopback name, ``host``
or one of ``allowed_hosts`` (anything else is a 400): a page on another site that
rebinds its DNS name to this machine's address sends its own name, so a browser
cannot be made to reach the API. A loopback name is never an attacker's, so those
are always allowed.

No instance is cached at module level: :func:`get_settings` reads the
environment each time it is called, and tests construct :class:`Settings`
directly with the values they need.

Tested in tests/unit/coordinator/service/test_store.py (``test_settings_*``, the open
API and trusted hosts) and tests/unit/coordinator/service/test_app.py (the ``Host``
check).
"""

from __future__ import annotations

import ipaddress
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from edge.errors import UserError, describe_validation_error

if TYPE_CHECKING:
    from edge.transport.settings import MqttSettings

__all__ = [
    "LOOPBACK_HOSTS",
    "MIN_TOKEN_LENGTH",
    "PLACEHOLDER_SECRETS",
    "Environment",
    "Settings",
    "get_settings",
    "is_loopback",
]

Environment = Literal["development", "production"]

MIN_TOKEN_LENGTH = 16
PLACEHOLDER_SECRETS = frozenset(
    {"changeme", "changethis", "change-me", "change_me", "secret", "password", "token", "test"}
)
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
"""The ``Host`` names every coordinator answers to, whatever ``allowed_hosts`` adds."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` is ``localhost`` or an address in 127.0.0.0/8 or ``::1``."""
    name = host.strip().lower().removeprefix("[").removesuffix("]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


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
    broker_accounts: Path | None = None
    """Accounts record of the broker at broker_url (a directory with accounts.json, and
    tls/ca.pem), whose coordinator account administers its dynamic-security plugin
    (EDGETRAIN_BROKER_ACCOUNTS): the coordinator logs in with that account and CA, unless
    the variables above say otherwise, its jobs' ACLs follow their plans and devices can
    be enrolled. edgetrain testbed up and compose give it."""
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
    max_body_bytes: int = Field(default=1 << 20, ge=1, le=1 << 30)
    """Largest request body accepted, in bytes; a larger one is refused with 413."""
    allowed_hosts: list[str] | None = None
    """Host headers the API answers besides localhost, 127.0.0.1, ::1 and host: comma-
    separated or a JSON list ("*": any). Others get 400 (a guard against DNS rebinding)."""

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _split_hosts(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("allowed_hosts")
    @classmethod
    def _check_hosts(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        hosts = [host.strip().lower() for host in value]
        for host in hosts:
            # Starlette's rule for patterns: a "*" only alone or as "*." at the front.
            wild = host.startswith("*") and host != "*" and not host.startswith("*.")
            if not host or "*" in host[1:] or wild:
                raise ValueError(f"{host!r} is not a host name, an address, '*' or '*.domain'")
        if not hosts:
            raise ValueError("give at least one host (or '*' for any)")
        return hosts

    @field_validator("data_dir")
    @classmethod
    def _expand_home(cls, value: Path) -> Path:
        return value.expanduser()

    @field_validator("testbed_state", "broker_accounts")
    @classmethod
    def _expand_optional(cls, value: Path | None) -> Path | None:
        return None if value is None else value.expanduser()

    @model_validator(mode="after")
    def _check_accounts(self) -> Settings:
        if self.broker_accounts is None:
            return self
        if self.broker_url is None:
            raise ValueError(
                "broker_accounts: EDGETRAIN_BROKER_ACCOUNTS needs EDGETRAIN_BROKER_URL (a broker "
                "the coordinator starts keeps its accounts in data_dir/broker)"
            )
        if not (self.broker_accounts / "accounts.json").is_file():
            raise ValueError(f"broker_accounts: no accounts.json in {self.broker_accounts}")
        return self

    @model_validator(mode="after")
    def _open_api_on_loopback_only(self) -> Settings:
        # See [Note: an open API stays on loopback].
        if self.api_token is None and not is_loopback(self.host):
            raise ValueError(
                f"host: {self.host} is not a loopback address and no API token is set, so "
                "anyone on the network could submit jobs; set EDGETRAIN_API_TOKEN "
                "(or serve on 127.0.0.1)"
            )
        return self

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

    @property
    def trusted_hosts(self) -> list[str]:
        """The loopback names, ``host`` and ``allowed_hosts``, each as it appears in a
        ``Host`` header (an IPv6 address in brackets)."""
        hosts = [*LOOPBACK_HOSTS, self.host.strip().lower(), *(self.allowed_hosts or [])]
        out: list[str] = []
        for host in hosts:
            if ":" in host and not host.startswith("["):
                host = f"[{host}]"
            if host not in out:
                out.append(host)
        return out


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
