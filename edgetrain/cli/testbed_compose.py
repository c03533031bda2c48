"""``edgetrain testbed compose``: write a docker-compose file for any fleet of catalogue devices.

The file is :func:`coordinator.testbed.compose.render_compose` of the fleet that
:func:`coordinator.testbed.sizing.emulate` maps onto the Docker host, so its CPU
and memory limits are the local testbed's. Its broker's secrets (TLS files,
accounts, each agent's credentials) are written anew beside it, to ``secrets/``
or ``--secrets-dir`` (:func:`coordinator.testbed.compose_secrets.write_secrets`),
and the file names that directory relative to itself. Nothing here imports FastAPI.

Tested in tests/unit/coordinator/testbed/test_compose_render.py,
tests/unit/coordinator/testbed/test_compose_secrets.py and
tests/integration/test_compose.py (the files docker-compose validates).
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import typer

from coordinator.testbed.compose import BROKER_SERVICE, DEFAULT_IMAGE_TAG, render_compose
from coordinator.testbed.sizing import emulate
from edge.errors import UserError, needs_coordinator_extras
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
    secrets_dir: Path | None,
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
    if broker_port != 8883:
        args += ["--broker-port", str(broker_port)]
    if coordinator_port != 8000:
        args += ["--coordinator-port", str(coordinator_port)]
    if secrets_dir is not None:
        args += ["--secrets-dir", str(secrets_dir)]
    return shlex.join(args)


def _named_from(secrets: Path, base: Path) -> str:
    """``secrets`` as the compose file in ``base`` names it: relative when inside ``base``."""
    full, base = secrets.absolute(), base.absolute()
    if full.is_relative_to(base):
        return "./" + full.relative_to(base).as_posix() if full != base else "."
    return full.as_posix()


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
        8883,
        "--broker-port",
        min=1,
        max=65535,
        help="Host port (on 127.0.0.1) for the broker's TLS listener.",
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
    secrets_dir: Path | None = typer.Option(
        None,
        "--secrets-dir",
        help="Where to write the broker's secrets: TLS files, accounts, each agent's "
        "credentials, new each time (default: secrets/ beside --output, else in the "
        "current directory). Never commit them.",
    ),
) -> None:
    """Print a docker-compose file for an emulated fleet: broker, coordinator, one agent each.

    Every agent is limited to its device's share of the host's CPUs (cpus) and to
    its memory (mem_limit); its link is shaped to the device's bandwidth (tc, with
    NET_ADMIN) and latency. The broker takes TLS logins only, one account per
    agent; their secrets go to a directory beside the file, which it mounts. Run it
    with: docker compose up --build.
    """
    # The planner package imports numpy: not with this module, which every command imports
    # ([Note: commands without torch] in edgetrain.cli).
    from coordinator.planner.build import parse_fleet

    host_cpus = float(cpus if cpus is not None else os.cpu_count() or 1)
    if not host_cpus > 0:
        raise UserError(f"--cpus must be positive (got {cpus:g})")
    fleet = emulate(parse_fleet(devices), scale, cpus=host_cpus)
    base = output.parent if output is not None else Path()
    secrets = secrets_dir if secrets_dir is not None else base / "secrets"
    text = render_compose(
        fleet,
        image_tag=image_tag,
        broker_port=broker_port,
        coordinator_port=coordinator_port,
        build_context=context,
        generated_by=_command_line(
            devices,
            scale,
            host_cpus,
            image_tag,
            context,
            broker_port,
            coordinator_port,
            secrets_dir,
        ),
        secrets=_named_from(secrets, base),
    )
    with needs_coordinator_extras("edgetrain testbed compose (its broker's certificate)"):
        from coordinator.testbed.compose_secrets import write_secrets
    write_secrets(fleet, secrets, BROKER_SERVICE)
    typer.echo(f"broker secrets (never commit them): {secrets}", err=True)
    if output is None:
        typer.echo(text, nl=False)
        return
    try:
        write_atomic(output, text)
    except OSError as exc:
        raise UserError(f"--output {output}: cannot write: {exc.strerror or exc}") from None
