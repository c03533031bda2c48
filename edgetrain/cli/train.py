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
The command parses its options, builds the job's spec from them (a flag named as one
of the spec's fields is that field: :func:`local_training`) and prints; how the
options combine is checked by :class:`~coordinator.local.options.LocalTraining`, and
the training is :mod:`coordinator.local.train`'s.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from pydantic import BaseModel

from coordinator.local.choices import (
    Labels,
    Objective,
    OptimizerName,
    Partition,
    TorchDevice,
    Transport,
)
from edge.config import Precision
from edge.errors import UserError
from edge.files import write_atomic
from edge.wire.messages import StepReport

if TYPE_CHECKING:
    from coordinator.local.options import LocalTraining
    from coordinator.local.train import LocalRun

__all__ = ["local_training", "train_command"]

M = TypeVar("M", bound=BaseModel)

# The command's options, one alias each, so that its signature is one line per option.
ModelOpt = Annotated[str, typer.Option("--model", help="Zoo model or package.module:fn.")]
DatasetOpt = Annotated[
    str | None, typer.Option("--dataset", help="Dataset (default: the model's).")
]
OptionOpt = Annotated[
    list[str] | None, typer.Option("--option", "-o", help="Model option key=value.")
]
DatasetOptionOpt = Annotated[
    list[str] | None,
    typer.Option("--dataset-option", help="Dataset option key=value (default: the model's)."),
]
DevicesOpt = Annotated[
    str,
    typer.Option(
        "--devices",
        help="Local devices (agents) to use: a count, or catalogue profiles to emulate "
        "(laptop,rpi4-4gb,...: each announces its profile and runs slowed to its speed).",
    ),
]
StepsOpt = Annotated[int, typer.Option("--steps", min=1, help="Optimizer steps.")]
BatchSizeOpt = Annotated[int, typer.Option("--batch-size", "-b", min=1, help="Samples per step.")]
MicrobatchesOpt = Annotated[
    str,
    typer.Option(
        "--microbatches",
        "-m",
        help="Per step: a number, or auto (the planner chooses, the default).",
    ),
]
ScheduleOpt = Annotated[
    str,
    typer.Option(
        "--schedule",
        help="1f1b, gpipe, zb-h1 (zero bubble) or auto (the fastest its plan's devices hold).",
    ),
]
OptimizerOpt = Annotated[OptimizerName, typer.Option("--optimizer", help="sgd or adamw.")]
LrOpt = Annotated[float, typer.Option("--lr", help="Learning rate.")]
MomentumOpt = Annotated[float, typer.Option("--momentum", help="SGD momentum.")]
WeightDecayOpt = Annotated[float, typer.Option("--weight-decay", help="Weight decay.")]
DiLoCoOpt = Annotated[
    int | None,
    typer.Option(
        "--diloco",
        help="NON-EXACT: a stage group's members step on their own rows and sync every "
        "this many steps (DiLoCo). Absent: exact.",
    ),
]
OuterLrOpt = Annotated[float, typer.Option("--outer-lr", help="DiLoCo's outer learning rate.")]
OuterMomentumOpt = Annotated[
    float, typer.Option("--outer-momentum", help="DiLoCo's outer Nesterov momentum.")
]
CodecOpt = Annotated[
    str,
    typer.Option(
        "--codec",
        help="fp32, fp16, bf16 or int8 on every link; auto: the planner "
        "compresses only the links that would otherwise slow the step.",
    ),
]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of the weights and the data order.")]
RecvTimeoutOpt = Annotated[
    float,
    typer.Option(
        "--recv-timeout", help="Seconds a stage waits for one frame before it gives up on the job."
    ),
]
TransportOpt = Annotated[
    Transport,
    typer.Option(
        "--transport", help="mqtt, inprocess or dist (torch.distributed, the server tier)."
    ),
]
ReplicasOpt = Annotated[
    int,
    typer.Option(
        "--replicas", min=1, help="dist: data-parallel pipeline copies (divides --devices)."
    ),
]
DeviceOpt = Annotated[
    TorchDevice,
    typer.Option(
        "--device", help="cpu or cuda: dist's ranks (one GPU each), or --servers' agents."
    ),
]
ServersOpt = Annotated[
    int,
    typer.Option(
        "--servers",
        min=0,
        help="mqtt: the last K agents are a server tier (a hybrid "
        "pipeline: frames between servers go over torch.distributed).",
    ),
]
PrecisionOpt = Annotated[
    Precision, typer.Option("--precision", help="fp32, or bf16 (autocast; weights stay fp32).")
]
CompileOpt = Annotated[
    bool,
    typer.Option(
        "--compile",
        help="Run each stage under torch.compile (its first step compiles; reported apart).",
    ),
]
BrokerOpt = Annotated[
    str | None,
    typer.Option("--broker", help="Broker URL; without it one is started (mosquitto, else amqtt)."),
]
PartitionOpt = Annotated[
    Partition,
    typer.Option(
        "--partition",
        help="plan (the planner decides, device groups included) or even (an even split over "
        "all devices, or --stages).",
    ),
]
StagesOpt = Annotated[
    int | None,
    typer.Option(
        "--stages",
        min=1,
        help="Exactly N stages: with plan, the planner's best plan of N stages; with even, "
        "the N fastest devices (the first always among them). Default: what --partition gives.",
    ),
]
ObjectiveOpt = Annotated[
    Objective,
    typer.Option(
        "--objective",
        help="What the planner minimises: time (the step) or energy (from the catalogue's "
        "datasheet power figures, a prediction; needs catalogue --devices).",
    ),
]
DeadlineOpt = Annotated[
    float | None,
    typer.Option("--deadline", help="Only plans whose predicted step takes at most S seconds."),
]
UnitTimesOpt = Annotated[
    str,
    typer.Option(
        "--unit-times",
        help="Where the planner's seconds of each unit come from: host (this machine's, "
        "scaled to each device by its matmul rate) or devices (each agent times the model's "
        "units itself before the plan, under its own limits: slower to start, closer on "
        "devices unlike this one).",
    ),
]
GroupSizesOpt = Annotated[
    str | None,
    typer.Option(
        "--group-sizes",
        help="With --partition even: devices per stage, e.g. 2,1,1 (adding up to --devices); "
        "a stage on several devices trains data-parallel, each on a share of every "
        "microbatch by its speed.",
    ),
]
HoldersOpt = Annotated[
    int,
    typer.Option(
        "--holders",
        min=0,
        help="Data that stays home: the first K agents each hold 1/K of the dataset "
        "(agent --data DATASET=DATASET:shard=i/K) and the job trains on their union; "
        "they are stage 0, and only activations leave them (--transport mqtt).",
    ),
]
LabelsOpt = Annotated[
    Labels,
    typer.Option(
        "--labels",
        help="With --holders: central (the last stage, on a helper, gets the labels) or "
        "local (the labels never leave the holders: they run the last units and the loss "
        "too, on their own samples; the plan is holders, helpers, holders).",
    ),
]
SaveWeightsOpt = Annotated[
    Path | None,
    typer.Option("--save-weights", help="Write the trained model here (safetensors)."),
]
ThreadsOpt = Annotated[
    int | None,
    typer.Option(
        "--threads",
        min=1,
        help="torch threads per agent (default: cores / devices). Equal counts give "
        "bit-identical results across runs with different numbers of devices.",
    ),
]
FaultOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--fault",
        help="Inject a fault: kill:STAGE[.MEMBER]@STEP (SIGKILL that stage's agent, or "
        "that member of its group, once it "
        "reports STEP). Repeatable; implies fault tolerance.",
    ),
]
ReplicateEveryOpt = Annotated[
    int | None,
    typer.Option(
        "--replicate-every",
        min=0,
        help="Fault tolerance: replicate every stage's state every R steps (0: off). "
        "Default: off, or with --fault chosen so replication costs at most 5% of a step and "
        "happens at least 10 times a job (coordinator/engine/rebalance.py). A failed device is "
        "replaced by re-planning over the rest.",
    ),
]
HeartbeatOpt = Annotated[
    float,
    typer.Option(
        "--heartbeat-timeout",
        min=0.1,
        help="Seconds without a heartbeat before a device "
        "is declared dead (its last will is quicker).",
    ),
]
RebalanceOpt = Annotated[
    bool,
    typer.Option(
        "--rebalance/--no-rebalance",
        help="Fault tolerance: migrate layers when measured "
        "stage times say another plan is over 10% faster and worth the move.",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object at the end.")]


def train_command(
    ctx: typer.Context,
    model: ModelOpt = "cnn-digits",
    dataset: DatasetOpt = None,
    option: OptionOpt = None,
    dataset_option: DatasetOptionOpt = None,
    devices_opt: DevicesOpt = "3",
    steps: StepsOpt = 50,
    batch_size: BatchSizeOpt = 64,
    microbatches: MicrobatchesOpt = "auto",
    schedule: ScheduleOpt = "1f1b",
    optimizer_name: OptimizerOpt = "sgd",
    lr: LrOpt = 0.05,
    momentum: MomentumOpt = 0.9,
    weight_decay: WeightDecayOpt = 0.0,
    diloco_every: DiLoCoOpt = None,
    outer_lr: OuterLrOpt = 0.7,
    outer_momentum: OuterMomentumOpt = 0.9,
    codec: CodecOpt = "fp32",
    seed: SeedOpt = 0,
    recv_timeout_s: RecvTimeoutOpt = 120.0,
    transport: TransportOpt = "mqtt",
    replicas: ReplicasOpt = 1,
    device: DeviceOpt = "cpu",
    servers: ServersOpt = 0,
    precision: PrecisionOpt = "fp32",
    compile_stages: CompileOpt = False,
    broker: BrokerOpt = None,
    partition: PartitionOpt = "plan",
    stages: StagesOpt = None,
    objective: ObjectiveOpt = "time",
    max_step_time_s: DeadlineOpt = None,
    unit_times: UnitTimesOpt = "host",
    group_sizes_opt: GroupSizesOpt = None,
    holders: HoldersOpt = 0,
    labels: LabelsOpt = "central",
    save_weights: SaveWeightsOpt = None,
    threads: ThreadsOpt = None,
    fault: FaultOpt = None,
    replicate_every: ReplicateEveryOpt = None,
    heartbeat_timeout_s: HeartbeatOpt = 3.0,
    rebalance: RebalanceOpt = True,
    json_out: JsonOpt = False,
) -> None:
    """Train MODEL split across N local devices over MQTT (or in-process threads)."""
    from coordinator.local.train import train_locally  # [Note: commands without torch]

    training = local_training(ctx.params)
    with _Progress(steps, batch_size, enabled=not json_out) as progress:
        run = train_locally(training, on_step=progress.update, note=progress.note)
    _output(run, transport, save_weights, json_out)


def local_training(flags: Mapping[str, Any]) -> LocalTraining:
    """The run the command's ``flags`` ask for (its parameters by name, as parsed).

    A parameter named as a field of the job (:class:`~coordinator.engine.spec.JobSpec`)
    or of the run (:class:`~coordinator.local.options.LocalTraining`) is that field (one
    that both have is the run's: ``replicate_every``, fault tolerance that the run
    decides); the others are translated here. So the job is built through its own type
    with no list of its fields, and a field without a flag is one that
    tests/unit/edgetrain/cli/test_job_fields.py lists with its reason.
    """
    from coordinator.engine.spec import JobSpec  # [Note: commands without torch]
    from coordinator.local.options import LocalTraining
    from edge.models.zoo import parse_options

    run_fields = LocalTraining.model_fields
    job = {n: flags[n] for n in JobSpec.model_fields if n in flags and n not in run_fields}
    job["model_options"] = parse_options(flags["option"] or [])
    if flags["dataset_option"]:
        job["dataset_options"] = parse_options(flags["dataset_option"])
    job["group_sizes"] = _group_sizes(flags["group_sizes_opt"])
    job["compile"] = flags["compile_stages"]
    job["optimizer"] = {
        "name": flags["optimizer_name"],
        "lr": flags["lr"],
        "momentum": flags["momentum"],
        "weight_decay": flags["weight_decay"],
    }
    if flags["diloco_every"] is not None:
        job["diloco"] = {
            "every": flags["diloco_every"],
            "outer_lr": flags["outer_lr"],
            "outer_momentum": flags["outer_momentum"],
        }
    run = {n: flags[n] for n in run_fields if n in flags}
    run |= _devices(flags["devices_opt"])
    run["faults"] = flags["fault"] or ()
    return _validated(LocalTraining, **run, spec=job)


def _validated(model: type[M], **values: Any) -> M:
    """``model(**values)``; a pydantic error as one line (its own checks' are one already)."""
    from pydantic import ValidationError

    from edge.errors import describe_validation_error

    try:
        return model(**values)
    except ValidationError as exc:
        raise UserError(describe_validation_error(exc, "train")) from None


def _output(run: LocalRun, transport: str, save_weights: Path | None, json_out: bool) -> None:
    """What the finished job leaves: its weights where asked, and one JSON object or two
    lines for a person."""
    result, score, broker = run.result, run.score, run.broker
    if save_weights is not None:
        try:
            write_atomic(save_weights, result.weights_bytes())
        except OSError as exc:
            why = exc.strerror or exc
            raise UserError(f"--save-weights {save_weights}: cannot write: {why}") from None
    if json_out:
        out = {
            "losses": result.losses,
            "samples_per_s": result.samples_per_s,
            "compile_s": result.compile_s,
            "plan": score.to_json(),
            "predicted": run.prediction.to_json() if run.prediction is not None else None,
            "transport": transport,
            "broker": broker,
            "job": result.job,
            "steps": result.spec.steps,
            "wall_s": result.wall_s,
            "stages": result.stage_summary(),
            **run.extra,
        }
        typer.echo(json.dumps(out))
        return
    typer.echo(
        f"job {result.job}: {result.spec.steps} steps, final loss {result.losses[-1]:.4f}, "
        f"{result.samples_per_s:.1f} samples/s over {len(score.plan.stages)} stages "
        f"({transport}{', ' + broker if broker else ''})"
    )
    guess = run.prediction or score
    typer.echo(
        f"predicted {guess.throughput_sps:.1f} samples/s; measured/predicted "
        f"{result.samples_per_s / guess.throughput_sps:.2f}"
    )


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


def _devices(text: str) -> dict[str, Any]:
    """``--devices``: a count, or catalogue profiles (their count, and their names)."""
    text = text.strip()
    if text.isdigit():
        if int(text) < 1:
            raise UserError(f"--devices: {text} is not a positive count")
        return {"devices": int(text), "profiles": None}
    names = tuple(n.strip() for n in text.split(","))
    if not all(names):
        raise UserError(f"--devices: {text!r} is not a count or a list of catalogue profiles")
    return {"devices": len(names), "profiles": names}


def _group_sizes(text: str | None) -> list[int] | None:
    """``--group-sizes 2,1,1``: devices per stage."""
    if text is None:
        return None
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise UserError(f"--group-sizes: {text!r} is not a list of positive counts like 2,1,1")
    return [int(p) for p in parts]
