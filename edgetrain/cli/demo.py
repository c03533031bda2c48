"""``edgetrain demo``: the product end to end, on embedded defaults.

It starts the coordinator (REST API and dashboard) with a freshly generated
API token and its own broker (Mosquitto, else the embedded amqtt; TLS,
accounts and ACLs either way), enrols three agent processes
through the API emulating catalogue devices: each is slowed in software to that
device's speed relative to the fastest and announces the speed it gets
(``edgetrain agent --emulate``), so the job's prediction is of what it measures.
It then submits a ``cnn-digits`` job on ``digits`` through the REST API (the
first device holds the data; the model at twice its default width, see
:data:`MODEL_OPTIONS`), follows it with a progress bar, checks the
trained model on held-out digits, measures the best single device on the same
job for comparison, and prints the plan, the accuracy, both samples/s and the
dashboard URL. It keeps serving until Ctrl-C unless ``--exit`` (or when no one is
at a terminal to press Ctrl-C, as in CI).
"""

from __future__ import annotations

import json
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import typer
from pydantic import SecretStr
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table
from torch.utils.data import DataLoader

from coordinator.local.broker import free_port
from coordinator.local.fleet import LocalFleet
from edge.errors import UserError, needs_coordinator_extras
from edge.models.datasets import build_dataset
from edge.models.zoo import ModelSpec, get_model
from edge.profiling.catalog import resolve
from edge.transport.credentials import Credentials

if TYPE_CHECKING:
    import httpx

__all__ = ["MODEL_OPTIONS", "demo_command", "test_accuracy"]

MODEL_OPTIONS: dict[str, Any] = {"width": 32}
"""cnn-digits at twice its default width: enough work per step that the planner's own
best plan on the default fleet uses two devices: the Pi, which holds the data, and the
Jetson train the whole model as one group, data-parallel (without groups it would be a
pipeline: the Pi runs the first convolution and hands the rest to the Jetson). At the
default width the Pi alone is quicker than any plan, so the demo would show one device."""


@torch.no_grad()
def test_accuracy(spec: ModelSpec, weights: dict[str, torch.Tensor]) -> float:
    """Accuracy of the trained weights on the test split of the model's dataset."""
    model = spec.build()
    model.load_state_dict(weights)
    model.eval()
    data = build_dataset(spec.dataset, "test", **spec.dataset_options)
    correct = total = 0
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
        "rpi5-8gb,jetson-nano,laptop",
        help="Catalogue devices to emulate (the first holds the data).",
    ),
    steps: int = typer.Option(300, min=1, help="Training steps."),
    batch_size: int = typer.Option(32, min=1, help="Samples per step."),
    microbatches: int = typer.Option(4, min=1, help="Microbatches per step."),
    lr: float = typer.Option(0.05, help="SGD learning rate."),
    port: int = typer.Option(0, help="Coordinator port (0: a free one)."),
    exit_after: bool = typer.Option(False, "--exit", help="Stop when the job is done."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object (with --exit)."),
) -> None:
    """Broker, coordinator and three emulated devices; train cnn-digits through the REST API."""
    with needs_coordinator_extras("edgetrain demo"):
        import httpx

        from coordinator.service.serve import serve_in_thread
        from coordinator.service.settings import Settings

    console = Console(stderr=json_out, soft_wrap=True)
    names = [n for n in fleet.split(",") if n]
    profiles = [resolve(n) for n in names]
    specs = [p.to_device_spec() for p in profiles]
    fastest = max(d.gflops for d in specs)
    slowdowns = [fastest / d.gflops for d in specs]
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

            with LocalFleet(
                len(names),
                None,
                enroll=enroll,
                threads=1,
                profiles=[p.name for p in profiles],
                slowdowns=slowdowns,
            ) as agents:
                console.print(f"broker: {agents.broker_url} (TLS, an account per device, ACLs)")
                console.print(f"coordinator: {url}  (dashboard {url}/, API token {token})")
                for device, name, slow in zip(agents.ids, names, slowdowns, strict=True):
                    console.print(
                        f"  agent {device}: emulates {name}, {slow:.1f}x slower than the fastest"
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
                    "pin_first": agents.ids[0],
                }
                created = api.post("/api/v1/jobs", json=body)
                created.raise_for_status()
                job = created.json()["id"]
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
                # The same job on the fastest device alone, for comparison.
                best = agents.ids[slowdowns.index(min(slowdowns))]
                single_body = {
                    **body,
                    "steps": min(steps, 100),
                    "devices": [best],
                    "pin_first": best,
                }
                single = api.post("/api/v1/jobs", json=single_body).json()["id"]
                single_record = _wait_job(api, single, None, min(steps, 100))
                plan = record["plan"]
                table = Table("stage", "device", "emulates", "units", "compute ms", "link ms")
                for s, st in enumerate(plan["stages"]):
                    a, b = st["layers"]
                    link = f"{plan['link_s'][s] * 1e3:.2f}" if s < len(plan["link_s"]) else "-"
                    members = st.get("devices") or [st["device"]]  # a group, or one device
                    emulates = "+".join(names[agents.ids.index(d)] for d in members)
                    compute = f"{plan['compute_s'][s] * 1e3:.3f}"
                    units = ",".join(plan["units"][a:b])
                    table.add_row(str(s), "+".join(members), emulates, units, compute, link)
                console.print(table)
                predicted = plan["throughput_sps"]
                ratio = record["samples_per_s"] / predicted if predicted else None
                summary = {
                    "accuracy": accuracy,
                    "samples_per_s": record["samples_per_s"],
                    "predicted_samples_per_s": predicted,
                    "measured_over_predicted": ratio,
                    "single_device_samples_per_s": single_record["samples_per_s"],
                    "plan": {
                        k: plan[k]
                        for k in (
                            "stages",
                            "step_time_s",
                            "bottleneck_s",
                            "throughput_sps",
                            "feasible",
                        )
                    },
                }
                console.print(
                    f"test accuracy {accuracy:.3f}; {record['samples_per_s']:.0f} samples/s "
                    f"on the plan (predicted {predicted:.0f}, measured/predicted "
                    f"{ratio or 0:.2f}), {single_record['samples_per_s']:.0f} on the fastest "
                    f"device alone; dashboard {url}/"
                )
                if json_out:
                    typer.echo(json.dumps(summary))
                if not exit_after and sys.stdin.isatty():
                    console.print("serving until Ctrl-C")
                    try:
                        while True:
                            time.sleep(1)
                    except KeyboardInterrupt:
                        pass
