"""``edgetrain demo``: the product end to end, on embedded defaults: data that stays home.

It starts the coordinator (REST API and dashboard) with a freshly generated
API token and its own broker (Mosquitto, else the embedded amqtt; TLS,
accounts and ACLs either way), and enrols agent processes through the API, each
emulating a catalogue device (slowed in software to its speed relative to the
fastest, announcing the speed it gets: ``edgetrain agent --emulate``): three
Raspberry Pi 4s that each hold a third of ``digits`` (``--data
digits=digits:shard=i/3``), and a laptop that holds nothing. It submits a job on
that local data through the REST API ([Note: local data]; the model is
``cnn-digits`` at :data:`MODEL_OPTIONS`) and prints, in order: the plan (which
units run where, and what crosses each link), a progress bar, the test accuracy
on held-out digits, the samples/s measured for the plan and for the holders alone
(the same job on them only, run next), the speedup, the prediction's error and
the dashboard URL. It keeps serving until Ctrl-C unless ``--exit`` (or when no one
is at a terminal to press Ctrl-C, as in CI).
"""

from __future__ import annotations

import json
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from pydantic import SecretStr

from coordinator.local.broker import free_port
from edge.errors import UserError, needs_coordinator_extras
from edge.profiling.catalog import resolve

if TYPE_CHECKING:
    import httpx
    import torch
    from rich.console import Console
    from rich.progress import Progress

    from edge.models.zoo import ModelSpec

__all__ = ["HOLDERS", "MODEL_OPTIONS", "demo_command", "test_accuracy"]

MODEL_OPTIONS: dict[str, Any] = {"width": 64}
"""cnn-digits at four times its default width: enough work per sample that handing all
but the first convolution to the laptop pays over the holders training alone."""

HOLDERS = 3
"""The first devices of the fleet hold the data, a shard each."""


def test_accuracy(spec: ModelSpec, weights: dict[str, torch.Tensor]) -> float:
    """Accuracy of the trained weights on the test split of the model's dataset."""
    import torch  # [Note: commands without torch] in edgetrain.cli
    from torch.utils.data import DataLoader

    from edge.models.datasets import build_dataset

    model = spec.build()
    model.load_state_dict(weights)
    model.eval()
    data = build_dataset(spec.dataset, "test", **spec.dataset_options)
    correct = total = 0
    with torch.no_grad():
        for x, y in DataLoader(data, batch_size=256):
            correct += int((model(x).argmax(-1) == y).sum())
            total += len(y)
    return correct / total


def _wait_job(api: httpx.Client, job: str, progress: Progress | None, steps: int) -> dict[str, Any]:
    task = progress.add_task("train", total=steps, loss="-", sps="-") if progress else None
    while True:
        record = api.get(f"/api/v1/jobs/{job}").json()
        if progress is not None and task is not None and record["latest"]:
            latest = record["latest"]
            sps = (record["spec"]["batch_size"] / latest["step_s"]) if latest["step_s"] else 0
            progress.update(
                task,
                completed=record["steps_done"],
                loss=f"{latest['loss']:.4f}" if latest["loss"] else "-",
                sps=f"{sps:.0f}",
            )
        if record["state"] in ("completed", "failed", "cancelled"):
            return dict(record)
        time.sleep(0.3)


def demo_command(
    fleet: str = typer.Option(
        "rpi4-4gb,rpi4-4gb,rpi4-4gb,laptop",
        help="Catalogue devices to emulate; the first three hold a third of the data each.",
    ),
    steps: int = typer.Option(200, min=1, help="Training steps."),
    batch_size: int = typer.Option(48, min=1, help="Samples per step."),
    microbatches: int = typer.Option(4, min=1, help="Microbatches per step."),
    lr: float = typer.Option(0.05, help="SGD learning rate."),
    port: int = typer.Option(0, help="Coordinator port (0: a free one)."),
    exit_after: bool = typer.Option(False, "--exit", help="Stop when the job is done."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object (with --exit)."),
) -> None:
    """Broker, coordinator, three data holders and a helper; train on data that stays home."""
    with needs_coordinator_extras("edgetrain demo"):
        import httpx

        from coordinator.service.serve import serve_in_thread
        from coordinator.service.settings import Settings
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from coordinator.local.fleet import AgentRoles, LocalFleet  # [Note: commands without torch]
    from edge.models.zoo import get_model
    from edge.transport.credentials import Credentials

    console = Console(stderr=json_out, soft_wrap=True)
    names = [n for n in fleet.split(",") if n]
    if len(names) <= HOLDERS:
        raise UserError(f"--fleet: {HOLDERS} data holders and at least one helper")
    profiles = [resolve(n) for n in names]
    specs = [p.to_device_spec() for p in profiles]
    fastest = max(d.gflops for d in specs)
    slowdowns = [fastest / d.gflops for d in specs]
    data = [[f"digits=digits:shard={i + 1}/{HOLDERS}"] for i in range(HOLDERS)]
    token = secrets.token_urlsafe(24)
    with tempfile.TemporaryDirectory(prefix="edgetrain-demo-") as tmp:
        # The coordinator starts its own broker (Mosquitto, else the embedded amqtt; TLS,
        # accounts and ACLs that follow the plan either way) and the agents are enrolled
        # through its API, as a user would.
        settings = Settings(
            data_dir=Path(tmp), api_token=SecretStr(token), port=port or free_port()
        )
        url = f"http://{settings.host}:{settings.port}"
        with (
            serve_in_thread(settings),
            httpx.Client(
                base_url=url, timeout=30, headers={"Authorization": f"Bearer {token}"}
            ) as api,
        ):

            def enroll(device: str) -> Credentials:
                got = api.post("/api/v1/devices/enroll", json={"device_id": device})
                got.raise_for_status()
                return Credentials.model_validate(got.json())

            roles = AgentRoles(profiles=[p.name for p in profiles], slowdowns=slowdowns, data=data)
            with LocalFleet(len(names), None, roles=roles, threads=1, enroll=enroll) as agents:
                console.print(f"broker: {agents.broker_url} (TLS, an account per device, ACLs)")
                console.print(f"coordinator: {url}  (dashboard {url}/, API token {token})")
                for i, (device, name) in enumerate(zip(agents.ids, names, strict=True)):
                    holds = f", holds {data[i][0].split('=', 1)[1]}" if i < HOLDERS else ""
                    console.print(
                        f"  agent {device}: emulates {name}, "
                        f"{slowdowns[i]:.1f}x slower than the fastest{holds}"
                    )
                deadline = time.monotonic() + 120
                while sum(
                    d["state"] == "online" for d in api.get("/api/v1/devices").json()["data"]
                ) < len(names):
                    if time.monotonic() > deadline:
                        raise UserError("the emulated devices did not come online")
                    time.sleep(0.2)
                body = {
                    "model": "cnn-digits",
                    "model_options": MODEL_OPTIONS,
                    "dataset": "digits",
                    "steps": steps,
                    "batch_size": batch_size,
                    "microbatches": microbatches,
                    "optimizer": {"name": "sgd", "lr": lr, "momentum": 0.9},
                    "data": {"name": "digits", "placement": "local"},
                }
                created = api.post("/api/v1/jobs", json=body)
                created.raise_for_status()
                job = created.json()["id"]
                plan = _wait_plan(api, job)
                _print_plan(console, plan, agents.ids, names)
                bar = (
                    None
                    if json_out
                    else Progress(
                        TextColumn("training"),
                        BarColumn(),
                        MofNCompleteColumn(),
                        TextColumn("loss {task.fields[loss]}"),
                        TextColumn("{task.fields[sps]} samples/s"),
                        console=console,
                    )
                )
                if bar is not None:
                    bar.start()
                try:
                    record = _wait_job(api, job, bar, steps)
                finally:
                    if bar is not None:
                        bar.stop()
                if record["state"] != "completed":
                    raise UserError(f"job {job} {record['state']}: {record['reason']}")
                import safetensors.torch

                weights = safetensors.torch.load(api.get(f"/api/v1/jobs/{job}/model").content)
                accuracy = test_accuracy(get_model("cnn-digits", **MODEL_OPTIONS), weights)
                console.print(f"test accuracy {accuracy:.3f} (held-out digits)")
                # The same job on the holders alone, for comparison: the federated option.
                holders = agents.ids[:HOLDERS]
                alone_steps = min(steps, 40)
                alone_body = {**body, "steps": alone_steps, "devices": holders}
                alone = api.post("/api/v1/jobs", json=alone_body).json()["id"]
                alone_record = _wait_job(api, alone, None, alone_steps)
                if alone_record["state"] != "completed":
                    why = alone_record["reason"]
                    raise UserError(
                        f"job {alone} (the holders alone) {alone_record['state']}: {why}"
                    )
                measured, by_holders = record["samples_per_s"], alone_record["samples_per_s"]
                predicted = record["plan"]["throughput_sps"]
                ratio = measured / predicted if predicted else None
                speedup = measured / by_holders if by_holders else None
                console.print(
                    f"{measured:.0f} samples/s on the plan; {by_holders:.0f} on the holders "
                    f"alone (measured in this run)"
                )
                console.print(f"speedup over the holders alone: {speedup or 0:.1f}x")
                console.print(
                    f"predicted {predicted:.0f} samples/s: measured/predicted {ratio or 0:.2f}"
                )
                console.print(f"dashboard: {url}/#/jobs/{job}")
                summary = {
                    "accuracy": accuracy,
                    "samples_per_s": measured,
                    "holders_alone_samples_per_s": by_holders,
                    "speedup_vs_holders_alone": speedup,
                    "predicted_samples_per_s": predicted,
                    "measured_over_predicted": ratio,
                    "plan": {
                        k: record["plan"][k]
                        for k in (
                            "stages",
                            "egress",
                            "step_time_s",
                            "throughput_sps",
                            "feasible",
                        )
                    },
                }
                if json_out:
                    typer.echo(json.dumps(summary))
                if not exit_after and sys.stdin.isatty():
                    console.print("serving until Ctrl-C")
                    try:
                        while True:
                            time.sleep(1)
                    except KeyboardInterrupt:
                        pass


def _wait_plan(api: httpx.Client, job: str) -> dict[str, Any]:
    """The job's plan, once the coordinator has made it (bounded)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        record = api.get(f"/api/v1/jobs/{job}").json()
        if record.get("plan"):
            return dict(record["plan"])
        if record["state"] in ("failed", "cancelled"):
            raise UserError(f"job {job} {record['state']}: {record['reason']}")
        time.sleep(0.2)
    raise UserError(f"job {job} was not planned within 120 s")


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
