"""Time to a target: DiLoCo's non-exact groups against the exact mode, on links that bind.

Four Raspberry Pi 4 (each at its catalogue GFLOP/s: the testbed's ``--scale`` from this
machine's measured single-core rate, as ``bench/hybrid.py``'s ``rpi4-4gb:4``), every one
on a 10 Mbit/s link. Two tasks, each trained in both modes, ``exact`` and
``diloco`` (``diloco: {every: H}``, :mod:`edge.runtime.outer_sync`):

- ``digits``: cnn-digits (width 64), batches of 128, AdamW at lr 0.003, to a held-out
  accuracy of 0.97 (the 360 test digits). Narrower or on smaller batches the model is
  too small for a link to bind: at width 32 and batches of 64 the exact job is planned
  on one Pi, whose step (0.16 s, measured) is mostly the runtime's own per-step work,
  and a DiLoCo group of four took as long a step (0.16 s: nothing to take back);
- ``text``: gpt-mini (d_model 64, two blocks of 32 tokens), batches of 64, AdamW at lr
  0.003, to a held-out loss of 2.4 nats a token (the text's test split).

For each task and mode the bench:

1. plans the job as the engine plans it (:func:`~coordinator.engine.engine.plan_over`,
   microbatches and schedule ``auto``) over the profiles the testbed's agents announce,
   each with its fixed costs and its per-byte cost timed through its own connection,
   and (``--unit-times devices``, the default, a job's ``unit_times: devices``) each
   device's own timing of the model's units;
2. finds the steps to the target on the independent loop of that plan: the exact mode
   equals single-device training, which ``tests/support/reference.py`` is, and a
   DiLoCo group equals ``tests/support/diloco.py`` (their parity tests hold each to
   1e-5). The weights are evaluated after every ``H``-th step: a DiLoCo job of that
   many steps ends on a sync, so these are the weights such a job ends with. The
   steps to the target are the first such step at which the metric reaches it;
3. runs that many steps on the testbed's agents (kernel limits: CPU quotas, tbf links)
   and takes the wall time from the first step's start to the last's end
   (:attr:`~coordinator.engine.monitor.JobResult.wall_s`). The run's own final weights
   are evaluated too: the row says whether they reach the target (the loops' parity
   is checked at 1e-5 over tens of steps, not hundreds, and rounding compounds).

The table gives each mode's plan, steps, wall seconds, seconds a step and the run's own
metric, and DiLoCo against exact in steps and in wall time. The issue's bar: on links
that bind, DiLoCo reaches the target sooner in wall time, within 1.3x of the exact
mode's steps.

    .venv/bin/python bench/diloco.py [--tasks digits,text] [--every 8]
        [--outer-lr 1.0] [--outer-momentum 0.0] [--method auto|kernel|software]
        [--unit-times devices|host]
        [--results bench/results/diloco.json] [--json] [--from-json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's packages
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # support.*: the loops

from support.diloco import train_diloco_reference
from support.reference import ReferenceRun, train_reference

from bench.siblings import sibling
from coordinator.engine.engine import PlannedJob, job_problem, plan_over
from coordinator.engine.options import RunOptions
from coordinator.engine.runners import run_on_agents
from coordinator.engine.spec import JobSpec
from coordinator.engine.unit_profiles import (
    time_units_on_devices,
    timing_request,
    whole_model_bytes,
)
from coordinator.local.demo import held_out
from coordinator.planner.build import parse_fleet
from coordinator.planner.predict import UnitSeconds
from coordinator.testbed.limits import METHODS, MethodChoice
from coordinator.testbed.testbed import Testbed, measure_core_gflops
from edge.models.zoo import get_model
from edge.problem import DeviceSpec
from edge.runtime.allocator import tune_malloc
from edge.transport.mqtt import MqttTransport
from edge.wire.groups import split_samples
from edgetrain.cli.signals import exit_on_sigterm

hybrid = sibling("hybrid")

ROOT = Path(__file__).resolve().parents[1]
LINK_MBPS = 10.0
"""Every device's link: slow enough that an exact group's sum binds."""
FLEET = "rpi4-4gb:4 at 10 Mbit/s"
MODES = ("exact", "diloco")


@dataclass(frozen=True)
class Task:
    """A model, its batches and optimizer, and the held-out target it trains to."""

    name: str
    model: str
    model_options: dict[str, Any]
    batch_size: int
    optimizer: dict[str, Any]
    metric: str
    """``accuracy`` (reached at or above ``target``) or ``loss`` (at or below)."""
    target: float
    most_steps: int
    """The independent loops stop here; a mode that has not reached the target by
    then is reported as not reaching it."""

    def reached(self, value: float) -> bool:
        return value >= self.target if self.metric == "accuracy" else value <= self.target


ADAMW = {"name": "adamw", "lr": 0.003}
TASKS = {
    "digits": Task("digits", "cnn-digits", {"width": 64}, 128, ADAMW, "accuracy", 0.97, 480),
    "text": Task(
        "text",
        "gpt-mini",
        {"d_model": 64, "n_layer": 2, "block_size": 32},
        64,
        ADAMW,
        "loss",
        2.4,
        480,
    ),
}


@dataclass
class Row:
    task: str
    mode: str
    model: str
    metric: str
    target: float
    plan: str
    """Devices per stage and the units each holds, e.g. ``4[0:4]``."""
    method: str
    """How the engine chose the plan (its ``found.method``)."""
    microbatches: int
    schedule: str
    predicted_step_s: float
    steps: int | None
    """Steps to the target on the independent loop (``None``: not within ``most_steps``)."""
    curve: list[list[float]]
    """The loop's ``[step, metric]`` after every ``every``-th step."""
    wall_s: float | None = None
    """The testbed run of ``steps`` steps: first step's start to last step's end."""
    run_metric: float | None = None
    """The run's own final weights, evaluated as the loop's."""
    every: int = 0
    outer_lr: float = 0.0
    outer_momentum: float = 0.0
    unit_times: str = "host"
    """What priced the plan: this machine's unit timings, or the devices' own."""

    @property
    def step_s(self) -> float | None:
        return None if self.wall_s is None or not self.steps else self.wall_s / self.steps


# -- the independent loops -------------------------------------------------------------


def evaluate(task: Task, weights: Mapping[str, torch.Tensor]) -> float:
    """The held-out metric of ``weights``: accuracy, or the mean loss a token (a sample)
    (:func:`~coordinator.local.demo.held_out`)."""
    accuracy, loss = held_out(get_model(task.model, **task.model_options), weights)
    return accuracy if task.metric == "accuracy" else loss


def reference(task: Task, planned: PlannedJob, mode: str, args: argparse.Namespace) -> ReferenceRun:
    """The independent loop of ``planned`` for ``task``, weights kept every ``--every`` steps."""
    m = planned.problem.microbatches
    common = {
        "steps": task.most_steps,
        "batch_size": task.batch_size,
        "optimizer": task.optimizer,
        "model_options": task.model_options,
        "microbatches": m,
        "snapshot_every": args.every,
    }
    if mode == "exact" or not planned.plan.grouped:
        return train_reference(task.model, **common)
    groups = [st for st in planned.plan.stages if len(st.devices) > 1]
    if len(groups) != 1:
        raise SystemExit(
            f"{task.name}: the DiLoCo loop holds one group, the plan has {len(groups)}"
        )
    (group,) = groups
    shares = planned.score.shares[planned.plan.stages.index(group)]
    rows = split_samples(task.batch_size // m, shares)
    return train_diloco_reference(
        task.model,
        group=(group.start, group.end),
        rows=rows,
        diloco=_diloco(args),
        **common,
    )


def curve(task: Task, run: ReferenceRun) -> tuple[list[list[float]], int | None]:
    """Each kept step's metric, and the first step that reached the target."""
    points = [[float(step), evaluate(task, w)] for step, w in sorted(run.snapshots.items())]
    first = next((int(step) for step, value in points if task.reached(value)), None)
    return points, first


def _diloco(args: argparse.Namespace) -> dict[str, Any]:
    return {"every": args.every, "outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum}


# -- the fleet ---------------------------------------------------------------------------


def fleet_devices() -> list[DeviceSpec]:
    """Four Pi 4 from the catalogue, each on a :data:`LINK_MBPS` link."""
    return [d.model_copy(update={"bandwidth_mbps": LINK_MBPS}) for d in parse_fleet("rpi4-4gb:4")]


def job_spec(task: Task, mode: str, args: argparse.Namespace, steps: int = 1) -> JobSpec:
    return JobSpec(
        model=task.model,
        model_options=task.model_options,
        steps=steps,
        batch_size=task.batch_size,
        microbatches="auto",
        schedule="auto",
        optimizer=task.optimizer,
        diloco=_diloco(args) if mode == "diloco" else None,
        seed=0,
    )


def run_task(
    tb: Testbed,
    control: MqttTransport,
    announced: dict[str, DeviceSpec],
    task: Task,
    args: argparse.Namespace,
) -> list[Row]:
    """Both modes of ``task``: planned, traced on the independent loop, run on the fleet."""
    rows = []
    devices = list(announced.values())
    own = (
        own_units(control, devices, job_spec(task, "exact", args))
        if args.unit_times == "devices"
        else None
    )
    for mode in MODES:
        planned = plan_over(job_spec(task, mode, args), devices, device_units=own)
        started = time.perf_counter()
        points, steps = curve(task, reference(task, planned, mode, args))
        prediction = planned.found.prediction
        row = Row(
            task.name,
            mode,
            task.model,
            task.metric,
            task.target,
            "+".join(f"{len(st.devices)}[{st.start}:{st.end}]" for st in planned.plan.stages),
            planned.found.method,
            planned.problem.microbatches,
            planned.schedule,
            math.nan if prediction is None else prediction.step_time_s,
            steps,
            points,
            every=args.every,
            outer_lr=args.outer_lr,
            outer_momentum=args.outer_momentum,
            unit_times=args.unit_times if own else "host",
        )
        print(
            f"# {task.name} {mode} [{row.plan}] at {row.microbatches} microbatches, "
            f"{row.schedule}: the loop reaches {task.metric} {task.target} at step {steps} "
            f"({time.perf_counter() - started:.0f} s)",
            file=sys.stderr,
        )
        if steps is not None:
            spec = planned.resolve(job_spec(task, mode, args, steps))
            result = run_on_agents(
                spec,
                planned.plan,
                control,
                shares=planned.shares,
                options=RunOptions(timeout_s=3600, access=tb.accounts),
            )
            row.wall_s = result.wall_s
            row.run_metric = evaluate(task, result.weights)
            print(
                f"# {task.name} {mode}: {steps} steps in {row.wall_s:.1f} s, the run's "
                f"{task.metric} {row.run_metric:.3f}",
                file=sys.stderr,
            )
        rows.append(row)
    return rows


def own_units(
    control: MqttTransport, devices: list[DeviceSpec], spec: JobSpec
) -> dict[str, UnitSeconds]:
    """Each device's own unit seconds for ``spec``'s model and shape, timed by its agent
    (:mod:`coordinator.engine.unit_profiles`), as a job of ``unit_times: devices`` gets
    them; the devices too small for the whole model (or too slow) are left to this
    machine's timings."""
    needs = whole_model_bytes(job_problem(spec, devices))
    got = time_units_on_devices(
        control, devices, timing_request(spec), timeout_s=900, needs_bytes=needs
    )
    print(
        f"# {spec.model}: {len(got.seconds)} of {len(devices)} devices timed the units "
        f"({got.took_s:.0f} s)",
        file=sys.stderr,
    )
    return got.seconds


# -- reporting ---------------------------------------------------------------------------


def to_json(rows: list[Row]) -> list[dict[str, Any]]:
    return [asdict(r) | {"step_s": r.step_s} for r in rows]


def from_json(items: list[dict[str, Any]]) -> list[Row]:
    return [Row(**{k: v for k, v in it.items() if k != "step_s"}) for it in items]


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(rows: list[Row]) -> str:
    """Each mode's row, then DiLoCo against exact per task (steps and wall time)."""
    lines = [
        "| task | mode | plan | microbatches | schedule | target | steps to target "
        "| wall s | s a step | predicted s a step | the run's own |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mode = r.mode if r.mode == "exact" else f"diloco (every {r.every}, non-exact)"
        lines.append(
            f"| {r.task} | {mode} | {r.plan} | {r.microbatches} | {r.schedule} "
            f"| {r.metric} {'≥' if r.metric == 'accuracy' else '≤'} {r.target} "
            f"| {_num(r.steps, 'd')} | {_num(r.wall_s, '.1f')} | {_num(r.step_s, '.3f')} "
            f"| {r.predicted_step_s:.3f} | {_num(r.run_metric, '.3f')} |"
        )
    lines += ["", "| task | DiLoCo / exact, steps | DiLoCo / exact, wall time |", "|---|---|---|"]
    for task in dict.fromkeys(r.task for r in rows):
        by = {r.mode: r for r in rows if r.task == task}
        if set(by) != set(MODES):
            continue
        exact, dl = by["exact"], by["diloco"]
        steps = dl.steps / exact.steps if dl.steps and exact.steps else None
        wall = dl.wall_s / exact.wall_s if dl.wall_s and exact.wall_s else None
        lines.append(f"| {task} | {_num(steps, '.2f')} | {_num(wall, '.2f')} |")
    return "\n".join(lines)


# -- command line ------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default=",".join(TASKS), help=", ".join(TASKS))
    parser.add_argument("--every", type=int, default=8, help="DiLoCo's H: steps between syncs")
    parser.add_argument("--outer-lr", type=float, default=1.0)
    parser.add_argument("--outer-momentum", type=float, default=0.0)
    parser.add_argument("--method", choices=METHODS, default="auto")
    parser.add_argument(
        "--unit-times",
        choices=["devices", "host"],
        default="devices",
        help="price plans by the devices' own unit timings (a job's unit_times) or this host's",
    )
    parser.add_argument("--results", type=Path, default=ROOT / "bench/results/diloco.json")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--from-json", type=Path, help="render a results file; run nothing")
    args = parser.parse_args(argv)
    unknown = [t for t in args.tasks.split(",") if t not in TASKS]
    if unknown:
        parser.error(f"--tasks: unknown {', '.join(unknown)} (one of {', '.join(TASKS)})")
    if args.every < 1:
        parser.error(f"--every {args.every}: a sync every 1 step or more")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json is not None:
        rows = from_json(json.loads(args.from_json.read_text()))
    else:
        tune_malloc()  # as the agents do
        tasks = [TASKS[t] for t in args.tasks.split(",")]
        method: MethodChoice = args.method
        scale = hybrid.catalogue_scale(measure_core_gflops(1.0))

        def work(
            tb: Testbed,
            control: MqttTransport,
            devices: list[DeviceSpec],
            announced: dict[str, DeviceSpec],
            fleet: str,
            name: str,
        ) -> list[Row]:
            return run_task(tb, control, announced, TASKS[name], args)

        names = [t.name for t in tasks]
        rows = hybrid.on_devices(fleet_devices(), FLEET, scale, names, method, work)
        args.results.write_text(json.dumps(to_json(rows), indent=2) + "\n")
    if args.json:
        print(json.dumps(to_json(rows), indent=2))
        return 0
    print(f"fleet: {FLEET}; results: {args.results}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    exit_on_sigterm()  # a stopped run stops the broker and agents it started
    sys.exit(main())
