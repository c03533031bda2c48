"""``edgetrain testbed compose``: write a docker-compose file for any fleet of catalogue devices.

The file is :func:`coordinator.testbed.compose.render_compose` of the fleet that
:func:`coordinator.testbed.sizing.emulate` maps onto the Docker host, so its CPU
and memory limits are the local testbed's. Nothing here imports FastAPI.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import typer

from coordinator.planner.build import parse_fleet
from coordinator.testbed.compose import DEFAULT_IMAGE_TAG, render_compose
from coordinator.testbed.sizing import emulate
from edge.errors import UserError
from edge.files import write_atomic

__all__ = ["compose_command"]


def _command_line(
    devices: str,
    scale: float | None,
    cpus: float,
    image_tag: str,
    context: str | None,
    broker_port: int,
    coordinator_port: int,
) -> str:
    """The command that regenerates the file, with the host's core count made explicit."""
    args = ["edgetrain", "testbed", "compose", "--devices", devices]
    if scale is not None:
        args += ["--scale", f"{scale:g}"]
    args += ["--cpus", f"{cpus:g}"]
    if image_tag != DEFAULT_IMAGE_TAG:
        args += ["--image-tag", image_tag]
    if context is not None:
        args += ["--context", context]
    if broker_port != 1883:
        args += ["--broker-port", str(broker_port)]
    if coordinator_port != 8000:
        args += ["--coordinator-port", str(coordinator_port)]
    return shlex.join(args)


DEVICES_OPTION = typer.Option(
    ...,
    "--devices",
    help="The fleet: catalogue names with optional :count, or JSON device files, "
    "comma-separated (e.g. rpi4-4gb:2,jetson-nano,laptop).",
)
"""``--devices`` of ``testbed up`` and ``testbed compose``."""


def compose_command(
    devices: str = DEVICES_OPTION,
    scale: float | None = typer.Option(
        None,
        "--scale",
        help="Cores for the fastest device; the others get the same share of their speed "
        "(default: the fleet fits in 75% of --cpus, at most one core for the fastest).",
    ),
    cpus: float | None = typer.Option(
        None, "--cpus", help="Cores of the Docker host (default: this machine's)."
    ),
    image_tag: str = typer.Option(
        DEFAULT_IMAGE_TAG, "--image-tag", help="Tag of the edgetrain/agent and coordinator images."
    ),
    context: str | None = typer.Option(
        None,
        "--context",
        help="Build the images from this repository root (relative to the compose file); "
        "without it they must already exist.",
    ),
    broker_port: int = typer.Option(
        1883, "--broker-port", min=1, max=65535, help="Host port (on 127.0.0.1) for the broker."
    ),
    coordinator_port: int = typer.Option(
        8000,
        "--coordinator-port",
        min=1,
        max=65535,
        help="Host port (on 127.0.0.1) for the coordinator's API.",
    ),
    output: Path | None = typer.Option(
        None, "--output", "-o", help="Write the file here instead of standard output."
    ),
) -> None:
    """Print a docker-compose file for an emulated fleet: broker, coordinator, one agent each.

    Every agent is limited to its device's share of the host's CPUs (cpus) and to
    its memory (mem_limit); its link is shaped to the device's bandwidth (tc, with
    NET_ADMIN) and latency. Run it with: docker compose up --build.
    """
    host_cpus = float(cpus if cpus is not None else os.cpu_count() or 1)
    if not host_cpus > 0:
        raise UserError(f"--cpus must be positive (got {cpus:g})")
    fleet = emulate(parse_fleet(devices), scale, cpus=host_cpus)
    text = render_compose(
        fleet,
        image_tag=image_tag,
        broker_port=broker_port,
        coordinator_port=coordinator_port,
        build_context=context,
        generated_by=_command_line(
            devices, scale, host_cpus, image_tag, context, broker_port, coordinator_port
        ),
    )
    if output is None:
        typer.echo(text, nl=False)
        return
    try:
        write_atomic(output, text)
    except OSError as exc:
        raise UserError(f"--output {output}: cannot write: {exc.strerror or exc}") from None
