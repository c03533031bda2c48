"""``edgetrain train``: plan a model over N local devices and train it as a pipeline.

With ``--transport mqtt`` (the default) it starts a broker unless ``--broker``
is given, starts N real agent processes, and drives them over MQTT exactly as
the coordinator service drives a fleet; ``--transport inprocess`` runs the
stages as threads of this process; ``--transport dist`` runs the server tier
(:mod:`edge.transport.dist`): one process per stage and replica, launched with
torchrun semantics (:mod:`edge.server.launch`), gloo on CPUs and NCCL with
``--device cuda``, ``--replicas R`` data-parallel copies of the pipeline.
``--devices 1`` is the single-device reference: the same code path, one stage,
no pipeline. ``--devices`` also takes catalogue profiles (``laptop,rpi4-4gb,...``):
agents then emulate those devices, and plans (and a group's shares) follow their
speeds. The planner (``--partition plan``) puts a stage on a device group where that
pays (not with ``--fault``, ``--replicate-every``, ``--servers`` or ``--replicas``);
``--holders K`` trains on data that stays on the first K agents, and ``--labels local``
keeps its labels there too (the holders run the last units and the loss as well);
``--partition even --group-sizes 2,1,1`` forces stages on device groups
(data-parallel within a stage, [Note: groups on the wire] in :mod:`edge.wire.groups`).
The command parses and checks its options, builds the job's spec, prints; the
training is :mod:`coordinator.local.train`'s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from edge.errors import UserError
from edge.files import write_atomic
from edge.wire.messages import StepReport

__all__ = ["train_command"]


def train_command(
    model: str = typer.Option("cnn-digits", "--model", help="Zoo model or package.module:fn."),
    dataset: str | None = typer.Option(None, "--dataset", help="Dataset (default: the model's)."),
    option: list[str] = typer.Option([], "--option", "-o", help="Model option key=value."),
    devices_opt: str = typer.Option(
        "3",
        "--devices",
        help="Local devices (agents) to use: a count, or catalogue profiles to emulate "
        "(laptop,rpi4-4gb,...: each announces its profile and runs slowed to its speed).",
    ),
    steps: int = typer.Option(50, "--steps", min=1, help="Optimizer steps."),
    batch_size: int = typer.Option(64, "--batch-size", "-b", min=1, help="Samples per step."),
    microbatches: int = typer.Option(4, "--microbatches", "-m", min=1, help="Per step."),
    schedule: str = typer.Option("1f1b", "--schedule", help="1f1b or gpipe."),
    optimizer: str = typer.Option("sgd", "--optimizer", help="sgd or adamw."),
    lr: float = typer.Option(0.05, "--lr", help="Learning rate."),
    momentum: float = typer.Option(0.9, "--momentum", help="SGD momentum."),
    weight_decay: float = typer.Option(0.0, "--weight-decay", help="Weight decay."),
    codec: str = typer.Option(
        "fp32",
        "--codec",
        help="fp32, fp16, bf16 or int8 on every link; auto: the planner "
        "compresses only the links that would otherwise slow the step.",
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the weights and the data order."),
    transport: str = typer.Option(
        "mqtt", "--transport", help="mqtt, inprocess or dist (torch.distributed, the server tier)."
    ),
    replicas: int = typer.Option(
        1, "--replicas", min=1, help="dist: data-parallel pipeline copies (divides --devices)."
    ),
    device: str = typer.Option("cpu", "--device", help="dist: cpu or cuda (one GPU per process)."),
    servers: int = typer.Option(
        0,
        "--servers",
        min=0,
        help="mqtt: the last K agents are a server tier (a hybrid "
        "pipeline: frames between servers go over torch.distributed).",
    ),
    precision: str = typer.Option(
        "fp32", "--precision", help="fp32, or bf16 (autocast; weights stay fp32)."
    ),
    broker: str | None = typer.Option(
        None, "--broker", help="Broker URL; without it one is started (mosquitto, else amqtt)."
    ),
    partition: str = typer.Option(
        "plan",
        "--partition",
        help="plan (the planner decides, device groups included) or even (an even split over "
        "all devices, or --stages).",
    ),
    stages: int | None = typer.Option(
        None,
        "--stages",
        min=1,
        help="Exactly N stages: with plan, the planner's best plan of N stages; with even, "
        "the N fastest devices (the first always among them). Default: what --partition gives.",
    ),
    objective: str = typer.Option(
        "time",
        "--objective",
        help="What the planner minimises: time (the step) or energy (from the catalogue's "
        "datasheet power figures, a prediction; needs catalogue --devices).",
    ),
    deadline: float | None = typer.Option(
        None, "--deadline", help="Only plans whose predicted step takes at most S seconds."
    ),
    unit_times: str = typer.Option(
        "host",
        "--unit-times",
        help="Where the planner's seconds of each unit come from: host (this machine's, "
        "scaled to each device by its matmul rate) or devices (each agent times the model's "
        "units itself before the plan, under its own limits: slower to start, closer on "
        "devices unlike this one).",
    ),
    group_sizes_opt: str | None = typer.Option(
        None,
        "--group-sizes",
        help="With --partition even: devices per stage, e.g. 2,1,1 (adding up to --devices); "
        "a stage on several devices trains data-parallel, each on a share of every "
        "microbatch by its speed.",
    ),
    holders: int = typer.Option(
        0,
        "--holders",
        min=0,
        help="Data that stays home: the first K agents each hold 1/K of the dataset "
        "(agent --data DATASET=DATASET:shard=i/K) and the job trains on their union; "
        "they are stage 0, and only activations leave them (--transport mqtt).",
    ),
    labels: str = typer.Option(
        "central",
        "--labels",
        help="With --holders: central (the last stage, on a helper, gets the labels) or "
        "local (the labels never leave the holders: they run the last units and the loss "
        "too, on their own samples; the plan is holders, helpers, holders).",
    ),
    save_weights: Path | None = typer.Option(
        None, "--save-weights", help="Write the trained model here (safetensors)."
    ),
    threads: int | None = typer.Option(
        None,
        "--threads",
        min=1,
        help="torch threads per agent (default: cores / devices). Equal counts give "
        "bit-identical results across runs with different numbers of devices.",
    ),
    fault: list[str] = typer.Option(
        [],
        "--fault",
        help="Inject a fault: kill:STAGE[.MEMBER]@STEP (SIGKILL that stage's agent, or "
        "that member of its group, once it "
        "reports STEP). Repeatable; implies fault tolerance.",
    ),
    replicate_every: int | None = typer.Option(
        None,
        "--replicate-every",
        min=0,
        help="Fault tolerance: replicate every stage's state every R steps (0: off). "
        "Default: off, or with --fault chosen so replication costs at most 5% of a step and "
        "happens at least 10 times a job (coordinator/engine/rebalance.py). A failed device is "
        "replaced by re-planning over the rest.",
    ),
    heartbeat_timeout: float = typer.Option(
        3.0,
        "--heartbeat-timeout",
        min=0.1,
        help="Seconds without a heartbeat before a device "
        "is declared dead (its last will is quicker).",
    ),
    rebalance: bool = typer.Option(
        True,
        "--rebalance/--no-rebalance",
        help="Fault tolerance: migrate layers when measured "
        "stage times say another plan is over 10% faster and worth the move.",
    ),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object at the end."),
) -> None:
    """Train MODEL split across N local devices over MQTT (or in-process threads)."""
    from pydantic import ValidationError

    from edge.errors import describe_validation_error
    from edge.runtime.allocator import tune_malloc

    if transport not in ("mqtt", "inprocess", "dist"):
        raise UserError(f"--transport: {transport!r} is not mqtt, inprocess or dist")
    devices, profiles = _devices(devices_opt)
    group_sizes = _group_sizes(group_sizes_opt, devices, partition)
    if profiles and transport == "dist":
        raise UserError("--devices with profiles is for --transport mqtt or inprocess")
    if group_sizes and (replicas > 1 or servers):
        raise UserError("--group-sizes runs without --replicas or --servers")
    if holders and (transport != "mqtt" or holders > devices or group_sizes or servers):
        raise UserError(
            "--holders K needs --transport mqtt, K <= --devices, and no --group-sizes or --servers"
        )
    if labels not in ("central", "local"):
        raise UserError(f"--labels: {labels!r} is not central or local")
    if labels == "local" and not holders:
        raise UserError("--labels local needs --holders (data that stays home)")
    if labels == "local" and (fault or replicate_every):
        raise UserError("--labels local cannot be combined with --fault or --replicate-every yet")
    if transport != "dist" and (replicas > 1 or device != "cpu"):
        raise UserError("--replicas and --device are for --transport dist")
    if device not in ("cpu", "cuda"):
        raise UserError(f"--device: {device!r} is not cpu or cuda")
    if servers and (transport != "mqtt" or servers > devices):
        raise UserError("--servers K needs --transport mqtt and K <= --devices")
    if servers and fault:
        raise UserError("--servers and --fault cannot be combined yet")
    if devices % replicas:
        raise UserError(f"--devices {devices} is not a multiple of --replicas {replicas}")
    if stages is not None and stages > devices // replicas:
        per = "" if replicas == 1 else f" / --replicas {replicas}"
        raise UserError(f"--stages {stages} is more than --devices {devices}{per}")
    if batch_size % (microbatches * replicas):  # before the spec: --replicas is not in it
        raise UserError(
            f"--batch-size {batch_size} is not a multiple of --microbatches x --replicas"
        )
    from coordinator.engine.spec import JobSpec  # [Note: commands without torch]
    from edge.models.zoo import parse_options

    try:
        spec = JobSpec.model_validate(
            {
                "model": model,
                "model_options": parse_options(option),
                "dataset": dataset,
                "steps": steps,
                "batch_size": batch_size,
                "microbatches": microbatches,
                "schedule": schedule,
                "codec": codec,
                "seed": seed,
                "precision": precision,
                "partition": partition,
                "stages": stages,
                "group_sizes": group_sizes,
                "objective": objective,
                "max_step_time_s": deadline,
                "unit_times": unit_times,
                "data": {
                    "name": _holders_data(model, dataset, parse_options(option)),
                    "labels": labels,
                }
                if holders
                else None,
                "optimizer": {
                    "name": optimizer,
                    "lr": lr,
                    "momentum": momentum,
                    "weight_decay": weight_decay,
                },
            }
        )
    except ValidationError as exc:
        raise UserError(describe_validation_error(exc, "train")) from None
    from coordinator.engine.faults import parse_fault

    faults = [parse_fault(f) for f in fault]
    if replicate_every is None:
        replicate_every = -1 if faults else 0  # -1: from the plan's measured costs
    if unit_times == "devices" and transport != "mqtt":
        raise UserError("--unit-times devices needs --transport mqtt (agents to time the units)")
    if replicate_every and transport != "mqtt":
        raise UserError("--fault and --replicate-every need --transport mqtt (agents to lose)")
    for f in faults:
        if f.kind == "join":
            from edge.profiling.catalog import resolve

            resolve(f.profile or "")  # an unknown profile fails here, before anything starts
        if f.stage >= (stages or devices) or f.step >= steps:
            raise UserError(
                f"--fault {f}: stage must be below --stages (else --devices) and step below --steps"
            )
    tune_malloc()  # the in-process paths train here; agents tune their own
    progress = _Progress(steps, batch_size, enabled=not json_out)
    from coordinator.local.train import train_dist, train_inprocess, train_on_local_fleet

    with progress:
        if transport == "inprocess":
            run = train_inprocess(spec, devices, on_step=progress.update, profiles=profiles)
        elif transport == "dist":
            run = train_dist(
                spec,
                devices,
                replicas=replicas,
                device=device,
                threads=threads,
                on_step=progress.update,
                note=progress.note,
            )
        else:
            run = train_on_local_fleet(
                spec,
                devices,
                broker=broker,
                threads=threads,
                servers=servers,
                faults=faults,
                replicate_every=replicate_every,
                heartbeat_timeout_s=heartbeat_timeout,
                rebalance=rebalance,
                on_step=progress.update,
                note=progress.note,
                profiles=profiles,
                holders=holders,
            )
    result, score, broker_name = run.result, run.score, run.broker
    if save_weights is not None:
        try:
            write_atomic(save_weights, result.weights_bytes())
        except OSError as exc:
            raise UserError(
                f"--save-weights {save_weights}: cannot write: {exc.strerror or exc}"
            ) from None
    out = {
        "losses": result.losses,
        "samples_per_s": result.samples_per_s,
        "plan": score.to_json(),
        "predicted": run.prediction.to_json() if run.prediction is not None else None,
        "transport": transport,
        "broker": broker_name,
        "job": result.job,
        "steps": steps,
        "wall_s": result.wall_s,
        "stages": result.stage_summary(),
        **run.extra,
    }
    if json_out:
        typer.echo(json.dumps(out))
    else:
        typer.echo(
            f"job {result.job}: {steps} steps, final loss {result.losses[-1]:.4f}, "
            f"{result.samples_per_s:.1f} samples/s over {len(score.plan.stages)} stages "
            f"({transport}{', ' + broker_name if broker_name else ''})"
        )
        guess = run.prediction or score
        typer.echo(
            f"predicted {guess.throughput_sps:.1f} samples/s; measured/predicted "
            f"{result.samples_per_s / guess.throughput_sps:.2f}"
        )


def _holders_data(model: str, dataset: str | None, options: dict[str, Any]) -> str:
    """The dataset the ``--holders`` shard: ``--dataset``, else the model's own."""
    if dataset is not None:
        return dataset
    from edge.models.zoo import get_model

    return get_model(model, **options).dataset


class _Progress:
    """A rich progress bar with the loss and samples/s, or nothing (``--json``)."""

    def __init__(self, steps: int, batch_size: int, enabled: bool) -> None:
        self.enabled = enabled
        self.batch_size = batch_size
        self._bar: Any = None
        self._task: Any = None
        self._steps = steps
        self._first: float | None = None

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self._bar = Progress(
                TextColumn("training"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[sps]} samples/s"),
            )
            self._bar.start()
            self._task = self._bar.add_task("train", total=self._steps, loss="-", sps="-")
        return self

    def __exit__(self, *_exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def note(self, text: str) -> None:
        """A line for the user: above the bar, or on standard error under ``--json``."""
        if self._bar is not None:
            self._bar.console.print(text)
        else:
            typer.echo(text, err=True)

    def update(self, report: StepReport) -> None:
        import time

        if self._bar is None or report.loss is None:
            return
        now = time.perf_counter()
        self._first = self._first or now - report.step_s
        sps = (report.step + 1) * self.batch_size / max(now - self._first, 1e-9)
        self._bar.update(
            self._task, completed=report.step + 1, loss=f"{report.loss:.4f}", sps=f"{sps:.0f}"
        )


def _devices(text: str) -> tuple[int, list[str] | None]:
    """``--devices``: a count, or catalogue profiles (their count, and their names)."""
    text = text.strip()
    if text.isdigit():
        if int(text) < 1:
            raise UserError(f"--devices: {text} is not a positive count")
        return int(text), None
    names = [n.strip() for n in text.split(",")]
    if not all(names):
        raise UserError(f"--devices: {text!r} is not a count or a list of catalogue profiles")
    from edge.profiling.catalog import resolve

    for name in names:
        resolve(name)  # an unknown profile fails here, with its own one-line message
    return len(names), names


def _group_sizes(text: str | None, devices: int, partition: str) -> list[int] | None:
    """``--group-sizes 2,1,1``: devices per stage, adding up to ``--devices``."""
    if text is None:
        return None
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise UserError(f"--group-sizes: {text!r} is not a list of positive counts like 2,1,1")
    sizes = [int(p) for p in parts]
    if sum(sizes) != devices:
        raise UserError(f"--group-sizes {text} adds up to {sum(sizes)}, not --devices {devices}")
    if partition != "even":
        raise UserError("--group-sizes needs --partition even")
    return sizes
