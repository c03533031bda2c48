"""What edgetrain's plans are worth on a heterogeneous fleet: FTPipeHD's headline experiment.

Four emulated devices (the testbed, :mod:`coordinator.testbed`) whose compute
spans ``SPAN`` x from the fastest to the slowest (geometrically: 1, SPAN^-1/3,
SPAN^-2/3, 1/SPAN of the fastest), each on a 1 Gbit/s link with 0.5 ms one way,
train a zoo model for a few steps under five plans, one after another on the same
fleet:

- ``single``: the best single device alone (the fastest);
- ``even``: all four devices, the same number of units each;
- ``pipedream``: all four, cuts balancing FLOPs as if the devices were identical;
- ``ftpipehd``: all four, cuts chosen with each device's real speed;
- ``edgetrain``: the planner's plan (any subset, any order).

For each: the number of stages, the measured samples/s (steady state: stage 0's
step times after the first ``--warmup`` steps), the planner's predicted samples/s
(the spec's score of that plan), and measured / predicted. Fleets: spans of 3x,
10x and 30x, and 10x with the second-fastest device's link cut to 10 Mbit/s.

Where two strategies choose the same plan (edgetrain's plan *is* the single
device when no split pays), the table, the JSON (``same_plan_as``) and the chart
(hatched bar) say so: their measured ratio is then the same plan run twice, not
a comparison of two plans.

The planning problem is *calibrated*: every unit's FLOPs are replaced by its
measured single-core time inside real training steps on this machine x this
machine's single-core matmul rate (PipeDream's profiler: measured unit times,
not FLOP counts; see :mod:`edge.runtime.unit_times`), and every
device announces the speed the testbed really gives it (its CPU share x that
rate). So a prediction can be compared with a measurement at all.

    .venv/bin/python bench/heterogeneity.py [--models vgg11,gpt-mini] [--spans 10,3,30,10cut]
        [--method auto|kernel|software] [--json] [--chart bench/results/heterogeneity.png]
        [--from-json bench/results/heterogeneity.json]

The run takes about 9 minutes on 2 cores; its last results are in
bench/results/. ``--from-json`` runs nothing: it renders the table, the chart
and the JSON again from the rows a ``--json`` run printed. Kernel limits
(cgroups, namespaces, ``tc``) need root; otherwise the testbed's software
throttle is used and the table says so.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's packages

from coordinator.access.accounts import BrokerAccounts
from coordinator.engine.options import RunOptions
from coordinator.engine.runners import run_on_agents
from coordinator.engine.spec import JobSpec
from coordinator.planner.baselines import even_split, ftpipehd, pipedream, single_device
from coordinator.planner.score import Plan, score_plan
from coordinator.planner.simulator import simulate
from coordinator.planner.solve import plan_problem
from coordinator.testbed.limits import METHODS
from coordinator.testbed.testbed import StartOptions, Testbed
from edge.models.unit_costs import profile_model
from edge.models.zoo import get_model
from edge.problem import DeviceSpec, PlanningProblem, UnitSpec
from edge.runtime.allocator import tune_malloc
from edge.runtime.unit_times import Timing, UnitTime, measure_unit_times
from edge.transport.mqtt import MqttTransport
from edgetrain.cli.signals import exit_on_sigterm

STRATEGIES = ("single", "even", "pipedream", "ftpipehd", "edgetrain")
FASTEST_GFLOPS = 100.0  # catalogue-like speed of the fastest device; only ratios matter
LINK_MBPS, LATENCY_MS, CUT_MBPS = 1000.0, 0.5, 10.0
MEMORY = 4 << 30


@dataclass
class Row:
    model: str
    fleet: str
    strategy: str
    stages: list[dict[str, Any]]
    predicted_sps: float
    simulated_sps: float
    measured_sps: float
    steps: int
    method: str
    compute_s: list[float]
    """Per stage, measured compute seconds per step (mean over the steady steps)."""
    predicted_compute_s: list[float]
    """Per stage, the plan's ``M x T_s``."""

    @property
    def ratio(self) -> float:
        return self.measured_sps / self.predicted_sps if self.predicted_sps > 0 else math.nan

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    @property
    def cuts(self) -> list[tuple[str, int, int]]:
        """The plan without its codecs: which device runs which units."""
        return [(s["device"], s["layers"][0], s["layers"][1]) for s in self.stages]


DERIVED = ("ratio", "n_stages", "same_plan_as")
"""Keys of a JSON row that :func:`to_json` computes from the others."""


def same_plan_as(rows: list[Row], row: Row) -> list[str]:
    """The other strategies of ``row``'s model and fleet whose plan is ``row``'s."""
    return [
        r.strategy
        for r in rows
        if (r.model, r.fleet) == (row.model, row.fleet)
        and r.strategy != row.strategy
        and r.cuts == row.cuts
    ]


def to_json(rows: list[Row]) -> list[dict[str, Any]]:
    """The rows as ``--json`` prints them: every field, then the derived ones."""
    return [
        asdict(r)
        | {"ratio": r.ratio, "n_stages": r.n_stages, "same_plan_as": same_plan_as(rows, r)}
        for r in rows
    ]


def from_json(items: list[dict[str, Any]]) -> list[Row]:
    """Rows back from :func:`to_json`'s output (or an older one without the derived keys)."""
    return [Row(**{k: v for k, v in item.items() if k not in DERIVED}) for item in items]


def fleet_devices(span: float) -> list[DeviceSpec]:
    """Four devices, fastest first, spanning ``span`` x geometrically."""
    return [
        DeviceSpec(
            id=f"dev{i}",
            gflops=FASTEST_GFLOPS * span ** (-i / 3),
            memory_bytes=MEMORY,
            bandwidth_mbps=LINK_MBPS,
            latency_ms=LATENCY_MS,
        )
        for i in range(4)
    ]


def calibrated_layers(
    model: str,
    batch_size: int,
    microbatches: int,
    core_gflops: float,
    steps: int = 5,
    times: Sequence[UnitTime] | None = None,
) -> list[UnitSpec]:
    """The model's units with FLOPs = measured single-core seconds x ``core_gflops``.

    Seconds come from :func:`edge.runtime.unit_times.measure_unit_times`: each unit
    inside real training steps (loss and optimizer included), one torch thread;
    ``times`` when the caller measured them so already.
    """
    spec = get_model(model)
    if times is None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            times = measure_unit_times(
                spec, batch_size, microbatches, timing=Timing(steps=steps, warmup=1)
            )
        finally:
            torch.set_num_threads(threads)
    counted = profile_model(spec, 2, timing=False).units  # bytes per sample
    rate = core_gflops * 1e9 * microbatches / batch_size  # per sample, per second of time
    return [
        UnitSpec(
            name=u.name,
            fwd_flops=t.fwd_s * rate,
            bwd_flops=t.bwd_s * rate,
            param_bytes=u.param_bytes,
            out_bytes=u.out_bytes,
            act_bytes=u.act_bytes,
        )
        for u, t in zip(counted, times, strict=True)
    ]


def plans(problem: PlanningProblem) -> dict[str, Plan]:
    """The plan of every strategy; the fleets here always have a feasible one."""
    best = plan_problem(problem).plan
    if best is None:
        raise SystemExit("the planner found no feasible plan for this fleet")
    return {
        "single": single_device(problem),
        "even": even_split(problem),
        "pipedream": pipedream(problem),
        "ftpipehd": ftpipehd(problem),
        "edgetrain": best,
    }


def measure(
    control: MqttTransport,
    spec: JobSpec,
    plan: Plan,
    warmup: int,
    access: BrokerAccounts | None = None,
) -> tuple[float, list[float]]:
    """Steady-state samples/s of ``plan`` (stage 0's step times after ``warmup`` steps)
    and each stage's mean compute seconds per steady step."""
    result = run_on_agents(spec, plan, control, options=RunOptions(timeout_s=1800, access=access))
    steady = [r for r in result.reports if r.step >= warmup]
    step_s = statistics.mean(r.step_s for r in steady if r.stage == 0)
    compute = [
        statistics.mean(r.compute_s for r in steady if r.stage == s)
        for s in range(len(plan.stages))
    ]
    return spec.batch_size / step_s, compute


def run_fleet(
    name: str, span: float, cut: bool, models: list[str], args: argparse.Namespace
) -> list[Row]:
    devices = fleet_devices(span)
    links = {devices[1].id: CUT_MBPS} if cut else None
    rows: list[Row] = []
    with (
        tempfile.TemporaryDirectory(prefix="edgetrain-hetero-") as state,
        Testbed.up(
            devices,
            state_dir=Path(state),
            links=links,
            start=StartOptions(method=args.method, coordinator=False),
        ) as tb,
    ):
        print(f"# fleet {name}: limits {tb.method} ({tb.method_reason})", file=sys.stderr)
        control = MqttTransport(tb.login())
        control.connect(30)
        try:
            for model in models:

                def problem(steps: int, model: str = model) -> PlanningProblem:
                    layers = calibrated_layers(
                        model, args.batch_size, args.microbatches, tb.core_gflops, steps
                    )
                    return PlanningProblem(
                        version=1,
                        batch_size=args.batch_size,
                        microbatches=args.microbatches,
                        layers=layers,
                        devices=[tb.announced[d.id] for d in devices],
                    )

                for strategy, plan in plans(problem(5)).items():
                    # This host's speed drifts by tens of percent over minutes: price each
                    # plan with unit times measured just before it runs.
                    now = problem(3)
                    score = score_plan(now, plan)
                    sim = simulate(now, plan, "1f1b")
                    # Enough steps for about --seconds of steady state, within bounds.
                    steps = args.warmup + max(
                        3, min(args.max_steps, math.ceil(args.seconds / score.step_time_s))
                    )
                    spec = JobSpec(
                        model=model,
                        steps=steps,
                        batch_size=args.batch_size,
                        microbatches=args.microbatches,
                        seed=0,
                    )
                    started = time.perf_counter()
                    measured, compute = measure(control, spec, plan, args.warmup, tb.accounts)
                    predicted_compute = [t * args.microbatches for t in score.compute_s]
                    row = Row(
                        model,
                        name,
                        strategy,
                        plan.to_json(),
                        score.throughput_sps,
                        args.batch_size / sim.step_time_s,
                        measured,
                        steps,
                        tb.method,
                        compute,
                        predicted_compute,
                    )
                    rows.append(row)
                    print(
                        f"# {model} {name} {strategy}: measured {measured:.1f} predicted "
                        f"{score.throughput_sps:.1f} ({row.ratio:.2f}) in "
                        f"{time.perf_counter() - started:.0f} s; compute/step per stage "
                        f"{[round(c, 3) for c in compute]} predicted "
                        f"{[round(c, 3) for c in predicted_compute]}",
                        file=sys.stderr,
                    )
        finally:
            control.close()
    return rows


def chart(rows: list[Row], path: Path) -> None:
    """Grouped bars: measured samples/s per plan, per fleet, one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter
    from matplotlib.transforms import blended_transform_factory

    models = list(dict.fromkeys(r.model for r in rows))
    fleets = list(dict.fromkeys(r.fleet for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.8), squeeze=False)
    width = 0.8 / len(STRATEGIES)
    colours = ["#9e9e9e", "#f4a261", "#e9c46a", "#2a9d8f", "#264653"]
    inks = ["white", "black", "black", "white", "white"]  # legible on each colour
    for ax, model in zip(axes[0], models, strict=True):
        foot = blended_transform_factory(ax.transData, ax.transAxes)
        for k, strategy in enumerate(STRATEGIES):
            xs, got = [], []
            for i, fleet in enumerate(fleets):
                found = [
                    r for r in rows if (r.model, r.fleet, r.strategy) == (model, fleet, strategy)
                ]
                if found:
                    xs.append(i + (k - (len(STRATEGIES) - 1) / 2) * width)
                    got.append(found[0])
            # A plan another strategy also chose (edgetrain's single device): hatched.
            hatches = [
                "///" if strategy == "edgetrain" and same_plan_as(rows, r) else "" for r in got
            ]
            measured = [r.measured_sps for r in got]
            ax.bar(
                xs,
                measured,
                width,
                label=strategy,
                color=colours[k],
                hatch=hatches,
                edgecolor="white",
            )
            predicted = [r.predicted_sps for r in got]
            ax.scatter(xs, predicted, marker="_", s=120, color="black", zorder=3)
            # The number of stages of each plan, at the foot of its bar.
            for x, r in zip(xs, got, strict=True):
                label = str(r.n_stages)
                ax.text(x, 0.015, label, transform=foot, ha="center", fontsize=8, color=inks[k])
        ax.set_xticks(range(len(fleets)), fleets)
        ax.set_ylabel("samples/s, log scale (bar: measured; tick: predicted)")
        ax.set_title(f"{model}: four devices, compute spanning N x (in a bar: its stages)")
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    alike = sorted({s for r in rows if r.strategy == "edgetrain" for s in same_plan_as(rows, r)})
    if alike:
        handles.append(Patch(facecolor=colours[-1], hatch="///", edgecolor="white"))
        labels.append(f"edgetrain = {' or '.join(alike)} (the same plan)")
    fig.legend(handles, labels, loc="lower center", ncol=len(handles), frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table, then edgetrain against each other plan per fleet."""
    lines = [
        "| model | fleet | plan | stages | devices[units] | measured sps | predicted sps "
        "| measured/predicted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cuts = " ".join(f"{d}[{a}:{b}]" for d, a, b in r.cuts)
        same = same_plan_as(rows, r)
        plan = f"{r.strategy} (= {', '.join(same)})" if same else r.strategy
        lines.append(
            f"| {r.model} | {r.fleet} | {plan} | {r.n_stages} | {cuts} | {r.measured_sps:.1f} | "
            f"{r.predicted_sps:.1f} | {r.ratio:.2f} |"
        )
    lines.append("")
    for model in dict.fromkeys(r.model for r in rows):
        for fleet in dict.fromkeys(r.fleet for r in rows):
            got = {r.strategy: r for r in rows if (r.model, r.fleet) == (model, fleet)}
            if "edgetrain" in got:
                e = got["edgetrain"]
                same = same_plan_as(rows, e)
                vs = ", ".join(
                    f"{e.measured_sps / got[s].measured_sps:.2f}x {s}"
                    + (" (the same plan, run twice)" if s in same else "")
                    for s in STRATEGIES[:-1]
                    if s in got
                )
                lines.append(f"- {model}, {fleet}: edgetrain ({_stages(e)}) measured = {vs}")
    return "\n".join(lines)


def _stages(row: Row) -> str:
    if row.n_stages > 1:
        return f"{row.n_stages} stages"
    return f"1 stage: {row.cuts[0][0]} alone"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="vgg11,gpt-mini")
    parser.add_argument("--spans", default="10,3,30,10cut", help="N or Ncut (a 10 Mbit/s link)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the rate")
    parser.add_argument("--seconds", type=float, default=6.0, help="steady state per run")
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--method", choices=METHODS, default="auto")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    results = Path(__file__).resolve().parent / "results"
    parser.add_argument("--chart", type=Path, default=results / "heterogeneity.png")
    parser.add_argument(
        "--from-json", type=Path, help="render the rows of a --json run's output; run nothing"
    )
    args = parser.parse_args()
    rows: list[Row] = []
    if args.from_json is not None:
        rows = from_json(json.loads(args.from_json.read_text()))
    else:
        tune_malloc()  # as the agents do: calibration and runs allocate alike
        models = [m.strip() for m in args.models.split(",") if m.strip()]
        for item in args.spans.split(","):
            item = item.strip()
            cut = item.endswith("cut")
            span = float(item.removesuffix("cut"))
            name = f"{span:g}x" + (", cut link" if cut else "")
            rows += run_fleet(name, span, cut, models, args)
    chart(rows, args.chart)
    if args.json:
        print(json.dumps(to_json(rows), indent=2))
        return 0
    print(f"limits: {rows[0].method}; chart: {args.chart}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    exit_on_sigterm()  # a stopped run stops the broker and agents it started
    sys.exit(main())
