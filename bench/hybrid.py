"""What device groups are worth: hybrid pipeline + data parallel plans on emulated fleets.

Each fleet runs on the testbed (:mod:`coordinator.testbed`, its scalar method where
the kernel's limits work, else software: ``--method``; a device without a scalar
score runs all its code at its FLOP share there) and trains each model for a few
steps under five plans, one after another on the same fleet:

- ``single``: the best single device alone;
- ``even``: every device, the same number of units each (one device a stage);
- ``v1``: the plan a version 1 job gets (pipeline only: one device a stage;
  :func:`~coordinator.planner.partition.plan_job` on the problem as version 1, with
  the measured unit times: cut where the units' seconds balance);
- ``data-parallel``: the best single group (the ``k`` fastest devices training the
  whole model data-parallel, each on its share of every microbatch);
- ``v2``: the plan a version 2 job gets (``shared/spec/planning-v2.md``: stages on
  device groups, hybrid), within what the runtime can train (no BatchNorm in a
  group, a sample or more per member): :func:`~coordinator.planner.partition.plan_job`
  with the same unit times, the plan the internal model predicts fastest among the
  timed search's, the spec's and v1's, so never predicted slower than v1.

With ``--repeat N`` the same plans run ``N`` times, the strategies in turn (so a
drift of this host's speed over minutes falls on each alike), each run priced by its
own calibration; a row is its median pass, and the table gives v2/v1 for each pass
and their medians.

Each plan runs under ``--schedule``: ``auto``, the default, takes the fastest schedule
its devices hold, as a job's ``"auto"`` does
(:func:`~coordinator.planner.simulator.fastest_schedule`), and its prediction is moved to
that schedule (:func:`~coordinator.planner.predict.under_schedule`). Rows before
2026-12-06 ran 1F1B.

v1 and v2 are chosen and priced with the same unit times. A plan that is an earlier
row's plan stage for stage (v2 is often v1's) is not run again: its row is that
run's, marked ``same_as`` (``v2 (= v1)`` in the table).

For each: measured samples/s (steady state: stage 0's step times after
``--warmup`` steps), the predicted samples/s (the planner's internal model,
:func:`coordinator.planner.predict.predict`: the version 2 score of that plan with
each unit's measured seconds, a group member at its share of the rows with the
part of each unit's time that does not shrink with rows (units timed at a whole
microbatch and at a quarter of it; with ``--unit-times devices``, the default, by
each device's own agent under its own CPU quota just before each run:
:func:`own_unit_seconds`, [Note: a device's own unit seconds] in
:mod:`coordinator.engine.unit_profiles`), plus each device's fixed costs per microbatch,
step, frame and byte, as its agent announced them: the per-byte cost timed
through its own connection and the broker),
measured / predicted, and both as a fraction of the **ideal bound**: the fleet's
summed capacity, every device training the whole model at its own speed with
nothing to communicate (``sum(gflops) / FLOPs per sample``).

Fleets:

- ``rpi4-4gb:4``: four Raspberry Pi 4 on their catalogue links, each emulated at its
  catalogue GFLOP/s (the testbed's ``--scale`` computed from this machine's
  measured single-core GFLOP/s: about a tenth of a core each);
- ``2 fast + 4 slow``: two devices of ``FASTEST_GFLOPS`` and four a tenth of that,
  on the links of ``bench/heterogeneity.py``;
- ``3x``, ``10x``, ``30x``: the fleets of ``bench/heterogeneity.py`` (four devices
  spanning that much compute geometrically).

The problem is calibrated as in ``bench/heterogeneity.py`` (measured unit times x
this machine's single-core rate), whose helpers this script uses; the unit times
are CPU seconds of one thread (:func:`calibrate`), which other work on this host
does not stretch, as it does not stretch what the agents' CPU quotas allow them. The testbed's
devices announce this machine's fixed costs scaled by their share of a core, and
their agents replace the per-byte cost by their own measurement; the problem's
devices are the profiles the agents announced.

    .venv/bin/python bench/hybrid.py [--models vgg11,resnet18,gpt-mini]
        [--fleets rpi4,2fast4slow,3x,10x,30x] [--strategies single,even,v1,data-parallel,v2]
        [--batch-size 64] [--microbatches auto|N] [--schedule auto|1f1b|gpipe|zb-h1]
        [--method auto|kernel|scalar|software] [--json]
        [--results bench/results/hybrid.json] [--chart bench/results/hybrid.png]
        [--from-json FILE] [--quick] [--predict-shapes 32x4,64xauto,...] [--repeat N]
        [--unit-times devices|host]

``--quick`` runs one fleet (``rpi4-4gb:4``), one model (``vgg11``, batches of 16)
and two steps a plan (one of them warm-up), and writes its JSON and chart to the temporary directory
unless ``--results``/``--chart`` say otherwise. ``--from-json`` runs nothing: it
renders the table, the chart and the JSON again from a results file.
``--microbatches auto``, the default, runs each plan at the number of microbatches a
job's ``"auto"`` takes: v1 and v2 are planned with it, as the engine plans
(:func:`plan_job_microbatches`), and the fixed plans (single, even, data parallel) run at
their best number for that plan (:func:`best_microbatches`); the units are timed at 4
and moved along their fitted lines, and each run is priced at its own shape. The row's
``batch`` says which (``64x8``). Rows before 2026-12-07 ran 4.

The default batch, 64 samples (in 4 microbatches then, 16 rows each), was chosen from
``--predict-shapes`` on ``rpi4-4gb:4`` (one calibration a shape; 2026-12-02): a
group's sum is paid once a step and a member's fixed costs once a microbatch, so
groups gain with the rows per microbatch, and a pipeline with the microbatches.
Predicted v2/v1 (vgg11, resnet18, gpt-mini): 32x4 1.02, 1.18, 1.21; 64x4 1.07,
1.30, 1.46; 128x8 1.00, 1.16, 1.11; 128x4 1.15, 1.43, 1.63. 128x4 is v2's best
throughput, but its steps (a minute for resnet18 on one Pi) take a whole run past
12 minutes per model; 64x4 keeps each fleet and model within that.
``--predict-shapes`` runs no plan either: it brings each fleet up for its agents'
profiles, and for each model and batch shape calibrates once and prints (and writes,
to ``bench/results/hybrid-shapes.json``) every strategy's predicted samples/s under
``--schedule``, v2 against v1, v2's fraction of the ideal and the part of its step the
anatomy says costs most. A shape ``64xauto`` predicts each strategy at the
microbatches ``--microbatches auto`` would run it at.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's packages

from bench.siblings import sibling
from coordinator.engine.assignments import microbatch_choices_of
from coordinator.engine.engine import group_limits
from coordinator.engine.options import JobAccess, RunOptions
from coordinator.engine.runners import run_on_agents
from coordinator.engine.spec import JobSpec
from coordinator.engine.unit_profiles import (
    time_units_on_devices,
    timing_request,
    whole_model_bytes,
)
from coordinator.engine.watch import DeviceFeed
from coordinator.planner.anatomy import AnatomyMeter, StepTerms, anatomy
from coordinator.planner.baselines import even_split, single_device
from coordinator.planner.build import parse_fleet
from coordinator.planner.group_search import data_parallel_only
from coordinator.planner.group_tables import GroupLimits
from coordinator.planner.microbatches import (
    FIRST_MICROBATCHES,
    best_microbatches,
    first_microbatches,
)
from coordinator.planner.partition import plan_job, plan_job_microbatches, scored
from coordinator.planner.predict import (
    Prediction,
    UnitSeconds,
    balanced_shares,
    fit_unit_seconds,
    predict,
    small_rows,
    under_schedule,
)
from coordinator.planner.score import Plan, for_plan, score_plan
from coordinator.planner.simulator import fastest_schedule
from coordinator.testbed.limits import METHODS, MethodChoice, most_faithful
from coordinator.testbed.testbed import StartOptions, Testbed, measure_core_gflops
from edge.config import Schedule
from edge.errors import UserError
from edge.models.zoo import get_model
from edge.problem import DeviceSpec, PlanningProblem
from edge.profiling.fixed_costs import cpu_quota_of
from edge.runtime.allocator import tune_malloc
from edge.runtime.unit_times import Timing, measure_unit_times
from edge.transport.mqtt import MqttTransport
from edge.wire.groups import sum_waits
from edge.wire.messages import StepReport
from edgetrain.cli.signals import exit_on_sigterm

hetero = sibling("heterogeneity")
anatomies = sibling("anatomy")

STRATEGIES = ("single", "even", "v1", "data-parallel", "v2")
FLEETS = ("rpi4", "2fast4slow", "3x", "10x", "30x")
"""Fleet keys for ``--fleets``, in the order they run."""
FLEET_NAMES = {"rpi4": "rpi4-4gb:4", "2fast4slow": "2 fast + 4 slow"}
SLOW_FACTOR = 10.0
"""How many times slower than the fast devices the slow ones of ``2fast4slow`` are."""
CATALOGUE_PI = "rpi4-4gb"


@dataclass
class Row:
    model: str
    fleet: str
    strategy: str
    stages: list[dict[str, Any]]
    """The plan's stages (``plan.to_json`` with each stage's devices and shares)."""
    predicted_sps: float
    measured_sps: float
    ideal_sps: float
    """The fleet's summed capacity for this model: every device alone, nothing sent."""
    steps: int
    method: str
    compute_s: list[float]
    """Per stage, measured compute seconds per steady step (the mean over a group's members)."""
    predicted_compute_s: list[float]
    """Per stage, the plan's ``M x T_s``."""
    allreduce_s: list[float]
    """Per stage, measured seconds a step summing a group's gradients (0 for one device)."""
    predicted_allreduce_s: list[float]
    """Per stage, the plan's ``R_s``."""
    allreduce_wait_s: list[float] = field(default_factory=list)
    """Per stage, the part of ``allreduce_s`` a member waited for the group's last member
    to start its sum (:func:`~edge.wire.groups.sum_waits`); the rest is the transfer."""
    allreduce_cpu_s: list[float] = field(default_factory=list)
    """Per stage, CPU seconds a member's process spent in a step's sum."""
    same_as: str | None = None
    """The strategy whose plan this one is, stage for stage, when it ran first: this row
    is that run's measurement (one run, two rows), not a run of its own."""
    batch: str = ""
    """The step's shape, samples x microbatches (``64x4``)."""
    unit_times: str = "host"
    """Where the prediction's unit seconds came from: ``host`` (this machine's, scaled by
    each device's matmul rate) or ``devices`` (each device's own, ``--unit-times``)."""
    repeats: list[list[float]] = field(default_factory=list)
    """With ``--repeat``: each pass's measured and predicted samples/s, in pass order; the
    row is the pass whose measured samples/s is the median (:func:`median_rows`)."""
    anatomy: dict[str, Any] | None = None
    """Where the plan's step goes, member by member, as the cost model predicts it
    (:func:`coordinator.planner.anatomy.anatomy` over :func:`predict`'s terms)."""
    measured_anatomy: dict[str, Any] | None = None
    """The same parts as the run's step reports measured them (the steady steps' mean):
    ``bench/anatomy.py`` sums them over the fleet."""
    schedule: str = "1f1b"
    """The schedule the plan ran (``--schedule``; ``auto``: the fastest its devices hold,
    as a job's ``"auto"`` takes it, :func:`~coordinator.planner.simulator.fastest_schedule`)."""

    @property
    def ratio(self) -> float:
        """Measured / predicted."""
        return self.measured_sps / self.predicted_sps if self.predicted_sps > 0 else math.nan

    @property
    def fraction(self) -> float:
        """Measured samples/s as a fraction of the ideal bound."""
        return self.measured_sps / self.ideal_sps

    @property
    def predicted_fraction(self) -> float:
        return self.predicted_sps / self.ideal_sps

    @property
    def label(self) -> str:
        """The strategy, and the one whose run it shares (``v2 (= v1)``)."""
        return self.strategy if self.same_as is None else f"{self.strategy} (= {self.same_as})"

    @property
    def shape(self) -> str:
        """Devices per stage, e.g. ``2+1+1`` (one stage of four: ``4``)."""
        return "+".join(str(len(st["devices"])) for st in self.stages)


DERIVED = ("ratio", "fraction", "predicted_fraction", "shape")
"""Keys of a JSON row that :func:`to_json` computes from the others."""


def to_json(rows: list[Row]) -> list[dict[str, Any]]:
    """The rows as the results file holds them: every field, then the derived ones."""
    return [asdict(r) | {k: getattr(r, k) for k in DERIVED} for r in rows]


def from_json(items: list[dict[str, Any]]) -> list[Row]:
    return [Row(**{k: v for k, v in item.items() if k not in DERIVED}) for item in items]


# -- fleets and plans -----------------------------------------------------------------


def catalogue_scale(core_gflops: float, profile: str = CATALOGUE_PI) -> float:
    """The testbed ``scale`` (cores for the fastest device) that gives a fleet of
    ``profile`` devices its catalogue GFLOP/s on a machine of ``core_gflops`` a core."""
    return parse_fleet(profile)[0].gflops / core_gflops


def fleet_devices(key: str) -> list[DeviceSpec]:
    """The devices of fleet ``key`` (:data:`FLEETS`), fastest first."""
    if key == "rpi4":
        return parse_fleet(f"{CATALOGUE_PI}:4")
    if key == "2fast4slow":
        fast = hetero.fleet_devices(1.0)[0]
        slow = fast.model_copy(update={"gflops": fast.gflops / SLOW_FACTOR})
        return [fast.model_copy(update={"id": f"fast{i}"}) for i in range(2)] + [
            slow.model_copy(update={"id": f"slow{i}"}) for i in range(4)
        ]
    if key.endswith("x"):
        return list(hetero.fleet_devices(float(key[:-1])))
    raise SystemExit(f"--fleets: unknown fleet {key!r} (one of {', '.join(FLEETS)})")


def fleet_name(key: str) -> str:
    return FLEET_NAMES.get(key, key)


def ideal_sps(problem: PlanningProblem) -> float:
    """The ideal bound: the devices' summed GFLOP/s over the model's FLOPs per sample."""
    flops = sum(u.train_flops for u in problem.layers)
    return sum(d.gflops for d in problem.devices) * 1e9 / flops


def plans(
    problem: PlanningProblem, limits: GroupLimits, units: UnitSeconds | None = None
) -> dict[str, Plan]:
    """Every strategy's plan for a version 2 ``problem``; data parallel only is missing
    where no group holds the whole model. ``v1`` and ``v2`` are the plans a job gets
    (:func:`plan_job`, with the same ``units``) over ``problem`` as version 1 and as
    version 2: the internal model chooses among the searches' plans, the version 1
    job's plan among them for version 2 ([Note: a job's plan by prediction] in
    :mod:`coordinator.planner.partition`)."""
    one = problem.as_version(1)
    try:
        v1 = plan_job(one, units=units).plan
        v2 = plan_job(problem, limits=limits, units=units).plan
    except UserError as exc:
        raise SystemExit(f"the planner found no feasible plan for this fleet: {exc}") from None
    out = {"single": single_device(one), "even": even_split(one), "v1": v1}
    group = data_parallel_only(problem, limits)
    if group is not None:
        out["data-parallel"] = group
    out["v2"] = v2
    return out


def calibrate(
    model: str, batch_size: int, microbatches: int, core_gflops: float, steps: int
) -> tuple[list[Any], UnitSeconds]:
    """The model's calibrated layers (:func:`hetero.calibrated_layers`) and its
    :class:`UnitSeconds` at ``core_gflops``, from one thread's unit times (its CPU
    seconds) at a whole microbatch and at :func:`small_rows` of its rows
    (:func:`fit_unit_seconds`)."""
    spec = get_model(model)
    rows = batch_size // microbatches
    few = small_rows(rows)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # CPU seconds of this one thread: other work on this host does not inflate them,
        # and each agent gets its quota's share of a core whatever the host's load.
        timing = Timing(steps=steps, warmup=1, clock=time.thread_time)
        timed = functools.partial(measure_unit_times, timing=timing)
        full = timed(spec, batch_size, microbatches)
        small = timed(spec, few * microbatches, microbatches) if few < rows else None
    finally:
        torch.set_num_threads(threads)
    layers = hetero.calibrated_layers(
        model, batch_size, microbatches, core_gflops, steps, times=full
    )
    return layers, fit_unit_seconds(full, small, rows, few, core_gflops)


def agent_profiles(
    control: MqttTransport, fallback: dict[str, DeviceSpec], timeout_s: float = 120.0
) -> dict[str, DeviceSpec]:
    """The profiles the agents of ``fallback``'s devices announced, once each carries its
    per-byte cost timed through its own connection; a device whose profile did not come
    in time keeps ``fallback``'s (said on stderr)."""
    got: dict[str, DeviceSpec] = {}
    done = threading.Condition()

    def on_profile(device: str, spec: DeviceSpec) -> None:
        if device in fallback and "transport_byte_ms_per_mib" in (spec.details or {}):
            with done:
                got[device] = spec
                done.notify_all()

    with DeviceFeed(control, on_profile=on_profile), done:
        done.wait_for(lambda: set(got) >= set(fallback), timeout_s)
    for device in sorted(set(fallback) - set(got)):
        print(f"# {device}: no measured transport cost announced; the testbed's", file=sys.stderr)
    return {d: got.get(d, spec) for d, spec in fallback.items()}


# -- running --------------------------------------------------------------------------

Work = Callable[
    [Testbed, MqttTransport, list[DeviceSpec], dict[str, DeviceSpec], str, str], list[Any]
]
"""What :func:`on_fleet` does per model: (testbed, control, devices, announced profiles,
fleet name, model) to results."""


@dataclass
class Measured:
    sps: float
    """Steady-state samples/s: stage 0's step times after the warm-up steps."""
    compute_s: list[float]
    allreduce_s: list[float]
    allreduce_wait_s: list[float]
    allreduce_cpu_s: list[float]
    bytes_per_sample: float
    """Bytes every device sent in the steady steps (``StepReport.bytes_sent``: frames that
    crossed the wire, a group's sums included) per sample trained."""
    anatomy: dict[str, Any] | None = None
    """Where the steady steps went, member by member (``Anatomy.to_json``), mean."""
    window: tuple[float, float] = (0.0, 0.0)
    """When the steady steps ran (Unix seconds): stage 0's first steady step's start and
    its last step's end."""


def measure(
    control: MqttTransport,
    spec: JobSpec,
    plan: Plan,
    warmup: int,
    access: JobAccess | None,
    shares: list[list[float]] | None,
) -> Measured:
    """Run ``plan`` on the agents behind ``control`` (``access``: the broker's accounts,
    which grant the job its topics; the testbed's, say); per stage, the means over its
    members and the steps after ``warmup`` (a group's members split each microbatch by
    ``shares``)."""
    # A stage at a few hundredths of a core (the kernel method's Pi) takes minutes to
    # build: its imports and data at the FLOP share.
    options = RunOptions(timeout_s=1800, ready_timeout_s=600, access=access)
    result = run_on_agents(spec, plan, control, shares=shares, options=options)
    steady = [r for r in result.reports if r.step >= warmup]
    meter = AnatomyMeter(sum(len(st.devices) for st in plan.stages), warmup=0)
    for r in sorted(steady, key=lambda r: r.step):
        meter.add(r)
    meter.finish()  # the last step too, by its own step time
    measured = meter.mean()

    def per_stage(field: str) -> list[float]:
        return [
            statistics.mean(getattr(r, field) for r in steady if r.stage == s)
            for s in range(len(plan.stages))
        ]

    step_s = statistics.mean(r.step_s for r in steady if r.stage == 0)
    first = [r for r in steady if r.stage == 0]
    window = (
        min(r.started_at for r in first),
        max(r.started_at + r.step_s for r in first),
    )
    grouped = [r for r in steady if len(plan.stages[r.stage].devices) > 1]
    if grouped:  # a group's members one by one: who the others wait for
        print(f"# members of {plan}: {_members(grouped)}", file=sys.stderr)
    sent = sum(r.bytes_sent for r in steady) / (spec.batch_size * (spec.steps - warmup))
    waits = [_mean_wait([r for r in steady if r.stage == s]) for s in range(len(plan.stages))]
    return Measured(
        spec.batch_size / step_s,
        per_stage("compute_s"),
        per_stage("allreduce_s"),
        waits,
        per_stage("allreduce_cpu_s"),
        sent,
        None if measured is None else {**measured.to_json(), "steps": meter.steps},
        window,
    )


def _members(reports: list[StepReport]) -> str:
    """Each group member's samples and mean compute seconds a step, as ``stage/device``."""
    out = []
    for stage, member, device in sorted({(r.stage, r.member, r.device) for r in reports}):
        mine = [r for r in reports if (r.stage, r.member) == (stage, member)]
        compute = statistics.mean(r.compute_s for r in mine)
        out.append(f"{stage}/{device} {mine[-1].samples} samples {compute:.3f} s")
    return ", ".join(out)


def _mean_wait(reports: list[StepReport]) -> float:
    """The mean over one stage's members and steps of a member's wait in the sum for the
    last member to start its own (0 for a stage of one device)."""
    waits: list[float] = []
    for step in sorted({r.step for r in reports}):
        started = [r.allreduce_started for r in reports if r.step == step]
        if len(started) > 1 and min(started) > 0:
            waits += sum_waits(started)
    return statistics.mean(waits) if waits else 0.0


def on_fleet(key: str, models: list[str], method: MethodChoice, work: Work) -> list[Any]:
    """Bring fleet ``key`` up on the testbed, read the profiles its agents announce, and
    do ``work`` for each model there (``method``: the testbed's, ``--method``); what
    ``work`` returned, in order."""
    devices = fleet_devices(key)
    scale = catalogue_scale(measure_core_gflops(1.0)) if key == "rpi4" else None
    return on_devices(devices, fleet_name(key), scale, models, method, work)


def on_devices(
    devices: list[DeviceSpec],
    name: str,
    scale: float | None,
    models: list[str],
    method: MethodChoice,
    work: Work,
) -> list[Any]:
    """:func:`on_fleet` for the fleet ``devices``, called ``name``, at the testbed's
    ``scale`` (``None``: its own)."""
    out: list[Any] = []
    with (
        tempfile.TemporaryDirectory(prefix="edgetrain-hybrid-") as state,
        Testbed.up(
            devices,
            scale=scale,
            state_dir=Path(state),
            start=StartOptions(method=method, coordinator=False),
        ) as tb,
    ):
        print(f"# fleet {name}: limits {tb.method} ({tb.method_reason})", file=sys.stderr)
        control = MqttTransport(tb.login())
        control.connect(30)
        try:
            announced = agent_profiles(control, dict(tb.announced))
            for d in devices:
                details = announced[d.id].details or {}
                print(
                    f"# {d.id}: fixed costs {details.get('fixed_costs', {})}, "
                    f"{details.get('cpus')} cores",
                    file=sys.stderr,
                )
            for model in models:
                out += work(tb, control, devices, announced, name, model)
        finally:
            control.close()
    return out


def _run_model(
    tb: Testbed,
    control: MqttTransport,
    devices: list[DeviceSpec],
    announced: dict[str, DeviceSpec],
    fleet: str,
    model: str,
    args: argparse.Namespace,
) -> list[Row]:
    timed_at = FIRST_MICROBATCHES if args.microbatches == "auto" else args.microbatches
    spec = JobSpec(model=model, steps=1, batch_size=args.batch_size, microbatches=timed_at, seed=0)

    def problem(
        steps: int, among: Plan | None = None, microbatches: int = timed_at
    ) -> tuple[PlanningProblem, UnitSeconds]:
        now, units = fleet_problem(
            model, args.batch_size, microbatches, devices, announced, tb.core_gflops, steps
        )
        if args.unit_times == "devices":
            at = spec.model_copy(update={"microbatches": microbatches})
            units = replace(units, devices=retime(now, among, at))
        return now, units

    def retime(
        now: PlanningProblem, among: Plan | None = None, at: JobSpec = spec
    ) -> dict[str, UnitSeconds]:
        """Every device's own unit seconds at ``at``'s shape, or only those of ``among``'s
        devices (what pricing that plan needs: the slowest device of 30x times vgg11 for
        a minute)."""
        used = devices if among is None else [d for d in devices if d.id in among.devices]
        return own_unit_seconds(control, used, announced, at, whole_model_bytes(now))

    limits = group_limits(spec)
    assert limits is not None  # a zoo model
    first, first_units = problem(args.calibration_steps)
    chosen = {s: Shaped(p, timed_at) for s, p in plans(first, limits, first_units).items()}
    if args.microbatches == "auto":
        chosen = auto_microbatches(first, limits, first_units, chosen, microbatch_choices_of(spec))
        print(
            f"# {model} {fleet}: microbatches "
            + ", ".join(f"{s} {c.microbatches}" for s, c in chosen.items()),
            file=sys.stderr,
        )
    passes = []
    for n in range(args.repeat):
        if args.repeat > 1:
            print(f"# {model} {fleet}: pass {n + 1} of {args.repeat}", file=sys.stderr)
        passes.append(
            _run_plans(
                tb, control, fleet, spec, args, chosen, problem, (first, first_units), retime
            )
        )
    return median_rows(passes)


@dataclass(frozen=True)
class Shaped:
    """A strategy's plan and the number of microbatches it runs at."""

    plan: Plan
    microbatches: int


def auto_microbatches(
    problem: PlanningProblem,
    limits: GroupLimits,
    units: UnitSeconds | None,
    chosen: dict[str, Shaped],
    choices: tuple[int, ...],
) -> dict[str, Shaped]:
    """Each strategy at the microbatches a job's ``"auto"`` would take
    ([Note: choosing the microbatches] in :mod:`coordinator.planner.microbatches`):
    v1 and v2 planned with them, as the engine plans (:func:`plan_job_microbatches`), and the
    fixed plans (single, even, data parallel) at their best number for that plan
    (:func:`best_microbatches`). ``units`` were timed at ``problem``'s microbatches."""
    out = {}
    for strategy, shaped in chosen.items():
        if strategy in ("v1", "v2"):
            v1 = strategy == "v1"
            q = problem.as_version(1) if v1 else problem
            out[strategy] = _auto_planned(q, None if v1 else limits, units, choices)
        else:
            best = best_microbatches(problem, shaped.plan, units, choices, scored)
            out[strategy] = shaped if best is None else Shaped(shaped.plan, best.microbatches)
    return out


def median_rows(passes: list[list[Row]]) -> list[Row]:
    """One row per strategy from ``--repeat`` passes over the same plans: the pass whose
    measured samples/s is the median (the lower of the middle two for an even count),
    with every pass's measured and predicted samples/s in ``repeats``."""
    if len(passes) == 1:
        return passes[0]
    out = []
    for runs in zip(*passes, strict=True):
        ordered = sorted(range(len(runs)), key=lambda i: runs[i].measured_sps)
        middle = runs[ordered[(len(runs) - 1) // 2]]
        repeats = [[r.measured_sps, r.predicted_sps] for r in runs]
        out.append(replace(middle, repeats=repeats))
    return out


def _run_plans(
    tb: Testbed,
    control: MqttTransport,
    fleet: str,
    spec: JobSpec,
    args: argparse.Namespace,
    chosen: dict[str, Shaped],
    problem: Callable[[int, Plan, int], tuple[PlanningProblem, UnitSeconds]],
    calibrated: tuple[PlanningProblem, UnitSeconds],
    retime: Callable[[PlanningProblem, Plan, JobSpec], dict[str, UnitSeconds]],
) -> list[Row]:
    """One pass: each strategy's plan run once (a plan an earlier row ran is its row);
    ``calibrated`` is the problem and unit seconds the plans were chosen with.

    With ``--unit-times devices`` each run is priced by the devices' own unit seconds
    timed just before it and again just after it (``retime``, the plan's devices), their mean
    (:func:`mean_own`): this host's speed drifts by a third within minutes (the devices'
    vgg11 microbatch at 64 rows read 9.7 s, then 6.0 s, four minutes apart), and a
    prediction is checked against its run under the conditions the run met. The
    timings are of single units, not of the plan: composing them into a step (stages,
    links, sums, fixed costs) is still the cost model's."""
    model = spec.model
    rows: list[Row] = []
    priced: dict[str, tuple[PlanningProblem, UnitSeconds]] = {}
    for strategy, shaped in chosen.items():
        if strategy not in args.strategies:
            continue
        plan, m = shaped.plan, shaped.microbatches
        first, first_units = _moved(calibrated, m)
        at = spec.model_copy(update={"microbatches": m})
        same = next((r for r in rows if _same(chosen[r.strategy], shaped)), None)
        if same is not None:  # the same plan, stage for stage: one run, two rows
            rows.append(replace(same, strategy=strategy, same_as=same.strategy))
            priced[strategy] = priced[same.strategy]
            print(f"# {model} {fleet} {strategy}: the plan of {same.strategy}", file=sys.stderr)
            continue
        # This host's speed drifts over minutes: price each plan with unit times measured
        # just before it runs (not in --quick, which prices every plan at the start);
        # v2 with v1's, so that both are priced by the same units as they were chosen.
        own = args.unit_times == "devices"
        if args.quick:
            now, units = first, first_units
        elif strategy == "v2" and "v1" in priced and not own and chosen["v1"].microbatches == m:
            now, units = priced["v1"]
        else:
            now, units = problem(3, plan, m)
        priced[strategy] = (now, units)
        # A group splits its microbatches by the shares it was planned with (by its
        # members' own seconds where they timed the units, as a job's: [Note: shares by a
        # device's own seconds]); the re-priced problem's could round a member to nothing.
        fixed = balanced_shares(first, plan, first_units) or None
        planned = score_plan(first, plan, fixed_shares=fixed).shares
        score = score_plan(now, plan, fixed_shares=fixed)
        schedule = _schedule(args.schedule, for_plan(first, plan), plan)
        guess = under_schedule(now, plan, predict(now, plan, units, fixed_shares=fixed), schedule)
        steps = args.warmup + max(
            args.min_steps, min(args.max_steps, math.ceil(args.seconds / guess.step_time_s))
        )
        started = time.perf_counter()
        shares = planned if plan.grouped else None
        job = at.model_copy(update={"steps": steps, "schedule": schedule})
        got = measure(control, job, plan, args.warmup, tb.accounts, shares)
        if own and not args.quick:
            units = replace(units, devices=mean_own(units.devices, retime(now, plan, at)))
            priced[strategy] = (now, units)
            score = score_plan(now, plan, fixed_shares=fixed)
            guess = predict(now, plan, units, fixed_shares=fixed)
            guess = under_schedule(now, plan, guess, schedule)
        if plan.grouped:  # what each member is predicted to compute a step, at its share
            dev = {d.id: d for d in now.devices}
            print(
                f"# predicted members of {plan}: "
                + ", ".join(
                    f"{s}/{i} {m * units.on_device(dev[i], st.start, st.end, w):.3f} s"
                    for s, (st, ws) in enumerate(zip(plan.stages, planned, strict=True))
                    if len(st.devices) > 1
                    for i, w in zip(st.devices, ws, strict=True)
                ),
                file=sys.stderr,
            )
        row = Row(
            model,
            fleet,
            strategy,
            plan.to_json(planned),
            guess.throughput_sps,
            got.sps,
            ideal_sps(now),
            steps,
            tb.method,
            got.compute_s,
            [t * m for t in guess.compute_s],
            got.allreduce_s,
            list(guess.allreduce_s),
            got.allreduce_wait_s,
            got.allreduce_cpu_s,
            batch=f"{args.batch_size}x{m}",
            unit_times=args.unit_times,
            anatomy=anatomy(plan, StepTerms.of_prediction(for_plan(now, plan), guess)).to_json(),
            measured_anatomy=got.anatomy,
            schedule=schedule,
        )
        rows.append(row)
        print(
            f"# {model} {fleet} {strategy} [{row.shape}]: measured {row.measured_sps:.1f} "
            f"predicted {row.predicted_sps:.1f} ({row.ratio:.2f}), {row.fraction:.0%} of the "
            f"ideal {row.ideal_sps:.1f}, in {time.perf_counter() - started:.0f} s; per stage "
            f"compute {_rounded(row.compute_s)} predicted {_rounded(row.predicted_compute_s)}, "
            f"all-reduce {_rounded(row.allreduce_s)} (waiting {_rounded(row.allreduce_wait_s)}, "
            f"CPU {_rounded(row.allreduce_cpu_s)}) predicted "
            f"{_rounded(row.predicted_allreduce_s)} (the links' {_rounded(score.allreduce_s)})",
            file=sys.stderr,
        )
    return rows


def _auto_planned(
    problem: PlanningProblem,
    limits: GroupLimits | None,
    units: UnitSeconds | None,
    choices: tuple[int, ...],
) -> Shaped:
    """The job's plan of ``problem`` and its microbatches, chosen together as the engine
    plans an ``auto`` job (:func:`plan_job_microbatches`)."""
    at, found = plan_job_microbatches(problem, choices, limits=limits, units=units)
    return Shaped(found.plan, at.microbatches)


def _moved(
    calibrated: tuple[PlanningProblem, UnitSeconds], m: int
) -> tuple[PlanningProblem, UnitSeconds]:
    """The calibrated problem and unit seconds at ``m`` microbatches: the units moved along
    their fitted lines to its rows (:meth:`UnitSeconds.at_rows`), as the engine moves them."""
    problem, units = calibrated
    if m == problem.microbatches:
        return problem, units
    rows = problem.batch_size / problem.microbatches
    moved = units.at_rows(problem.batch_size / m, rows)
    return problem.model_copy(update={"microbatches": m}), moved


def _same(a: Shaped, b: Shaped) -> bool:
    """Whether two strategies run one plan: the same stages at the same microbatches."""
    return a.plan.stages == b.plan.stages and a.microbatches == b.microbatches


def _schedule(asked: str, problem: PlanningProblem, plan: Plan) -> Schedule:
    """The schedule ``plan`` runs: ``asked``, or for ``auto`` the fastest its devices hold."""
    if asked == "auto":
        return fastest_schedule(problem, plan)[0]
    return cast(Schedule, asked)  # one of --schedule's choices


def fleet_problem(
    model: str,
    batch_size: int,
    microbatches: int,
    devices: list[DeviceSpec],
    announced: dict[str, DeviceSpec],
    core_gflops: float,
    steps: int,
) -> tuple[PlanningProblem, UnitSeconds]:
    """The version 2 problem of ``model`` at this batch shape over the profiles the agents
    ``announced``, calibrated now (:func:`calibrate`), and its unit seconds."""
    layers, units = calibrate(model, batch_size, microbatches, core_gflops, steps)
    return PlanningProblem(
        version=2,
        batch_size=batch_size,
        microbatches=microbatches,
        layers=layers,
        devices=[announced[d.id] for d in devices],
    ), units


def mean_own(
    before: Mapping[str, UnitSeconds], after: Mapping[str, UnitSeconds]
) -> dict[str, UnitSeconds]:
    """Each device's unit seconds timed before and after a run, unit by unit their mean
    (a device timed only once keeps that timing)."""
    out = dict(before)
    for device, later in after.items():
        early = before.get(device)
        if early is None:
            out[device] = later
            continue
        seconds = tuple((a + b) / 2 for a, b in zip(early.seconds, later.seconds, strict=True))
        fixed = tuple((a + b) / 2 for a, b in zip(early.fixed, later.fixed, strict=True))
        out[device] = UnitSeconds(seconds, later.gflops, fixed)
    return out


def own_unit_seconds(
    control: MqttTransport,
    devices: list[DeviceSpec],
    announced: dict[str, DeviceSpec],
    spec: JobSpec,
    needs_bytes: float,
) -> dict[str, UnitSeconds]:
    """Each device's own unit seconds for ``spec``'s model and shape, timed by its agent
    under its limits (:mod:`coordinator.engine.unit_profiles`): all at once where the
    agents' CPU quotas fit this host's cores with one to spare (for the broker and this
    process), else one at a time, so that none times the others' load."""
    profiles = [announced[d.id] for d in devices]
    quota = sum(min(1.0, cpu_quota_of(p) or 1.0) for p in profiles)
    one_at_a_time = quota > (os.cpu_count() or 1) - 1
    got = time_units_on_devices(
        control,
        profiles,
        timing_request(spec),
        timeout_s=1800,
        one_at_a_time=one_at_a_time,
        needs_bytes=needs_bytes,
    )
    how = "one at a time" if one_at_a_time else "all at once"
    print(
        f"# {spec.model} {spec.batch_size}x{spec.microbatches}: {len(got.seconds)} of "
        f"{len(profiles)} devices timed the units themselves ({how}, {got.took_s:.0f} s); "
        + ", ".join(f"{d} {sum(u.seconds):.3f} s" for d, u in got.seconds.items())
        + "".join(f"; {d}: {why}" for d, why in got.missing.items()),
        file=sys.stderr,
    )
    return got.seconds


def predicted_shapes(
    control: MqttTransport,
    devices: list[DeviceSpec],
    announced: dict[str, DeviceSpec],
    fleet: str,
    model: str,
    core_gflops: float,
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    """For each ``--predict-shapes`` batch shape: every strategy's plan and predicted
    samples/s over the announced profiles under ``--schedule``, priced by one calibration
    at that shape (no runs), and v2 against v1 predicted. ``Bxauto``: each strategy at
    the microbatches a job's ``"auto"`` takes (:func:`auto_microbatches`), the units timed
    at the first of them."""
    out = []
    for batch_size, asked in args.predict_shapes:
        spec = JobSpec(model=model, steps=1, batch_size=batch_size, microbatches=asked, seed=0)
        choices = microbatch_choices_of(spec)
        timed_at = first_microbatches(choices) if asked == "auto" else int(asked)
        spec = spec.model_copy(update={"microbatches": timed_at})
        limits = group_limits(spec)
        assert limits is not None  # a zoo model
        calibrated = fleet_problem(
            model, batch_size, timed_at, devices, announced, core_gflops, args.calibration_steps
        )
        now, units = calibrated
        if args.unit_times == "devices":
            own = own_unit_seconds(control, devices, announced, spec, whole_model_bytes(now))
            units = replace(units, devices=own)
            calibrated = (now, units)
        chosen = {s: Shaped(p, timed_at) for s, p in plans(now, limits, units).items()}
        if asked == "auto":
            chosen = auto_microbatches(now, limits, units, chosen, choices)
        at = {s: _moved(calibrated, c.microbatches) for s, c in chosen.items()}
        priced = {s: _priced(at[s], c.plan, args.schedule) for s, c in chosen.items()}
        predicted = {s: guess.throughput_sps for s, (guess, _) in priced.items()}
        shapes = {
            s: "+".join(str(len(st.devices)) for st in c.plan.stages) for s, c in chosen.items()
        }
        ideal = ideal_sps(now)
        item = {
            "model": model,
            "fleet": fleet,
            "batch_size": batch_size,
            "microbatches": asked,
            "chosen_microbatches": {s: c.microbatches for s, c in chosen.items()},
            "schedule": {s: schedule for s, (_, schedule) in priced.items()},
            "predicted_sps": predicted,
            "predicted_fraction": {s: v / ideal for s, v in predicted.items()},
            "largest_loss": {
                s: anatomy(
                    c.plan, StepTerms.of_prediction(for_plan(at[s][0], c.plan), priced[s][0])
                ).largest_loss()
                for s, c in chosen.items()
            },
            "shape": shapes,
            "v2_over_v1": predicted["v2"] / predicted["v1"],
            "ideal_sps": ideal,
        }
        out.append(item)
        print(
            f"# {model} {fleet} batch {batch_size} x {asked} microbatches: "
            + ", ".join(
                f"{s} [{shapes[s]}] x{chosen[s].microbatches} {priced[s][1]} {v:.2f}"
                for s, v in predicted.items()
            )
            + f"; v2/v1 {item['v2_over_v1']:.2f}",
            file=sys.stderr,
        )
    return out


def _priced(
    calibrated: tuple[PlanningProblem, UnitSeconds], plan: Plan, asked: str
) -> tuple[Prediction, Schedule]:
    """``plan``'s prediction on the calibrated problem, its groups at the shares a job's
    would take, under the schedule ``asked`` (``auto``: the fastest its devices hold)."""
    problem, units = calibrated
    fixed = balanced_shares(problem, plan, units) or None
    schedule = _schedule(asked, for_plan(problem, plan), plan)
    guess = predict(problem, plan, units, fixed_shares=fixed)
    return under_schedule(problem, plan, guess, schedule), schedule


def _rounded(values: list[float]) -> list[float]:
    return [round(v, 3) for v in values]


# -- reporting ------------------------------------------------------------------------


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table, then version 2 against version 1 per model and fleet."""
    lines = [
        "| model | fleet | batch | unit times | plan | devices per stage | schedule "
        "| measured sps | predicted sps | measured/predicted | ideal sps | measured of ideal "
        "| predicted of ideal |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.fleet} | {r.batch} | {r.unit_times} | {r.label} | {r.shape} | "
            f"{r.schedule} | {r.measured_sps:.1f} | "
            f"{r.predicted_sps:.1f} | {r.ratio:.2f} | {r.ideal_sps:.1f} | {r.fraction:.0%} | "
            f"{r.predicted_fraction:.0%} |"
        )
    lines.append("")
    for model in dict.fromkeys(r.model for r in rows):
        for fleet in dict.fromkeys(r.fleet for r in rows):
            got = {r.strategy: r for r in rows if (r.model, r.fleet) == (model, fleet)}
            if "v2" in got and "v1" in got:
                v2, v1 = got["v2"], got["v1"]
                one_run = v2.same_as is not None and v2.same_as in ("v1", v1.same_as)
                same = " (v1's plan: one run)" if one_run else ""
                measured = v2.measured_sps / v1.measured_sps
                predicted = v2.predicted_sps / v1.predicted_sps
                each = ["", ""]
                if v2.repeats and len(v2.repeats) == len(v1.repeats):
                    # Pass by pass: each pass's v2 and v1 ran minutes apart, priced alike.
                    passes = list(zip(v2.repeats, v1.repeats, strict=True))
                    by_pass = [[a[k] / b[k] for a, b in passes] for k in (0, 1)]
                    measured, predicted = (statistics.median(r) for r in by_pass)
                    each = [
                        " (passes: " + ", ".join(f"{r:.2f}x" for r in ratios) + ")"
                        for ratios in by_pass
                    ]
                lines.append(
                    f"- {model}, {fleet}: v2 ({v2.shape}){same} = "
                    f"{measured:.2f}x v1 measured{each[0]}, {predicted:.2f}x predicted{each[1]}"
                )
    return "\n".join(lines)


def chart(rows: list[Row], path: Path) -> None:
    """Grouped bars: measured samples/s per plan, per fleet, one panel per model; a tick
    for each prediction and a dashed line for each fleet's ideal bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r.model for r in rows))
    fleets = list(dict.fromkeys(r.fleet for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.8), squeeze=False)
    width = 0.8 / len(STRATEGIES)
    colours = ["#9e9e9e", "#f4a261", "#e9c46a", "#2a9d8f", "#264653"]
    for ax, model in zip(axes[0], models, strict=True):
        for k, strategy in enumerate(STRATEGIES):
            got = [
                (i, r)
                for i, fleet in enumerate(fleets)
                for r in rows
                if (r.model, r.fleet, r.strategy) == (model, fleet, strategy)
            ]
            xs = [i + (k - (len(STRATEGIES) - 1) / 2) * width for i, _ in got]
            ax.bar(xs, [r.measured_sps for _, r in got], width, label=strategy, color=colours[k])
            ax.scatter(
                xs, [r.predicted_sps for _, r in got], marker="_", s=120, color="black", zorder=3
            )
        for i, fleet in enumerate(fleets):
            ideal = [r.ideal_sps for r in rows if (r.model, r.fleet) == (model, fleet)]
            if ideal:
                ax.hlines(ideal[0], i - 0.45, i + 0.45, colors="black", linestyles="dashed")
        ax.set_xticks(range(len(fleets)), fleets)
        ax.set_yscale("log")
        ax.set_ylabel("samples/s, log (bar: measured; tick: predicted; dashes: ideal)")
        ax.set_title(f"{model}: plans on each fleet")
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(handles), frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)


def _shape(parser: argparse.ArgumentParser, item: str) -> tuple[int, int | str]:
    """``BxM`` as (batch size, microbatches), ``Bxauto`` as (batch size, ``"auto"``), or a
    one-line argument error."""
    batch_text, _, micro_text = item.strip().partition("x")
    try:
        batch = int(batch_text)
        micro: int | str = micro_text if micro_text == "auto" else int(micro_text)
    except ValueError:
        parser.error(f"--predict-shapes: {item!r} is not BATCHxMICROBATCHES (e.g. 128x8, 64xauto)")
    if batch < 1 or (micro != "auto" and (int(micro) < 1 or batch % int(micro))):
        parser.error(f"--predict-shapes: {item!r}: the batch must split into the microbatches")
    return batch, micro


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", default="vgg11,resnet18,gpt-mini")
    parser.add_argument("--fleets", default=",".join(FLEETS), help=", ".join(FLEETS))
    parser.add_argument(
        "--batch-size", type=int, default=64, help="samples a step (the default: see the docstring)"
    )
    parser.add_argument(
        "--microbatches",
        type=_microbatches,
        default="auto",
        help="auto (the default: each plan at the number a job's auto takes) or a number",
    )
    parser.add_argument(
        "--schedule",
        choices=["auto", "1f1b", "gpipe", "zb-h1"],
        default="auto",
        help="each plan's schedule; auto: the fastest its devices hold, as a job's auto",
    )
    parser.add_argument(
        "--strategies", default=",".join(STRATEGIES), help="the plans run: " + ", ".join(STRATEGIES)
    )
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the rate")
    parser.add_argument("--seconds", type=float, default=6.0, help="steady state per run")
    parser.add_argument("--min-steps", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--calibration-steps", type=int, default=5)
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="passes over the same plans, strategies in turn; each row is its median pass",
    )
    parser.add_argument(
        "--method",
        choices=METHODS,
        help="the testbed's limits (default: scalar where the kernel's limits work, "
        "else software; kernel: the old FLOP-share quota on the whole agent)",
    )
    parser.add_argument(
        "--unit-times",
        choices=["host", "devices"],
        default="devices",
        help="the cost model's unit seconds: each device's own, timed by its agent under its "
        "limits before each run (devices), or this host's scaled by matmul rates (host)",
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--quick", action="store_true", help="rpi4-4gb:4, vgg11, few steps")
    parser.add_argument("--results", type=Path, help="the JSON file written")
    parser.add_argument("--chart", type=Path, help="the chart written")
    parser.add_argument("--anatomy", type=Path, help="where the steps went: the JSON written")
    parser.add_argument("--anatomy-chart", type=Path, help="where the steps went: the chart")
    parser.add_argument("--from-json", type=Path, help="render a results file; run nothing")
    parser.add_argument(
        "--predict-shapes",
        default="",
        help="batch shapes BxM, comma separated (e.g. 32x4,128x8): predict every plan at "
        "each over the fleet's announced profiles, run nothing",
    )
    args = parser.parse_args(argv)
    args.predict_shapes = [_shape(parser, item) for item in args.predict_shapes.split(",") if item]
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = sorted(set(args.strategies) - set(STRATEGIES))
    if unknown:
        parser.error(f"--strategies: {', '.join(unknown)} not one of {', '.join(STRATEGIES)}")
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1 (got {args.repeat})")
    results = Path(__file__).resolve().parent / "results"
    if args.quick:
        args.models, args.fleets, args.batch_size = "vgg11", "rpi4", 16
        args.warmup, args.min_steps, args.max_steps, args.seconds = 1, 1, 1, 0.0
        args.calibration_steps = 1
        results = Path(tempfile.gettempdir())
    stem = "hybrid-quick" if args.quick else "hybrid"
    stem = f"{stem}-shapes" if args.predict_shapes else stem
    args.results = args.results or results / f"{stem}.json"
    args.chart = args.chart or results / f"{stem}.png"
    anatomy_stem = "anatomy-quick" if args.quick else "anatomy"
    args.anatomy = args.anatomy or results / f"{anatomy_stem}.json"
    args.anatomy_chart = args.anatomy_chart or results / f"{anatomy_stem}.png"
    return args


def _predict_shapes(fleets: list[str], models: list[str], args: argparse.Namespace) -> int:
    """``--predict-shapes``: the predictions per batch shape, printed and written (no runs)."""

    def sweep(
        tb: Testbed,
        control: MqttTransport,
        devices: list[DeviceSpec],
        announced: dict[str, DeviceSpec],
        fleet: str,
        model: str,
    ) -> list[dict[str, Any]]:
        return predicted_shapes(control, devices, announced, fleet, model, tb.core_gflops, args)

    items = [item for key in fleets for item in on_fleet(key, models, args.method, sweep)]
    args.results.write_text(json.dumps(items, indent=2) + "\n")
    print(f"results: {args.results}")
    print(
        "| model | fleet | batch | v1: sps (devices per stage, microbatches, schedule) "
        "| v2: the same | predicted v2/v1 | v2 of ideal | v2's largest loss |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for it in items:
        v1, v2 = (
            f"{it['predicted_sps'][s]:.2f} ({it['shape'][s]}, "
            f"{it['chosen_microbatches'][s]}, {it['schedule'][s]})"
            for s in ("v1", "v2")
        )
        print(
            f"| {it['model']} | {it['fleet']} | {it['batch_size']}x{it['microbatches']} "
            f"| {v1} | {v2} | {it['v2_over_v1']:.2f} | {it['predicted_fraction']['v2']:.3f} "
            f"| {it['largest_loss']['v2']} |"
        )
    fractions = [it["predicted_fraction"]["v2"] for it in items]
    if fractions:
        print(f"\nv2 predicted of ideal: median {statistics.median(fractions):.3f}")
    return 0


def _microbatches(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither auto nor a number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: at least one microbatch")
    return value


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json is not None:
        rows = from_json(json.loads(args.from_json.read_text()))
    else:
        tune_malloc()  # as the agents do: calibration and runs allocate alike
        args.method = args.method or most_faithful()
        models = [m.strip() for m in args.models.split(",") if m.strip()]
        fleets = [f.strip() for f in args.fleets.split(",") if f.strip()]
        if args.predict_shapes:
            return _predict_shapes(fleets, models, args)

        def run(
            tb: Testbed,
            control: MqttTransport,
            devices: list[DeviceSpec],
            announced: dict[str, DeviceSpec],
            fleet: str,
            model: str,
        ) -> list[Row]:
            return _run_model(tb, control, devices, announced, fleet, model, args)

        rows = [row for key in fleets for row in on_fleet(key, models, args.method, run)]
        args.results.write_text(json.dumps(to_json(rows), indent=2) + "\n")
    chart(rows, args.chart)
    parts = anatomies.write(to_json(rows), args.anatomy, args.anatomy_chart)
    if args.json:
        print(json.dumps(to_json(rows), indent=2))
        return 0
    print(f"limits: {rows[0].method}; results: {args.results}; chart: {args.chart}")
    print(table(rows))
    if parts:
        print(f"\nwhere the steps went: {args.anatomy}; chart: {args.anatomy_chart}")
        print(anatomies.table(parts))
    return 0


if __name__ == "__main__":
    exit_on_sigterm()  # a stopped run stops the broker and agents it started
    sys.exit(main())
