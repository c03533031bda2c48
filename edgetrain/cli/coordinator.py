"""``edgetrain coordinator``: serve the REST API (and start a broker when none is given)."""

from __future__ import annotations

from pathlib import Path

import typer

from edge.errors import needs_coordinator_extras

__all__ = ["coordinator_command"]


def coordinator_command(
    host: str = typer.Option(
        "127.0.0.1",
        "--host",
        help="Address to serve the API on; one that is not loopback needs EDGETRAIN_API_TOKEN.",
    ),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="Port to serve the API on."),
    broker: str | None = typer.Option(
        None, "--broker", help="Broker URL; without it the embedded default broker is started."
    ),
    data_dir: Path | None = typer.Option(
        None, "--data-dir", help="Where the database and trained models are kept."
    ),
    log_level: str = typer.Option(
        "info",
        "--log-level",
        help="debug, info, warning or error: the least severe record written (JSON lines "
        "on standard error).",
    ),
    broker_accounts: Path | None = typer.Option(
        None,
        "--broker-accounts",
        help="With --broker: the accounts record (directory of accounts.json and tls/ca.pem) "
        "of that broker; the coordinator logs in as its admin, and jobs' ACLs follow their "
        "plans (EDGETRAIN_BROKER_ACCOUNTS).",
    ),
    testbed_state: Path | None = typer.Option(
        None,
        "--testbed-state",
        help="A testbed's state directory: jobs' kill and join faults act on its agents "
        "(without it a job may only have slow faults).",
    ),
) -> None:
    """Run the coordinator: track the fleet, accept jobs, plan and drive them, store results.

    The API is under /api/v1 (OpenAPI at /docs). With EDGETRAIN_API_TOKEN set,
    every mutating request needs 'Authorization: Bearer <token>'; without it the
    coordinator serves on a loopback address only. It answers requests for
    localhost, 127.0.0.1, ::1 and --host; EDGETRAIN_ALLOWED_HOSTS (comma-separated,
    '*' for any) names the others, e.g. the machine's name when --host is 0.0.0.0.
    Logs, the coordinator's and uvicorn's alike, are JSON lines on standard error.
    """
    from edge.logs import setup_logging

    with needs_coordinator_extras("edgetrain coordinator"):
        from coordinator.service.serve import serve
        from coordinator.service.settings import get_settings

    settings = get_settings(
        host=host,
        port=port,
        broker_url=broker,
        broker_accounts=broker_accounts,
        data_dir=data_dir,
        testbed_state=testbed_state,
    )
    setup_logging(log_level)
    # uvicorn leaves logging as set up here (coordinator.service.serve), and its own
    # loggers (uvicorn.error, uvicorn.access) propagate to the JSON handler.
    serve(settings, log_level.lower())
