"""``edgetrain fleet``: the coordinator's devices, and their broker accounts.

- ``edgetrain fleet`` lists the devices the coordinator knows.
- ``edgetrain fleet enroll DEVICE_ID --out creds.json`` creates the device's
  broker account (or rotates its password) and writes the credentials file
  ``edgetrain agent --credentials`` reads, mode 0600.
- ``edgetrain fleet revoke DEVICE_ID`` deletes the account; the device is
  disconnected at once.

Thin clients of the REST API (:mod:`edgetrain.cli.client` makes the requests);
enrolment and revocation need the write token when the coordinator has one.

Tested in tests/e2e/test_clients.py::test_submit_wait_then_jobs_and_fleet and
tests/security/test_enrollment.py (``enroll`` and ``revoke``).
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from edge.errors import UserError
from edgetrain.cli.client import (
    COORDINATOR_OPTION,
    JSON_OPTION,
    TOKEN_OPTION,
    call,
    echo_json,
    table,
    when,
)

__all__ = ["app"]

app = typer.Typer(
    invoke_without_command=True,
    no_args_is_help=False,
    help="The coordinator's devices; enrol and revoke their broker accounts.",
)


@app.callback()
def fleet_command(
    ctx: typer.Context,
    coordinator: str = COORDINATOR_OPTION,
    token: str | None = TOKEN_OPTION,
    as_json: bool = JSON_OPTION,
) -> None:
    """The devices the coordinator knows: state, measured speed, memory, link, the local
    datasets they hold (name and sample count), current job.

    (The device-profile catalogue is ``edgetrain devices``.)
    """
    if ctx.invoked_subcommand is not None:
        return
    devices = call("GET", coordinator, "/api/v1/devices", token)
    if as_json:
        echo_json(devices)
        return
    rows = []
    for d in devices["data"]:
        p = d.get("profile") or {}
        gflops = f"{p['gflops']:.1f}" if p.get("gflops") is not None else "-"
        memory = f"{p['memory_bytes'] / 2**30:.1f} GiB" if p.get("memory_bytes") else "-"
        link = f"{p['bandwidth_mbps']:.0f} Mbit/s" if p.get("bandwidth_mbps") else "-"
        job = f"{d['job']} (stage {d['stage']})" if d.get("job") else "-"
        held = d.get("datasets") or {}
        data = ", ".join(f"{name} ({info['samples']})" for name, info in held.items()) or "-"
        rows.append(
            [d["id"], d["state"], gflops, memory, link, data, job, when(d.get("last_seen"))]
        )
    columns = ["device", "state", "GFLOP/s", "memory", "link", "data", "job", "last seen"]
    table(f"fleet ({devices['count']})", columns, rows)


@app.command("enroll")
def enroll_command(
    device_id: str = typer.Argument(..., help="The device's id (what its agent announces)."),
    out: Path = typer.Option(
        ..., "--out", "-o", help="Where to write the credentials file (mode 0600)."
    ),
    coordinator: str = COORDINATOR_OPTION,
    token: str | None = TOKEN_OPTION,
) -> None:
    """Create DEVICE_ID's broker account, or give it a new password (rotation), and write
    its credentials: the broker URL, user name, password and the CA to verify the broker.

    Copy the file to the device and run ``edgetrain agent --credentials FILE`` there. After
    a rotation the old file stops working.
    """
    from edge.files import PRIVATE, write_atomic

    if out.is_dir():
        raise UserError(f"--out {out}: is a directory; name the file to write")
    creds = call("POST", coordinator, "/api/v1/devices/enroll", token, {"device_id": device_id})
    write_atomic(out, json.dumps(creds, indent=2) + "\n", mode=PRIVATE)
    typer.echo(f"enrolled {device_id}: credentials for {creds['broker']} in {out} (mode 0600)")


@app.command("revoke")
def revoke_command(
    device_id: str = typer.Argument(..., help="The device whose account to delete."),
    coordinator: str = COORDINATOR_OPTION,
    token: str | None = TOKEN_OPTION,
) -> None:
    """Delete DEVICE_ID's broker account: it is disconnected now and cannot log in again."""
    call("DELETE", coordinator, f"/api/v1/devices/{device_id}/enrollment", token)
    typer.echo(f"revoked {device_id}")
