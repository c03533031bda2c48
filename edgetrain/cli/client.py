"""``edgetrain submit`` and ``edgetrain jobs``, thin clients of the REST API, and the
request helpers ``edgetrain fleet`` (:mod:`edgetrain.cli.fleet`) shares.

They talk to a running coordinator (``--coordinator``, else ``EDGETRAIN_COORDINATOR``,
else ``http://127.0.0.1:8000``) over HTTP with httpx and a timeout, and send
``Authorization: Bearer`` when a token is given (``--token`` or
``EDGETRAIN_API_TOKEN``). A coordinator that cannot be reached, a refused
request (4xx) or an unreadable job file is one line on stderr and exit status 2
(:class:`~edge.errors.UserError`). ``fleet`` lists the coordinator's devices;
``edgetrain devices`` is the device-profile catalogue.

Nothing here imports FastAPI or the coordinator's services; the one package they
need beyond the base install is httpx, a coordinator extra, imported when a request
is made: on a device install every command's ``--help`` works and a request says
which install it needs.

Tested in tests/e2e/test_clients.py, tests/security/test_enrollment.py and
tests/integration/test_command_imports.py.
"""

from __future__ import annotations

import json
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import typer

from edge.errors import UserError, needs_coordinator_extras

__all__ = [
    "COORDINATOR_OPTION",
    "DEFAULT_COORDINATOR",
    "JSON_OPTION",
    "TOKEN_OPTION",
    "call",
    "echo_json",
    "jobs_command",
    "submit_command",
    "table",
    "when",
]

DEFAULT_COORDINATOR = "http://127.0.0.1:8000"
ENDED = frozenset({"completed", "failed", "cancelled"})
TIMEOUT_S = 15.0

COORDINATOR_OPTION = typer.Option(
    DEFAULT_COORDINATOR,
    "--coordinator",
    envvar="EDGETRAIN_COORDINATOR",
    help="Base URL of the coordinator.",
)
TOKEN_OPTION = typer.Option(
    None,
    "--token",
    envvar="EDGETRAIN_API_TOKEN",
    help="Bearer token the coordinator requires (EDGETRAIN_API_TOKEN).",
)
JSON_OPTION = typer.Option(False, "--json", help="Print the coordinator's JSON instead of a table.")


def _detail(body: Any) -> str:
    """The one-line reason in an error body (FastAPI's ``detail``, string or list)."""
    detail = body.get("detail") if isinstance(body, dict) else None
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list) and detail and isinstance(detail[0], dict):
        first = detail[0]
        loc = ".".join(str(p) for p in first.get("loc", []) if p != "body")
        msg = str(first.get("msg", "invalid request"))
        more = f" (and {len(detail) - 1} more)" if len(detail) > 1 else ""
        return f"{loc}: {msg}{more}" if loc else f"{msg}{more}"
    return json.dumps(body)[:200] if body is not None else "no detail"


def call(method: str, base: str, path: str, token: str | None = None, body: Any = None) -> Any:
    """One request; its decoded JSON, or a :class:`UserError` naming what went wrong."""
    with needs_coordinator_extras("edgetrain submit, jobs and fleet"):
        import httpx

    url = base.rstrip("/") + path
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        response = httpx.request(method, url, headers=headers, json=body, timeout=TIMEOUT_S)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        reason = str(exc) or type(exc).__name__
        raise UserError(f"cannot reach the coordinator at {base}: {reason}") from None
    try:
        data = response.json()
    except ValueError:
        data = None
    if response.status_code >= 400:
        reason = _detail(data) if data is not None else response.text.strip()[:200]
        raise UserError(f"{method} {path}: {response.status_code}: {' '.join(reason.split())}")
    if data is None and response.status_code != 204:  # 204: done, nothing to say
        raise UserError(f"{method} {path}: the coordinator did not answer with JSON")
    return data


def _read_job(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            job = tomllib.load(f)
    except OSError as exc:
        raise UserError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{path}: not valid TOML: {exc}") from None
    if "job" in job and isinstance(job["job"], dict) and len(job) == 1:
        job = job["job"]  # a [job] table is accepted as well as top-level keys
    if not job:
        raise UserError(f"{path}: no job fields (model, steps or epochs, batch_size, ...)")
    return job


def echo_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, sort_keys=True))


def submit_command(
    job_file: Path = typer.Argument(..., help="Job file (TOML): the fields of POST /api/v1/jobs."),
    coordinator: str = COORDINATOR_OPTION,
    token: str | None = TOKEN_OPTION,
    wait: bool = typer.Option(
        False, "--wait", help="Wait for the job to end; exit 0 if it completed, 1 otherwise."
    ),
    as_json: bool = JSON_OPTION,
    poll_s: float = typer.Option(1.0, "--poll", min=0.05, help="Seconds between polls."),
) -> None:
    """Submit a training job to a coordinator; print its id (or its JSON).

    The file holds the fields of POST /api/v1/jobs at the top level (see
    examples/job.toml): model, dataset, steps or epochs, batch_size,
    microbatches, schedule, codec, partition, stages, seed, devices, [optimizer],
    [model_options].
    """
    job = call("POST", coordinator, "/api/v1/jobs", token, _read_job(job_file))
    job_id = str(job["id"])
    if not wait:
        if as_json:
            echo_json(job)
        else:
            typer.echo(job_id)
        return
    if not as_json:
        typer.echo(job_id)
    last = -1
    while job["state"] not in ENDED:
        time.sleep(poll_s)
        job = call("GET", coordinator, f"/api/v1/jobs/{job_id}", token)
        if not as_json and job["steps_done"] != last:
            last = job["steps_done"]
            steps = job["spec"].get("steps", "?")
            print(f"\r{job['state']}: step {last}/{steps}", end="", file=sys.stderr, flush=True)
    if as_json:
        echo_json(job)
    else:
        print(file=sys.stderr)
        reason = f" ({job['reason']})" if job.get("reason") else ""
        typer.echo(f"{job_id} {job['state']}{reason}")
    if job["state"] != "completed":
        raise typer.Exit(1)


def when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for i, column in enumerate(columns):
        table.add_column(column, no_wrap=i == 0)  # ids stay whole, to copy and paste
    for row in rows:
        table.add_row(*row)
    Console().print(table)


def jobs_command(
    job_id: str | None = typer.Argument(None, help="One job's id; all jobs when absent."),
    coordinator: str = COORDINATOR_OPTION,
    token: str | None = TOKEN_OPTION,
    as_json: bool = JSON_OPTION,
) -> None:
    """The coordinator's jobs as a table, or one job in detail."""
    if job_id is not None:
        job = call("GET", coordinator, f"/api/v1/jobs/{job_id}", token)
        if as_json:
            echo_json(job)
            return
        spec = job["spec"]
        lines = {
            "id": job["id"],
            "state": job["state"],
            "reason": job.get("reason") or "-",
            "model": spec.get("model"),
            "dataset": spec.get("dataset"),
            "steps": f"{job['steps_done']}/{spec.get('steps', '?')}",
            "batch": f"{spec.get('batch_size')} in {spec.get('microbatches')} microbatches",
            "samples/s": f"{job['samples_per_s']:.1f}" if job.get("samples_per_s") else "-",
            "created": when(job["created"]),
            "finished": when(job.get("finished")),
        }
        latest = job.get("latest") or {}
        if latest.get("loss") is not None:
            lines["loss"] = f"{latest['loss']:.4f}"
        for key, value in lines.items():
            typer.echo(f"{key:>10}  {value}")
        return
    jobs = call("GET", coordinator, "/api/v1/jobs", token)
    if as_json:
        echo_json(jobs)
        return
    rows = [
        [
            j["id"],
            j["state"],
            str(j["spec"].get("model", "?")),
            f"{j['steps_done']}/{j['spec'].get('steps', '?')}",
            f"{j['samples_per_s']:.1f}" if j.get("samples_per_s") else "-",
            when(j["created"]),
            j.get("reason") or "",
        ]
        for j in jobs["data"]
    ]
    columns = ["id", "state", "model", "steps", "samples/s", "created", "reason"]
    table(f"jobs ({jobs['count']})", columns, rows)
