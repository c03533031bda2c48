"""``edgetrain testbed``: an emulated fleet on this machine (up, status, down, compose).

``up`` starts the broker (TLS and an account per agent where Mosquitto is
installed), the coordinator and one agent per emulated device in the background
and returns, printing once the API token that the coordinator's write routes
require (the clients take it as ``EDGETRAIN_API_TOKEN`` or ``--token``; the state
file keeps it); ``status`` reports on them; ``down`` removes every process,
cgroup, namespace and veth ``up`` made, and the token with the state, from the
state directory alone (also after a crash). The work is done by
:mod:`coordinator.testbed.testbed`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import typer

from edge.errors import UserError
from edgetrain.cli.testbed_compose import DEVICES_OPTION, compose_command

__all__ = ["app", "down_command", "status_command", "up_command"]

app = typer.Typer(
    help="An emulated fleet of catalogue devices on this machine, or as docker-compose.",
    no_args_is_help=True,
)
app.command("compose")(compose_command)

_STATE_DIR = typer.Option(
    None,
    "--state-dir",
    help="Where the testbed keeps its state and logs "
    "(default: $EDGETRAIN_TESTBED_DIR, else ~/.edgetrain/testbed).",
)


def _state_dir(path: Path | None) -> Path:
    from coordinator.testbed.state import default_state_dir

    return path if path is not None else default_state_dir()


def _parse_links(items: list[str]) -> dict[str, float]:
    links: dict[str, float] = {}
    for item in items:
        device, sep, value = item.partition("=")
        try:
            mbps = float(value)
        except ValueError:
            mbps = float("nan")
        if not sep or not device or not mbps > 0:
            raise UserError(f"--link {item!r}: expected DEVICE=MBPS with MBPS > 0")
        links[device] = mbps
    return links


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _print_devices(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table()
    for column in ("device", "emulates", "cpus", "memory", "bandwidth", "latency", "state"):
        table.add_column(column)
    for r in rows:
        table.add_row(
            r["id"],
            r["emulates"],
            f"{r['cpus']:.3g}",
            _size(r["memory_bytes"]),
            f"{r['bandwidth_mbps']:g} Mbit/s",
            f"{r['latency_ms']:g} ms",
            r.get("state", "online"),
        )
    console = Console(soft_wrap=True)
    if not console.is_terminal:  # a pipe or a file: no 80-column truncation of names
        console = Console(soft_wrap=True, width=160)
    console.print(table)


def up_command(
    devices: str = DEVICES_OPTION,
    scale: float | None = typer.Option(
        None,
        "--scale",
        help="Cores for the fastest device; the others get the same share of their speed "
        "(default: the fleet fits in 75% of this machine's cores, at most one core each).",
    ),
    state_dir: Path | None = _STATE_DIR,
    method: str = typer.Option(
        "auto",
        "--method",
        help="auto (kernel limits when root with cgroups, netns and tc tbf, else software), "
        "kernel (the CPU quota at each device's FLOP share), scalar (the quota at its "
        "single-core share, compute throttled on to its FLOP share) or software.",
    ),
    link: list[str] = typer.Option(
        [], "--link", help="Override a device's bandwidth: DEVICE=MBPS (repeatable)."
    ),
    no_coordinator: bool = typer.Option(
        False, "--no-coordinator", help="Start only the broker and the agents."
    ),
    timeout_s: float = typer.Option(
        90.0, "--timeout", min=1.0, help="Seconds to wait for every agent to come online."
    ),
) -> None:
    """Start an emulated fleet in the background: broker, coordinator, one agent per device."""
    from coordinator.planner.build import parse_fleet
    from coordinator.testbed.limits import METHODS, MethodChoice
    from coordinator.testbed.testbed import StartOptions, Testbed

    if method not in METHODS:
        raise UserError(f"--method: {method!r} is not one of {', '.join(METHODS)}")
    specs = parse_fleet(devices)
    start = StartOptions(
        method=cast(MethodChoice, method),
        coordinator=not no_coordinator,
        online_timeout_s=timeout_s,
    )
    bed = Testbed.up(
        specs, state_dir=_state_dir(state_dir), scale=scale, links=_parse_links(link), start=start
    )
    _print_devices(bed.state.devices)
    typer.echo(f"limits: {bed.method_line}")
    typer.echo(f"this machine: {bed.core_gflops:.1f} GFLOP/s per core (fp32 matmul, 1 thread)")
    typer.echo(f"broker: {bed.broker_url}")
    if bed.broker_url.startswith("mqtts://"):
        typer.echo(
            f"broker accounts: {bed.state_dir / 'broker'} (CA tls/ca.pem), agents' credentials "
            f"in {bed.state_dir / 'credentials'}"
        )
    where = f"--state-dir {bed.state_dir}"
    if bed.coordinator_url:
        typer.echo(f"coordinator: {bed.coordinator_url}  (dashboard {bed.coordinator_url}/)")
        typer.echo(
            f"API token: {bed.api_token}  (write requests and the dashboard need it; "
            f"kept in {bed.state.path}, mode 0600)"
        )
        typer.echo(
            f"for edgetrain submit, jobs and fleet: export EDGETRAIN_API_TOKEN={bed.api_token}"
        )
        typer.echo(f"submit a job: edgetrain submit JOB.toml --coordinator {bed.coordinator_url}")
        typer.echo(f"see the fleet: edgetrain fleet --coordinator {bed.coordinator_url}")
    typer.echo(f"stop it: edgetrain testbed down {where}")


def status_command(
    state_dir: Path | None = _STATE_DIR,
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Whether the testbed's processes are alive and its agents online; exit 1 if not all."""
    from coordinator.testbed.state import STATE_FILE
    from coordinator.testbed.testbed import status

    report = status(_state_dir(state_dir))
    if json_out:
        typer.echo(json.dumps(report, indent=1))
    elif not report.get("phase"):
        typer.echo(f"no testbed in {report['state_dir']}")
    else:
        typer.echo(f"testbed {report['id']} ({report['phase']}) in {report['state_dir']}")
        _print_devices(report["devices"])
        typer.echo(f"limits: {report['method_line']}")
        typer.echo(f"broker: {report['broker_url']}")
        if report["coordinator_url"]:
            where = Path(report["state_dir"]) / STATE_FILE
            typer.echo(f"coordinator: {report['coordinator_url']}  (API token in {where})")
        for p in report["processes"]:
            typer.echo(f"  {p['name']}: pid {p['pid']} {'alive' if p['alive'] else 'GONE'}")
    if not report["up"]:
        raise typer.Exit(1)


def down_command(state_dir: Path | None = _STATE_DIR) -> None:
    """Remove every process, cgroup, namespace and veth the testbed made (idempotent)."""
    from coordinator.testbed.testbed import down

    where = _state_dir(state_dir)
    removed = down(where)
    if not removed:
        typer.echo(f"no testbed left in {where}")
    for line in removed:
        typer.echo(f"removed {line}")


app.command("up")(up_command)
app.command("status")(status_command)
app.command("down")(down_command)
