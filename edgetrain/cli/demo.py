"""``edgetrain demo``: the product end to end, on embedded defaults: data that stays home.

It starts the coordinator (REST API and dashboard) with a freshly generated
API token and its own broker, and enrols agent processes through the API, each
emulating a catalogue device: three Raspberry Pi 4s that each hold a third of
``digits``, images and labels, and a laptop that holds nothing
(:mod:`coordinator.local.demo` does all of that, and runs the jobs). It submits a
job on that local data, labels local, through the REST API ([Note: local data])
and prints, in order: the plan (a U: which units run where, and what crosses each
link), what never leaves the holders, a progress bar, the test accuracy on
held-out digits, the samples/s measured for the plan and for the holders alone (the
same job on them only, run next), the speedup, the prediction's error, the payload
the job put on the wire beside what federated averaging would send, and the
dashboard URL.
It keeps serving until Ctrl-C unless ``--exit`` (or when no one is at a terminal to
press Ctrl-C, as in CI).
"""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING, Any, Literal

import typer

from edge.errors import needs_coordinator_extras

if TYPE_CHECKING:
    from rich.console import Console

    from coordinator.local.demo import DemoResult, DemoSession

__all__ = ["demo_command"]


def demo_command(
    fleet: str = typer.Option(
        "rpi4-4gb,rpi4-4gb,rpi4-4gb,laptop",
        help="Catalogue devices to emulate, each NAME or NAME@MBPS (its link's rate); "
        "the first three hold a third of the data each.",
    ),
    link_mbps: float | None = typer.Option(
        None,
        min=0.01,
        help="Shape every device's link to this many Mbit/s each way (an item's @MBPS "
        "wins); default: each catalogue device's own.",
    ),
    codec: Literal["fp32", "auto"] = typer.Option(
        "fp32",
        help="How activations and gradients cross links: fp32 (exact), or auto (the "
        "planner compresses the links that bind).",
    ),
    steps: int = typer.Option(200, min=1, help="Training steps."),
    batch_size: int = typer.Option(48, min=1, help="Samples per step."),
    microbatches: str = typer.Option(
        "auto", help="Microbatches per step: a number, or auto (the planner chooses)."
    ),
    lr: float = typer.Option(0.05, help="SGD learning rate."),
    port: int = typer.Option(0, help="Coordinator port (0: a free one)."),
    exit_after: bool = typer.Option(False, "--exit", help="Stop when the job is done."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object (with --exit)."),
) -> None:
    """Broker, coordinator, three data holders and a helper; train on data that stays home."""
    with needs_coordinator_extras("edgetrain demo"):
        # [Note: commands without torch]: the demo's library imports it.
        from coordinator.local.demo import (
            DemoFleet,
            DemoResult,
            demo_session,
            fedavg_of_the_demo,
            job_body,
        )
    from rich.console import Console

    console = Console(stderr=json_out, soft_wrap=True)
    emulated = DemoFleet.parse(fleet, link_mbps)
    with demo_session(emulated, port) as demo:
        _print_fleet(console, demo)
        demo.wait_online()
        body = job_body(steps, batch_size, microbatches, lr, codec)
        job = demo.submit(body)
        _print_plan(console, demo.wait_plan(job), demo.agents.ids, list(emulated.names))
        console.print(
            "never leaving the holders: the digits' images and their labels (the plan's "
            "first and last units run there, and the loss)"
        )
        record = _train(console, demo, job, steps, bar=not json_out)
        accuracy = demo.accuracy(job)
        console.print(f"test accuracy {accuracy:.3f} (held-out digits)")
        traffic = demo.traffic(job)
        result = DemoResult(
            accuracy,
            record,
            demo.holders_alone(body),
            traffic,
            fedavg_of_the_demo(),
            demo.anatomy(job),
            demo.links(job),
        )
        _print_result(console, result)
        _print_links(console, result)
        console.print(f"dashboard: {demo.url}/#/jobs/{job}")
        if json_out:
            typer.echo(json.dumps(result.summary()))
        if not exit_after and sys.stdin.isatty():
            console.print("serving until Ctrl-C")
            try:
                while True:
                    time.sleep(1)
            except KeyboardInterrupt:
                pass


def _print_fleet(console: Console, demo: DemoSession) -> None:
    """Where the broker and the coordinator are, and what each agent emulates."""
    url, fleet = demo.url, demo.fleet
    console.print(f"broker: {demo.agents.broker_url} (TLS, an account per device, ACLs)")
    console.print(f"coordinator: {url}  (dashboard {url}/, API token {demo.token})")
    for i, (device, name) in enumerate(zip(demo.agents.ids, fleet.names, strict=True)):
        holds = f", holds {fleet.data[i][0].split('=', 1)[1]}" if i < len(fleet.data) else ""
        console.print(
            f"  agent {device}: emulates {name}, "
            f"{fleet.slowdowns[i]:.1f}x slower than the fastest{holds}"
        )


def _train(
    console: Console, demo: DemoSession, job: str, steps: int, *, bar: bool
) -> dict[str, Any]:
    """Follow ``job`` to its end, with a progress bar unless ``bar`` is false; its record."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    if not bar:
        return demo.wait_job(job)
    progress = Progress(
        TextColumn("training"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[sps]} samples/s"),
        console=console,
    )
    progress.start()
    try:
        task = progress.add_task("train", total=steps, loss="-", sps="-")

        def show(record: dict[str, Any]) -> None:
            latest = record["latest"]
            if not latest:
                return
            sps = (record["spec"]["batch_size"] / latest["step_s"]) if latest["step_s"] else 0
            progress.update(
                task,
                completed=record["steps_done"],
                loss=f"{latest['loss']:.4f}" if latest["loss"] else "-",
                sps=f"{sps:.0f}",
            )

        return demo.wait_job(job, show)
    finally:
        progress.stop()


def _print_result(console: Console, result: DemoResult) -> None:
    """The rates measured on the plan and on the holders alone, and against the
    prediction."""
    console.print(
        f"{result.measured:.0f} samples/s on the plan; {result.by_holders:.0f} on the "
        "holders alone (measured in this run)"
    )
    console.print(f"speedup over the holders alone: {result.speedup or 0:.1f}x")
    console.print(
        f"predicted {result.predicted:.0f} samples/s: measured/predicted {result.ratio or 0:.2f}"
    )
    summary, fedavg = result.summary(), result.fedavg
    console.print(
        f"on the wire: {summary['bytes_per_sample'] / 1e3:.1f} kB of payload a training "
        f"sample, {summary['bytes_to_finish'] / 1e6:.0f} MB for the job; federated averaging "
        f"of the same model, one local epoch a round: {fedavg['bytes_per_sample'] / 1e3:.1f} "
        f"kB a sample (2 x {fedavg['model_bytes'] / 1e6:.2f} MB x {fedavg['clients']:.0f} "
        f"holders / {fedavg['samples_per_round']:.0f} samples)"
    )


def _print_links(console: Console, result: DemoResult) -> None:
    """What the links cost the job, predicted and measured, and the job on other rates."""
    from rich.table import Table

    predicted, measured = result.link_share("predicted"), result.link_share("measured")
    shares = f"predicted {predicted or 0:.0%} of the step's device-seconds"
    if measured is not None:
        shares += f", measured {measured:.0%}"
    console.print(f"on the links (sends, waits for bytes, group sums): {shares}")
    ladder = Table(
        "every link at",
        "plan",
        "codecs",
        "samples/s",
        "holders alone",
        "holders averaged (not exact)",
        "on links",
    )
    ladder.title = "the same job on other links (predicted)"
    for rung in result.links["ladder"]:
        ladder.add_row(
            f"{rung['mbps']:g} Mbit/s",
            f"split, {rung['stages']} stages" if rung["split"] else "holders alone",
            ",".join(rung["codecs"]) or "-",
            f"{rung['predicted_sps']:.0f}",
            f"{rung['holders_alone_sps']:.0f}",
            _sps_or_dash(rung.get("holders_averaged_sps")),
            f"{rung['link_share']:.0%}",
        )
    console.print(ladder)
    below = result.links["split_stops_paying_below_mbps"]
    if below is None:
        console.print("the split does not pay at any of these rates: the holders train alone")
    elif below == 0:
        console.print("the split pays at every one of these rates")
    else:
        console.print(
            f"the split stops paying below about {below:.0f} Mbit/s a link (predicted): "
            "there the planner keeps the job on the holders"
        )


def _sps_or_dash(sps: float | None) -> str:
    """``sps`` as a whole number of samples/s, ``-`` where there is none (the holders of a
    job whose labels stay home cannot average)."""
    return "-" if sps is None else f"{sps:.0f}"


def _print_plan(console: Console, plan: dict[str, Any], ids: list[str], names: list[str]) -> None:
    """Which units run where, and what crosses each link (the plan's ``egress``)."""
    from rich.table import Table

    table = Table("stage", "devices", "emulates", "units")
    for s, st in enumerate(plan["stages"]):
        a, b = st["layers"]
        members = st.get("devices") or [st["device"]]  # a group, or one device
        emulates = "+".join(names[ids.index(d)] for d in members)
        table.add_row(str(s), "+".join(members), emulates, ",".join(plan["units"][a:b]))
    console.print(table)
    crossing = Table("from", "to", "what crosses", "shape per sample", "codec")
    for row in plan.get("egress", []):
        shape = "-" if row["shape"] is None else "x".join(map(str, row["shape"])) or "scalar"
        crossing.add_row(
            ",".join(row["from"]), ",".join(row["to"]), row["what"], shape, row["codec"]
        )
    console.print(crossing)
