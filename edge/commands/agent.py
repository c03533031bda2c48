"""``edgetrain agent``: run the device daemon until SIGTERM or Ctrl-C."""

from __future__ import annotations

import signal
import socket
from pathlib import Path
from typing import Any

import typer

from edge.errors import UserError

__all__ = ["agent_command"]


def agent_command(
    broker: str = typer.Option(..., "--broker", help="Broker URL: mqtt://HOST:PORT or mqtts://."),
    device_id: str = typer.Option(
        socket.gethostname(), "--device-id", help="This device's id (default: the hostname)."
    ),
    profile: str | None = typer.Option(
        None,
        "--profile",
        help="Announce a catalogue profile (e.g. rpi4-4gb) instead of measuring this machine.",
    ),
    data_dir: Path = typer.Option(
        Path.home() / ".edgetrain" / "agent", "--data-dir", help="Where stage weights are kept."
    ),
    threads: int | None = typer.Option(None, "--threads", min=1, help="torch threads."),
    heartbeat_s: float = typer.Option(1.0, "--heartbeat-s", min=0.05, help="Heartbeat period."),
    measure_seconds: float = typer.Option(
        1.0, "--measure-seconds", min=0.05, help="How long to time matmuls when measuring."
    ),
    slowdown: float = typer.Option(
        1.0,
        "--slowdown",
        min=1.0,
        help="Emulate a device this many times slower (software duty-cycling of compute).",
    ),
    username: str | None = typer.Option(None, "--username", help="Broker user name."),
    password: str | None = typer.Option(
        None, "--password", envvar="EDGETRAIN_MQTT_PASSWORD", help="Broker password."
    ),
    tls_ca: Path | None = typer.Option(None, "--tls-ca", help="CA bundle for mqtts://."),
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error."),
) -> None:
    """Run the agent daemon: register this device and run the stages it is assigned.

    It connects with a last-will (offline, retained), publishes its profile and a
    heartbeat, runs assignments from its cmd topic, reports per-step timings on
    the job's events topic, and rides out the broker going away. Logs are JSON
    lines on standard error. SIGTERM stops it cleanly.
    """
    import torch

    from edge.agent import Agent
    from edge.logs import setup_logging
    from edge.transport.settings import MqttSettings, parse_broker_url
    from edgetrain import __version__

    if not device_id.strip() or "/" in device_id or "+" in device_id or "#" in device_id:
        raise UserError(f"--device-id: {device_id!r} must be non-empty without / + #")
    parse_broker_url(broker)
    setup_logging(log_level, device=device_id)
    if threads is not None:
        torch.set_num_threads(threads)
    data_dir.mkdir(parents=True, exist_ok=True)
    extra: dict[str, Any] = {"username": username, "password": password, "tls_ca": tls_ca}
    settings = MqttSettings(url=broker, **{k: v for k, v in extra.items() if v is not None})

    def measure() -> Any:
        if profile is not None:
            from edge.catalog import resolve

            return resolve(profile).to_device_spec(device_id)
        from edge.profiler import profile_device

        return profile_device(device_id, seconds=measure_seconds).to_device_spec()

    agent = Agent(settings, device_id, measure, data_dir=data_dir, heartbeat_s=heartbeat_s,
                  version=__version__, slowdown=slowdown)  # fmt: skip
    signal.signal(signal.SIGTERM, lambda *_: agent.stop())
    signal.signal(signal.SIGINT, lambda *_: agent.stop())
    raise typer.Exit(agent.run())
