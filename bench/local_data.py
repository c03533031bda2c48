"""What helpers are worth to data that stays home: local-data plans on emulated fleets.

Each fleet is ``H`` Raspberry Pi 4 (``rpi4-4gb``) data holders and two laptop-class
helpers (``laptop``) on the testbed (:mod:`coordinator.testbed`, its scalar method
where the kernel's limits work: ``--method``). Holder ``i`` starts with shard
``i/H`` of every dataset a model here needs (``edgetrain agent --data
NAME=NAME:shard=i/H``, [Note: local data] in :mod:`edge.models.local_data`),
announced in its profile; the helpers hold nothing.
Each model trains a job on that local data (``"data": {"name": ..., "placement":
"local"}``) for a few steps, one run after another on the same fleet:

- ``one holder``: one holder training the whole model alone on its own shard. Every
  holder is the same device with a shard of the same size (to one sample), so the
  first stands for each;
- ``holders alone``: every unit on the holders together, data-parallel, no helper
  (the federated alternative, :class:`~coordinator.planner.holders.HolderPlans`);
- ``holders averaged``: the same plan as federated averaging, not exact and labelled
  so (``training``): DiLoCo at outer lr 1 without momentum, every ``--average-every``
  steps ([Note: DiLoCo in a group] in :mod:`edge.runtime.outer_sync`). Each holder
  steps on its own samples, and the holders average their weights by share at each
  sync, so the group's sum is paid once in that many steps. Its runs measure whole
  periods (warm-up and measured steps each a multiple of the period);
- ``one helper``: one helper training the whole model alone, lent the dataset for
  this run only (the job's data central: the helper loads it as any first stage
  does); every helper is alike, so the first stands for each;
- ``plan``, with one helper and with two (the second is otherwise idle): the job's
  plan (:func:`coordinator.engine.engine.plan_over`, as the coordinator makes it):
  the holders are stage 0's group, each with its share of every microbatch, and the
  helpers run the rest.

Each runs at the number of microbatches the planner predicts fastest for its own plan
(``--microbatches auto``, a job's default; a number: every run at it), and its row
says which (``microbatches``).

The first four use no more than one device kind each, so they run once per model and
holder count and every plan of that model and holder count is compared with them.

[Note: a fleet's capacity]
A row's ``capacity_sps`` is the sum of what each device it may use trains alone, on
the whole model under the same emulation: ``H`` times ``one holder``'s samples/s for
the holders (they are alike), plus ``k`` times ``one helper``'s for a plan with ``k``
helpers (the holders alone: the holders' part only; one holder: its own). Its
``fraction`` is the measured samples/s over that: how much of what the fleet could do
alone, device by device, the plan turns into training of one model.

For each: the measured samples/s (steady state: stage 0's step times after
``--warmup`` steps, :func:`bench.hybrid.measure`), the predicted samples/s (the
planner's internal model, :func:`coordinator.planner.predict.predict`, with the
units each device timed itself under its limits, as a job of ``unit_times: devices``
gets them (``--unit-times host``: this machine's, scaled to each device), and stage
0's shares fixed by the data), measured / predicted, the bytes every device sent per sample trained
(``StepReport.bytes_sent`` over the steady steps: activations, gradients, labels and
a group's gradient sums, as framed on the wire), the capacity and its fraction, and
where the step went member by member, measured and predicted (``anatomy`` and
``predicted_anatomy``: :mod:`coordinator.planner.anatomy`).

Models: ``cnn-digits`` at width 64 (the demo's) on ``digits``, and ``vgg11`` at
width 16 on ``synthetic-images`` 3x32x32 (a quarter of VGG-11's channels, so that
a Pi-class holder alone trains a step within seconds here).

Speeds: one scale for every fleet (the testbed's ``--scale``: cores for the
fastest device), chosen so that the largest fleet (8 holders and 2 helpers) gets
``--cores`` of this machine in all; the ratios between devices are the catalogue's.
``--method`` is the testbed's (default: ``scalar`` where the kernel's limits work,
[Note: two speeds of a device] in :mod:`coordinator.testbed.sizing`; ``kernel`` the
FLOP-share quota on the whole agent; ``software``), and each row says which.

    .venv/bin/python bench/local_data.py [--holders 2,4,8] [--helpers 1,2]
        [--models cnn-digits,vgg11] [--cores 1.2] [--method auto|kernel|scalar|software]
        [--json] [--results bench/results/local_data.json]
        [--chart bench/results/local_data.png] [--from-json FILE] [--quick]

``--average-every H`` sets the averaged holders' period (default 4). ``--quick`` runs 2
holders and 1 helper, ``cnn-digits`` only, one warm-up and one measured step a plan, and
writes its JSON and chart to the temporary directory unless ``--results``/``--chart``
say otherwise. ``--from-json`` runs nothing: it renders the table, the chart and the
JSON again from a results file.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's packages

from bench.cpu_usage import CpuSampler, Usage
from bench.siblings import sibling
from coordinator.engine.assignments import microbatch_choices_of, planning_start
from coordinator.engine.engine import holders_at_best, job_problem, job_unit_seconds, plan_over
from coordinator.engine.links import AVERAGE_EVERY, averaged
from coordinator.engine.spec import DataPlacement, JobSpec, microbatches_of
from coordinator.engine.unit_profiles import whole_model_bytes
from coordinator.engine.watch import DeviceFeed
from coordinator.planner.anatomy import StepTerms, anatomy
from coordinator.planner.build import parse_fleet
from coordinator.planner.predict import Prediction, UnitSeconds
from coordinator.planner.score import Plan, PlanScore, for_plan
from coordinator.testbed.limits import METHODS, most_faithful
from coordinator.testbed.sizing import CPU_BUDGET, default_scale
from coordinator.testbed.testbed import StartOptions, Testbed
from edge.models.zoo import get_model
from edge.problem import DeviceSpec, PlanningProblem
from edge.runtime.allocator import tune_malloc
from edge.transport.mqtt import MqttTransport
from edgetrain.cli.signals import exit_on_sigterm

hybrid = sibling("hybrid")

STRATEGIES = ("holders alone", "holders averaged", "one holder", "one helper", "plan")
"""The plans of each job, in the order they run: the holders alone first, so that every
holder builds its first stage (imports, its data) at once, outside any measurement."""
MODELS: dict[str, dict[str, Any]] = {"cnn-digits": {"width": 64}, "vgg11": {"width": 16}}
"""The zoo models and their options: a ``cnn-digits``-class and a ``vgg11``-class model."""
HOLDER, HELPER = "rpi4-4gb", "laptop"
"""Catalogue profiles of the data holders and of the helpers."""
MAX_HELPERS = 2


@dataclass
class Row:
    model: str
    holders: int
    helpers: int
    strategy: str
    stages: list[dict[str, Any]]
    """The plan's stages (``plan.to_json`` with each stage's devices and shares)."""
    predicted_sps: float
    measured_sps: float
    bytes_per_sample: float
    """Bytes every device sent in the steady steps, per sample trained."""
    steps: int
    method: str
    microbatches: int = 0
    """The step's microbatches (the planner's choice for this plan where ``auto``; 0 in
    results written before the bench recorded it)."""
    training: str = "exact"
    """``exact``, or what makes the run not single-device training (``JobSpec.training``)."""
    capacity_sps: float = math.nan
    """What the devices the row may use train alone, summed ([Note: a fleet's capacity])."""
    anatomy: dict[str, Any] | None = None
    """Where the steady steps went, member by member, measured (``Anatomy.to_json``)."""
    predicted_anatomy: dict[str, Any] | None = None
    """The same, predicted by the internal model."""
    cpu: dict[str, dict[str, float]] | None = None
    """Per agent that ran (by device id) and the broker, in the steady steps
    (:mod:`bench.cpu_usage`): CPU seconds a step, the fraction of its share of a core
    it used (``busy``: 1 is held at its quota throughout), and seconds a step its quota
    held it off the CPU."""

    @property
    def ratio(self) -> float:
        """Measured / predicted."""
        return self.measured_sps / self.predicted_sps if self.predicted_sps > 0 else math.nan

    @property
    def fraction(self) -> float:
        """Measured over the capacity of the devices it may use."""
        return self.measured_sps / self.capacity_sps if self.capacity_sps > 0 else math.nan

    @property
    def layout(self) -> str:
        """Which units run where, e.g. ``holders 0-0 → helper1 1-3``."""
        parts = []
        for st in self.stages:
            devices = st.get("devices") or [st["device"]]
            grouped = len(devices) > 1 and all(d.startswith("holder") for d in devices)
            who = "holders" if grouped else "+".join(devices)
            parts.append(f"{who} {st['layers'][0]}-{st['layers'][1] - 1}")
        return " → ".join(parts)

    @property
    def label(self) -> str:
        """What ran: ``one holder``, ``holders alone``, ``plan, 1 helper``..."""
        if self.strategy == "holders averaged":
            return "holders averaged (non-exact)"
        if self.strategy != "plan":
            return self.strategy
        return f"plan, {self.helpers} helper{'s' if self.helpers > 1 else ''}"

    @property
    def order(self) -> tuple[int, int]:
        """Where the row's bars go: the strategies' order, then the helpers."""
        return STRATEGIES.index(self.strategy), self.helpers


DERIVED = ("ratio", "fraction", "layout", "label")
"""Keys of a JSON row that :func:`to_json` computes from the others."""


def to_json(rows: list[Row]) -> list[dict[str, Any]]:
    """The rows as the results file holds them: every field, then the derived ones."""
    return [asdict(r) | {k: getattr(r, k) for k in DERIVED} for r in rows]


def from_json(items: list[dict[str, Any]]) -> list[Row]:
    return [Row(**{k: v for k, v in item.items() if k not in DERIVED}) for item in items]


# -- fleets and plans -----------------------------------------------------------------


def fleet_devices(holders: int, helpers: int = MAX_HELPERS) -> list[DeviceSpec]:
    """``holders`` catalogue Pis (``holder1``...) then ``helpers`` laptops (``helper1``...)."""
    pi, laptop = parse_fleet(f"{HOLDER},{HELPER}")
    return [pi.model_copy(update={"id": f"holder{i + 1}"}) for i in range(holders)] + [
        laptop.model_copy(update={"id": f"helper{i + 1}"}) for i in range(helpers)
    ]


def fleet_scale(largest: int, cores: float) -> float:
    """The testbed scale that gives the fleet of ``largest`` holders and two helpers
    ``cores`` of this machine in all (every smaller fleet the same speeds)."""
    return default_scale(fleet_devices(largest), cores / CPU_BUDGET)


def local_data(
    holders: int, models: list[str], synthetic_size: int | None = None
) -> dict[str, list[str]]:
    """Each holder's ``--data`` items: shard ``i/holders`` of every dataset of ``models``,
    registered under the dataset's name; ``synthetic_size``: the samples of a synthetic
    dataset before it is cut (its own default otherwise), so that many holders each
    hold a batch."""
    datasets = dict.fromkeys(get_model(m, **MODELS[m]).dataset for m in models)

    def item(name: str, i: int) -> str:
        size = f",size={synthetic_size}" if synthetic_size and name.startswith("synthetic") else ""
        return f"{name}={name}:shard={i + 1}/{holders}{size}"

    return {f"holder{i + 1}": [item(name, i) for name in datasets] for i in range(holders)}


def job_spec(model: str, args: argparse.Namespace) -> JobSpec:
    """The job of ``model`` on its dataset's local shards (one step: runs set their own)."""
    dataset = get_model(model, **MODELS[model]).dataset
    return JobSpec(
        model=model,
        model_options=MODELS[model],
        steps=1,
        batch_size=args.batch_size,
        microbatches=args.microbatches,
        seed=0,
        data=DataPlacement(name=dataset),
    )


def profiles(control: MqttTransport, ids: list[str], timeout_s: float = 30.0) -> list[DeviceSpec]:
    """The profiles the agents ``ids`` announce on the broker (the holders' with their
    local datasets), in the order of ``ids``."""
    got: dict[str, DeviceSpec] = {}
    cond = threading.Condition()

    def on_profile(device: str, spec: DeviceSpec) -> None:
        with cond:
            got[device] = spec
            cond.notify_all()

    deadline = time.monotonic() + timeout_s
    with DeviceFeed(control, on_profile=on_profile), cond:
        while not set(got) >= set(ids):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no profile from {sorted(set(ids) - set(got))}")
            cond.wait(0.2)
    return [got[d] for d in ids]


@dataclass(frozen=True)
class Candidate:
    spec: JobSpec
    """The job it runs (the fleet's, or ``one helper``'s on central data)."""
    plan: Plan
    shares: list[list[float]]
    """Each stage's members' shares of a microbatch (``[1.0]`` for one device)."""
    predicted_sps: float
    predicted_anatomy: dict[str, Any]


def candidates(
    spec: JobSpec,
    devices: list[DeviceSpec],
    device_units: Mapping[str, UnitSeconds] | None = None,
    average_every: int = AVERAGE_EVERY,
) -> dict[str, Candidate]:
    """Every strategy's plan (:data:`STRATEGIES`) of the local-data job ``spec`` over
    ``devices`` (holders announcing its data, then helpers), each planned and predicted
    the same way: the job's unit times (``device_units``: those the devices timed
    themselves, as a job of ``unit_times: devices`` is; else this machine's), stage 0's
    shares fixed by the data, and each at its own best number of microbatches where
    the job leaves it to the planner (``auto``, as the engine chooses it for the plan
    it runs). ``holders averaged`` is the holders alone as federated averaging, every
    ``average_every`` steps (:func:`~coordinator.engine.links.averaged`)."""
    planned = plan_over(spec, devices, where="the fleet", device_units=device_units)
    assert planned.holders is not None  # a job on local data
    start = planning_start(spec)
    units = job_unit_seconds(start, device_units)
    assert units is not None  # a zoo model on its own dataset
    choices = microbatch_choices_of(spec) if spec.microbatches == "auto" else None
    fleet = planned.problem.model_copy(update={"microbatches": start.microbatches})
    alone = planned.holders.holders_alone
    one = next(iter(planned.holders.each_alone.values()))  # every holder is alike
    held = {d for st in alone.plan.stages for d in st.devices}
    helper = next(d for d in devices if d.id not in held)
    lent = spec.model_copy(update={"data": None})  # the helper's data, for this run only
    solo = plan_over(lent, [helper], where="the helper", device_units=device_units)
    fed = averaged(spec, average_every)
    assert fed is not None  # the bench's jobs send their labels

    def candidate(job: JobSpec, score: PlanScore, shares: list[float]) -> Candidate:
        """``score``'s plan of ``job`` at its best microbatches, stage 0 at ``shares``."""
        every = job.diloco.every if job.diloco is not None else 1
        problem, _, guess = holders_at_best(
            fleet, score.plan, score, units, shares=shares, choices=choices, sum_every=every
        )
        return _candidate(job.at_microbatches(problem.microbatches), problem, score, guess)

    solo_guess = solo.found.prediction
    assert solo_guess is not None  # a zoo model on its own dataset
    return {
        "holders alone": candidate(spec, alone, alone.shares[0]),
        "holders averaged": candidate(fed, alone, alone.shares[0]),
        "one holder": candidate(spec, one, [1.0]),
        "one helper": _candidate(
            lent.at_microbatches(solo.problem.microbatches), solo.problem, solo.score, solo_guess
        ),
        "plan": candidate(spec, planned.found.score, alone.shares[0]),
    }


def _candidate(
    job: JobSpec, problem: PlanningProblem, score: PlanScore, guess: Prediction
) -> Candidate:
    terms = StepTerms.of_prediction(for_plan(problem, score.plan), guess)
    return Candidate(
        job, score.plan, score.shares, guess.throughput_sps, anatomy(score.plan, terms).to_json()
    )


# -- running --------------------------------------------------------------------------


def run_fleet(holders: int, models: list[str], args: argparse.Namespace) -> list[Row]:
    """Bring up ``holders`` Pis and two helpers; per model, run the alternatives (no
    helper) once and the plan with each helper count of ``args.helper_counts``; then
    each row's capacity ([Note: a fleet's capacity])."""
    devices = fleet_devices(holders)
    rows: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory(prefix="edgetrain-local-data-") as state,
        Testbed.up(
            devices,
            scale=args.scale,
            state_dir=Path(state),
            data=local_data(holders, models, args.synthetic_size),
            # Every agent imports torch at once: on 2 cores, seconds each.
            start=StartOptions(
                method=args.method, coordinator=False, online_timeout_s=max(90.0, 8.0 * holders)
            ),
        ) as tb,
    ):
        cores = ", ".join(f"{d.id} {d.cpus:.3f} (scalar {d.general_cpus:.3f})" for d in tb.devices)
        print(f"# {holders} holders: limits {tb.method_line}; cores {cores}", file=sys.stderr)
        control = MqttTransport(tb.login())
        control.connect(30)
        try:
            fleet = profiles(control, [d.id for d in devices])
            for model in models:
                spec = job_spec(model, args)
                own = own_units(tb, control, spec, fleet) if args.unit_times == "devices" else None
                for helpers in (0, *args.helper_counts):
                    got = candidates(
                        spec, fleet[: holders + max(1, helpers)], own, args.average_every
                    )
                    for strategy, candidate in got.items():
                        if (strategy == "plan") == (helpers > 0):
                            rows.append(
                                _run(tb, control, candidate, holders, helpers, args)
                                | {"strategy": strategy}
                            )
        finally:
            control.close()
    return with_capacity([Row(**r) for r in rows])


def own_units(
    tb: Testbed, control: MqttTransport, spec: JobSpec, fleet: list[DeviceSpec]
) -> dict[str, UnitSeconds]:
    """Each device's own unit seconds for ``spec``, as a job of ``unit_times: devices``
    gets them: one holder and one helper time the units (every holder is the same
    device emulated alike, and so is every helper), and each device takes its kind's."""
    holder, helper = fleet[0], fleet[-1]
    needs = whole_model_bytes(job_problem(spec, fleet))
    timed = hybrid.own_unit_seconds(control, [holder, helper], tb.announced, spec, needs)
    out = {}
    for d in fleet:
        kind = holder if d.id.startswith("holder") else helper
        if kind.id in timed:
            out[d.id] = timed[kind.id]
    return out


def with_capacity(rows: list[Row]) -> list[Row]:
    """``rows`` with each one's ``capacity_sps`` ([Note: a fleet's capacity]) from its
    model's and holder count's ``one holder`` and ``one helper`` rows."""
    alone = {(r.model, r.holders, r.strategy): r.measured_sps for r in rows if r.helpers == 0}
    for r in rows:
        one = alone.get((r.model, r.holders, "one holder"), math.nan)
        helper = alone.get((r.model, r.holders, "one helper"), math.nan)
        r.capacity_sps = {
            "one holder": one,
            "one helper": helper,
            "holders alone": r.holders * one,
            "holders averaged": r.holders * one,
        }.get(r.strategy, r.holders * one + r.helpers * helper)
    return rows


def _run(
    tb: Testbed,
    control: MqttTransport,
    candidate: Candidate,
    holders: int,
    helpers: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Run one candidate on the testbed's agents; its row's fields but the strategy."""
    spec = candidate.spec
    warmup = args.warmup
    measured_steps = max(
        args.min_steps,
        min(args.max_steps, math.ceil(args.seconds * candidate.predicted_sps / spec.batch_size)),
    )
    if spec.diloco is not None:  # whole periods: one sync in every `every` steps measured
        every = spec.diloco.every
        warmup = every * math.ceil(warmup / every)
        measured_steps = every * math.ceil(measured_steps / every)
    steps = warmup + measured_steps
    started = time.perf_counter()
    job = spec.model_copy(update={"steps": steps})
    shares = candidate.shares if candidate.plan.grouped else None
    with CpuSampler(tb.state_dir) as sampler:
        measured = hybrid.measure(control, job, candidate.plan, warmup, tb.accounts, shares)
    ran = {d for st in candidate.plan.stages for d in st.devices} | {"broker"}
    usage = {k: v for k, v in sampler.between(*measured.window).items() if k in ran}
    cpu = cpu_per_step(tb, usage, measured.window, spec.batch_size / measured.sps)
    row = {
        "model": spec.model,
        "holders": holders,
        "helpers": helpers,
        "stages": candidate.plan.to_json(candidate.shares),
        "predicted_sps": candidate.predicted_sps,
        "measured_sps": measured.sps,
        "bytes_per_sample": measured.bytes_per_sample,
        "steps": steps,
        "method": tb.method,
        "microbatches": microbatches_of(spec),
        "training": spec.training,
        "anatomy": measured.anatomy,
        "predicted_anatomy": candidate.predicted_anatomy,
        "cpu": cpu,
    }
    print(
        f"# {spec.model} {holders} holders + {helpers} helpers: measured {measured.sps:.1f} "
        f"predicted {candidate.predicted_sps:.1f} samples/s, "
        f"{measured.bytes_per_sample:.0f} B/sample, {steps} steps in "
        f"{time.perf_counter() - started:.0f} s",
        file=sys.stderr,
    )
    busy = ", ".join(
        f"{name} {u['cpu_s_per_step'] * 1e3:.0f} ms ({u['busy']:.2f} of its share, "
        f"{u['throttled_s_per_step'] * 1e3:.0f} ms held)"
        for name, u in cpu.items()
    )
    print(f"#   CPU a step: {busy}", file=sys.stderr)
    return row


def cpu_per_step(
    tb: Testbed, usage: dict[str, Usage], window: tuple[float, float], step_s: float
) -> dict[str, dict[str, float]]:
    """``usage`` (:mod:`bench.cpu_usage`: device ids and ``broker``) in a run's steady
    ``window``, per step of ``step_s`` seconds and against each one's share of a core
    (its quota's; a free core for the broker and under the software method)."""
    seconds = window[1] - window[0]
    if not seconds > 0:
        return {}
    shares = {d.id: d.quota_cpus(tb.method) or 1.0 for d in tb.devices}
    return {
        name: {
            "cpu_s_per_step": u.cpu_s / seconds * step_s,
            "busy": u.cpu_s / seconds / shares.get(name, 1.0),
            "throttled_s_per_step": u.throttled_s / seconds * step_s,
        }
        for name, u in sorted(usage.items())
    }


# -- reporting ------------------------------------------------------------------------


def _kib(n: float) -> str:
    return f"{n / 1024:.1f}"


def _speedup(plan: Row, base: Row | None) -> str:
    """Measured samples/s of ``plan`` over ``base``'s, e.g. ``3.10x``."""
    if base is None or not base.measured_sps > 0:
        return "-"
    return f"{plan.measured_sps / base.measured_sps:.2f}x"


def comparisons(rows: list[Row]) -> list[tuple[Row, Row | None, Row | None]]:
    """Each plan's row with the alternatives of its model and holders: ``(plan, holders
    alone, one holder)`` (``None`` where one was not run)."""
    alternatives = {(r.model, r.holders, r.strategy): r for r in rows if r.helpers == 0}
    return [
        (
            r,
            alternatives.get((r.model, r.holders, "holders alone")),
            alternatives.get((r.model, r.holders, "one holder")),
        )
        for r in rows
        if r.strategy == "plan"
    ]


def table(rows: list[Row]) -> str:
    """One Markdown line per plan: measured (predicted) samples/s of it and of its
    alternatives, measured/predicted of each, the plan's speedups over them and the KiB
    each sent per sample; then the jobs where the plan does not beat the holders alone."""
    lines = [
        "| model | holders | helpers | plan (units per stage) | plan sps (pred) "
        "| holders alone sps (pred) | one holder sps (pred) "
        "| measured/predicted (plan, alone, one) | plan / holders alone | plan / one holder "
        "| KiB sent per sample (plan, alone) | fraction of capacity (plan, alone) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    losing = []
    for plan, alone, one in comparisons(rows):
        both = (plan, alone, one)
        cells = [plan.model, str(plan.holders), str(plan.helpers), plan.layout]
        cells += [f"{r.measured_sps:.1f} ({r.predicted_sps:.1f})" if r else "-" for r in both]
        cells.append(", ".join(f"{r.ratio:.2f}" if r else "-" for r in both))
        cells += [_speedup(plan, alone), _speedup(plan, one)]
        cells.append(", ".join(_kib(r.bytes_per_sample) if r else "-" for r in (plan, alone)))
        cells.append(", ".join(f"{r.fraction:.2f}" if r else "-" for r in (plan, alone)))
        lines.append("| " + " | ".join(cells) + " |")
        if alone is not None and plan.measured_sps <= alone.measured_sps:
            losing.append(f"{plan.model}, {plan.holders} holders + {plan.helpers}")
    lines += ["", "The plan measures no faster than the holders alone on: "]
    lines[-1] += "; ".join(losing) if losing else "none of these jobs"
    lines += ["", "The holders over one holder, measured: " + "; ".join(holders_speedups(rows))]
    return "\n".join(lines)


def holders_speedups(rows: list[Row]) -> list[str]:
    """Per model and holder count, the holders alone (exact) and averaged (not exact)
    over one holder, measured: e.g. ``cnn-digits 8 holders: alone 2.40x, averaged 4.10x``."""
    by = {(r.model, r.holders, r.strategy): r for r in rows if r.helpers == 0}
    out = []
    for model, holders in dict.fromkeys((r.model, r.holders) for r in rows):
        one = by.get((model, holders, "one holder"))
        ratios = [
            f"{name} {_speedup(by[(model, holders, strategy)], one)}"
            for name, strategy in (("alone", "holders alone"), ("averaged", "holders averaged"))
            if (model, holders, strategy) in by
        ]
        if ratios:
            out.append(f"{model} {holders} holders: {', '.join(ratios)}")
    return out


def rows_table(rows: list[Row]) -> str:
    """One Markdown line per row: what ran, under which method, measured and predicted
    samples/s, their ratio, the capacity of its devices and the fraction of it reached."""
    lines = [
        "| model | holders | run | training | method | microbatches | measured sps "
        "| predicted sps | measured/predicted | capacity sps | fraction | KiB sent per sample |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r.model, r.holders, r.order)):
        cells = [r.model, str(r.holders), r.label, r.training, r.method, str(r.microbatches or "-")]
        cells += [f"{r.measured_sps:.1f}", f"{r.predicted_sps:.1f}", f"{r.ratio:.2f}"]
        cells += [f"{r.capacity_sps:.1f}", f"{r.fraction:.2f}", _kib(r.bytes_per_sample)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chart(rows: list[Row], path: Path) -> None:
    """Grouped bars: measured samples/s of one holder, the holders alone and the plan with
    each helper count, per holder count, one panel per model; a tick for each prediction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r.model for r in rows))
    labels = list(dict.fromkeys(r.label for r in sorted(rows, key=lambda r: r.order)))
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.8), squeeze=False)
    width = 0.8 / len(labels)
    colours = ["#9e9e9e", "#e9c46a", "#f4a261", "#8ab17d", "#2a9d8f", "#264653"]
    for ax, model in zip(axes[0], models, strict=True):
        counts = sorted({r.holders for r in rows if r.model == model})
        for k, label in enumerate(labels):
            got = [
                (i, r)
                for i, holders in enumerate(counts)
                for r in rows
                if (r.model, r.holders, r.label) == (model, holders, label)
            ]
            xs = [i + (k - (len(labels) - 1) / 2) * width for i, _ in got]
            colour = colours[k % len(colours)]
            ax.bar(xs, [r.measured_sps for _, r in got], width, label=label, color=colour)
            ax.scatter(
                xs, [r.predicted_sps for _, r in got], marker="_", s=120, color="black", zorder=3
            )
        ax.set_xticks(range(len(counts)), [f"{h} holders" for h in counts])
        ax.set_yscale("log")
        ax.set_ylabel("samples/s, log (bar: measured; tick: predicted)")
        ax.set_title(f"{model}: data that stays home")
        ax.grid(axis="y", alpha=0.3)
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=len(handles), frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)


def _microbatches(text: str) -> int | str:
    return text if text == "auto" else int(text)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--holders", default="2,4,8", help="holder counts, one fleet each")
    parser.add_argument("--helpers", default="1,2", help="helper counts (at most 2)")
    parser.add_argument("--models", help=f"{', '.join(MODELS)} (default: all; --quick: the first)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--microbatches",
        type=_microbatches,
        default="auto",
        help="a step's microbatches, or auto (default): each run at the number the "
        "planner predicts fastest for its plan, as a job's default is",
    )
    parser.add_argument(
        "--average-every",
        type=int,
        default=AVERAGE_EVERY,
        help="holders averaged: steps between the holders' averages (federated averaging)",
    )
    parser.add_argument("--warmup", type=int, default=1, help="steps left out of the rate")
    parser.add_argument("--seconds", type=float, default=3.0, help="steady state per run")
    parser.add_argument("--min-steps", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--cores", type=float, default=1.2, help="the largest fleet's cores")
    parser.add_argument(
        "--method",
        choices=METHODS,
        help="the testbed's limits (default: scalar where the kernel's limits work, "
        "else software; kernel: the old FLOP-share quota on the whole agent)",
    )
    parser.add_argument(
        "--unit-times",
        choices=["devices", "host"],
        default="devices",
        help="price plans by each device's own timing of the model's units (as a job of "
        "unit_times: devices is) or by this host's scaled to each device",
    )
    parser.add_argument(
        "--synthetic-size",
        type=int,
        help="samples of synthetic-images before the holders' cut (default: its own, "
        "1024): 32 holders need more than that to hold a batch each",
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--quick", action="store_true", help="2 holders, 1 helper, cnn-digits")
    parser.add_argument("--results", type=Path, help="the JSON file written")
    parser.add_argument("--chart", type=Path, help="the chart written")
    parser.add_argument("--from-json", type=Path, help="render a results file; run nothing")
    args = parser.parse_args(argv)
    results = Path(__file__).resolve().parent / "results"
    if args.quick:
        args.holders, args.helpers = "2", "1"
        args.models = args.models or "cnn-digits"
        args.batch_size, args.warmup, args.min_steps, args.max_steps = 16, 1, 1, 1
        args.seconds = 0.0
        results = Path(tempfile.gettempdir())
    args.models = args.models or ",".join(MODELS)
    args.holder_counts, args.helper_counts = _ints(args.holders), _ints(args.helpers)
    if not args.helper_counts or not all(1 <= k <= MAX_HELPERS for k in args.helper_counts):
        parser.error(f"--helpers: counts from 1 to {MAX_HELPERS}")
    unknown = [m for m in args.models.split(",") if m and m not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {unknown[0]!r} (one of {', '.join(MODELS)})")
    # One speed for every fleet: the largest fleet of the full run fits in --cores.
    args.scale = fleet_scale(max([*args.holder_counts, 8]), args.cores)
    stem = "local_data-quick" if args.quick else "local_data"
    args.results = args.results or results / f"{stem}.json"
    args.chart = args.chart or results / f"{stem}.png"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json is not None:
        rows = from_json(json.loads(args.from_json.read_text()))
    else:
        tune_malloc()  # as the agents do
        args.method = args.method or most_faithful()
        models = [m for m in args.models.split(",") if m]
        rows = []
        for holders in args.holder_counts:
            rows += run_fleet(holders, models, args)
            # After each fleet: a larger fleet that fails later keeps the rows before it.
            args.results.write_text(json.dumps(to_json(rows), indent=2) + "\n")
    chart(rows, args.chart)
    if args.json:
        print(json.dumps(to_json(rows), indent=2))
        return 0
    methods = ", ".join(sorted({r.method for r in rows}))
    print(f"limits: {methods}; results: {args.results}; chart: {args.chart}")
    print(table(rows))
    print()
    print(rows_table(rows))
    return 0


if __name__ == "__main__":
    exit_on_sigterm()  # a stopped run stops the broker and agents it started
    sys.exit(main())
