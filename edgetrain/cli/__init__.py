"""The ``edgetrain`` command: one typer app, one module per command group.

Device commands: ``profile``, ``agent``, ``launch``, ``devices``, ``models``.
Coordinator commands: ``plan``, ``train``, ``coordinator``, ``submit``/``jobs``/
``fleet`` (:mod:`~edgetrain.cli.client`), ``testbed``, and ``demo``. Each module
only parses, calls the library and prints; none imports FastAPI, SQLAlchemy or
another coordinator extra at import time (they are imported inside the command
that needs them), so an agent-only install runs every device command.

[Note: commands without torch]
Importing torch costs a process over a CPU-second, and the client and planning
commands (``devices``, ``jobs``, ``submit``, ``fleet``, ``plan --problem``) and every
``--help`` never touch a tensor. So no command module imports torch, or a module that
does (the model zoo, unit costs, the runtime, transports, job specs and files), at
import time: the command that needs one imports it in its body, and annotations name
such types under ``TYPE_CHECKING``. rich (a tenth of a second) is imported where a
table is printed. tests/integration/test_command_imports.py checks this.
"""

from __future__ import annotations

import sys

import typer

from edge.errors import UserError
from edgetrain import __version__
from edgetrain.cli import (
    agent,
    client,
    coordinator,
    devices,
    fleet,
    launch,
    models,
    plan,
    profile,
    testbed,
    train,
)
from edgetrain.cli.demo import demo_command
from edgetrain.cli.signals import exit_on_sigterm

__all__ = ["app", "main"]

app = typer.Typer(
    name="edgetrain",
    help=(
        "Train one neural network across a fleet of edge devices and GPU servers: "
        "profile devices, split the model into device-sized segments, and run "
        "pipelined split training."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

app.command("profile")(profile.profile_command)
app.command("agent")(agent.agent_command)
app.command("demo")(demo_command)
app.command("plan")(plan.plan_command)
app.command("train")(train.train_command)
app.command("launch")(launch.launch_command)
app.command("coordinator")(coordinator.coordinator_command)
app.command("submit")(client.submit_command)
app.command("jobs")(client.jobs_command)
app.add_typer(fleet.app, name="fleet")
app.add_typer(devices.app, name="devices")
app.add_typer(models.app, name="models")
app.add_typer(testbed.app, name="testbed")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"edgetrain {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """edgetrain: pipelined split training across heterogeneous devices."""


def main() -> None:
    """Entry point: run the app; bad input ends with one line on stderr and status 2, and
    SIGTERM runs the command's cleanup as Ctrl-C does (:mod:`edgetrain.cli.signals`)."""
    exit_on_sigterm()
    try:
        app()
    except UserError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
