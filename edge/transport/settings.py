"""How to reach an MQTT broker: the URL forms edgetrain accepts and the client settings.

Shared by the MQTT transport (:mod:`edge.transport.mqtt`), the device
profiler's link probe and the command line, so a broker is named the same way
everywhere. The ``link_*`` settings turn on software link shaping
(:mod:`edge.transport.shaping`) for emulated devices.

Tested in tests/integration/test_transport_conformance.py::test_broker_urls and
::test_a_bad_broker_url_is_a_one_line_user_error, the link settings in
tests/unit/edge/transport/test_shaping.py::test_settings_refuse_a_bad_link, TLS in
tests/integration/test_mqtt5_clients.py, and a packet sent from a view in
tests/integration/test_transport_conformance.py::test_a_large_frame_is_sent_from_a_view.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import paho.mqtt.client as mqtt
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from edge.errors import UserError

__all__ = ["DEFAULT_PORTS", "MqttSettings", "new_client", "parse_broker_url", "tls_context"]

DEFAULT_PORTS = {"mqtt": 1883, "mqtts": 8883}
_SCHEMES = {"mqtt": "mqtt", "tcp": "mqtt", "mqtts": "mqtts", "ssl": "mqtts"}


def parse_broker_url(url: str) -> tuple[str, str, int]:
    """``(scheme, host, port)`` of ``mqtt://host[:1883]`` or ``mqtts://host[:8883]`` (TLS).

    ``tcp://`` and ``ssl://`` are aliases; the scheme returned is ``"mqtt"`` or
    ``"mqtts"``. Anything else raises a one-line :class:`UserError`.
    """
    expected = "expected mqtt://host:1883 or mqtts://host:8883"
    parts = urlsplit(url)
    scheme = _SCHEMES.get(parts.scheme.lower())
    try:
        port = parts.port
    except ValueError:
        raise UserError(f"broker {url!r}: bad port ({expected})") from None
    if scheme is None or not parts.hostname or port == 0:
        raise UserError(f"broker {url!r}: not a broker URL ({expected})")
    if parts.username is not None or parts.password is not None:
        raise UserError(f"broker {url!r}: give credentials as username and password settings")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise UserError(f"broker {url!r}: unexpected path or query ({expected})")
    return scheme, parts.hostname, port or DEFAULT_PORTS[scheme]


class MqttSettings(BaseModel):
    """How to reach the broker, and optionally the link to emulate on the way.

    With ``link_mbps`` or ``link_latency_ms`` set, stage frames (not control
    messages) pass through a software shaper (:mod:`edge.transport.shaping`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    url: str = "mqtt://127.0.0.1:1883"
    """Broker: mqtt://host[:port] (1883 by default) or mqtts://host[:port] (TLS, 8883)."""
    username: str | None = None
    """User name the broker authenticates; none for an anonymous broker."""
    password: SecretStr | None = None
    """Password for ``username`` (never shown in logs or reprs)."""
    tls_ca: Path | None = None
    """CA bundle that signed the broker's certificate (mqtts); the system's when unset."""
    tls_ca_pem: str | None = None
    """The same as text (PEM), as a credentials file carries it; not with ``tls_ca``."""
    tls_cert: Path | None = None
    """Client certificate (PEM) for brokers that require one (mqtts)."""
    tls_key: Path | None = None
    """Private key of ``tls_cert`` when it is not in the same file."""
    tls_insecure: bool = False
    """Skip the check that the certificate names the broker's host (testing only)."""
    client_id: str | None = None
    """MQTT client id, unique per connection; default ``edgetrain-`` and random hex."""
    keepalive: int = Field(default=30, ge=5, le=65535)
    """Seconds between pings when idle; a dead link is noticed within 1.5x this."""
    reconnect_min_s: float = Field(default=0.5, gt=0)
    """First wait before reconnecting after the link drops; doubles on each failure."""
    reconnect_max_s: float = Field(default=30.0, gt=0)
    """Longest wait between reconnection attempts."""
    max_inflight: int = Field(default=100, ge=1)
    """QoS-1 messages sent and not yet acknowledged by the broker at once."""
    max_queued: int = Field(default=256, ge=1)
    """QoS-1 messages held (in flight or waiting for a connection); more raise at send."""
    subscribe_timeout_s: float = Field(default=10.0, gt=0)
    """How long attach and subscribe wait for the broker to acknowledge a subscription."""
    link_mbps: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """Emulate a link of this many Mbit/s each way for stage frames (software shaping,
    for the testbed without root); none: frames go at the speed of the real network."""
    link_latency_ms: float = Field(default=0.0, ge=0, le=60_000, allow_inf_nan=False)
    """Emulated one-way latency added to stage frames in each direction, milliseconds."""

    @model_validator(mode="after")
    def _consistent(self) -> MqttSettings:
        if self.reconnect_min_s > self.reconnect_max_s:
            raise ValueError("reconnect_min_s must not exceed reconnect_max_s")
        if self.tls_key is not None and self.tls_cert is None:
            raise ValueError("tls_key needs tls_cert")
        if self.tls_ca is not None and self.tls_ca_pem is not None:
            raise ValueError("give tls_ca or tls_ca_pem, not both")
        return self


def tls_context(settings: MqttSettings) -> ssl.SSLContext:
    """A client TLS context that verifies the broker's certificate and host name against
    the settings' CA (file or PEM; the system's when neither), with the client
    certificate when one is set. ``OSError``/``ValueError`` on unreadable input."""
    s = settings
    ctx = ssl.create_default_context(
        cafile=str(s.tls_ca) if s.tls_ca else None, cadata=s.tls_ca_pem or None
    )
    if s.tls_cert is not None:
        ctx.load_cert_chain(str(s.tls_cert), str(s.tls_key) if s.tls_key else None)
    return ctx


class _Client(mqtt.Client):
    """paho's client, each queued packet sent from a view of its bytes.

    [Note: a packet sent in pieces]
    paho writes a queued packet with ``sock.send(packet[pos:])``. On the bytearray paho
    builds, that slice copies every byte not yet sent, on every call. A frame of a few
    MiB leaves the socket in pieces as its buffer drains, more of them the slower the
    link, so the copies grow with the square of its size: 4 MiB sent in 22 pieces
    through a socket pair cost 11 ms of CPU, 0.8 ms from a view (measured here). On
    an emulated Pi that is a fifteenth of a core, and a link shaped to its rate leaves
    the socket in smaller pieces still. A memoryview slices without copying, and
    paho neither resizes a packet once queued nor reads it otherwise.
    """

    def _packet_queue(
        self, command: int, packet: bytes | bytearray, *args: Any, **kwargs: Any
    ) -> mqtt.MQTTErrorCode:
        view = memoryview(packet)
        return super()._packet_queue(command, view, *args, **kwargs)  # type: ignore[arg-type]


def new_client(settings: MqttSettings, client_id: str) -> mqtt.Client:
    """A paho client (MQTT 3.1.1, clean session) set up from ``settings``: credentials,
    TLS, reconnect back-off and queue sizes. Bad TLS input is a one-line :class:`UserError`."""
    s = settings
    scheme = parse_broker_url(s.url)[0]
    c = _Client(
        callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
        client_id=client_id,
        protocol=mqtt.MQTTv311,
        clean_session=True,  # see [Note: MQTT sessions and lost frames] in edge.transport.mqtt
    )
    if s.username is not None:
        c.username_pw_set(s.username, s.password.get_secret_value() if s.password else None)
    if scheme == "mqtts":
        try:
            c.tls_set_context(tls_context(s))
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            raise UserError(f"broker {s.url}: TLS setup failed: {exc}") from None
        c.tls_insecure_set(s.tls_insecure)
    elif s.tls_ca or s.tls_ca_pem or s.tls_cert or s.tls_insecure:
        raise UserError(f"broker {s.url}: TLS options need an mqtts:// URL")
    # paho only does arithmetic with these, so fractions of a second work.
    c.reconnect_delay_set(s.reconnect_min_s, s.reconnect_max_s)  # type: ignore[arg-type]
    c.max_inflight_messages_set(s.max_inflight)
    c.max_queued_messages_set(s.max_queued)
    return c
