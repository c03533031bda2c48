"""The demo's job on links that bind: where splitting it stops paying, measured.

The fleet is the demo's (``edgetrain demo``'s default ``--fleet``): three Raspberry Pi
4s (``rpi4-4gb``) holding a third of ``digits`` each, and a laptop that holds nothing,
each an agent process on this machine emulating its catalogue device as the demo's do
(:class:`~coordinator.local.fleet.LocalFleet`: its compute slowed in software to the
device's speed relative to the laptop, on an owned secure broker), with every link
shaped to the rate of the row (``--link-mbps``: the agent's own token bucket, each
way, which it announces). The job is the demo's
(:func:`coordinator.local.demo.job_body`: ``cnn-digits`` at width 64, labels local),
at ``--microbatches``. For each rate it runs, one after another:

- ``holders alone``: every unit on the holders together, data-parallel, no helper;
- ``split fp32``: the U-shaped split (holders, laptop, holders) with exact links. It
  is the plan the planner makes for the fp32 job at the rate where it splits; where
  it does not (``planner`` false), the split its search found and its prediction
  passed over ([Note: the split that does not pay]), else the split of the fastest
  rate, run anyway to show what the split costs there;
- ``split auto``: the job with ``codec: auto``, as the planner plans it (its links'
  codecs in ``codecs``).

The plans are the engine's (:func:`~coordinator.engine.engine.plan_over`), priced as the
coordinator prices a job by default (``unit_times: devices``): each agent first times
the model's units itself. For each run: the planner's prediction
(:func:`coordinator.planner.predict.predict` on those units, the holders' shares fixed
by their data), the
measured samples/s (steady state: stage 0's steps after ``--warmup``,
:func:`bench.hybrid.measure`), the bytes every device sent per sample trained, and the
share of the step on links and group sums, predicted and measured (the anatomy's
``link`` and ``group_sum``). The table says, per rate, which the planner runs, and
the rate below which the measured split fell behind the holders alone next to the
rate the planner predicts (:func:`coordinator.engine.links.split_stops_paying`, on
the first fleet's announced profiles).

    .venv/bin/python bench/demo_links.py [--mbps 1000,300,100,30,10] [--json]
        [--results FILE] [--quick]

``--quick`` runs two rates, one measured step each, and writes to the temporary
directory unless ``--results`` says otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's packages

from bench.siblings import sibling
from coordinator.engine.engine import JobEngine, PlannedJob, job_unit_seconds, plan_over
from coordinator.engine.links import at_links, split_stops_paying
from coordinator.engine.options import JobAccess, RunOptions
from coordinator.engine.spec import JobSpec
from coordinator.local.demo import DemoFleet, job_body
from coordinator.local.fleet import LocalFleet
from coordinator.local.owned import start_owned_broker
from coordinator.planner.anatomy import StepTerms, anatomy, link_share
from coordinator.planner.holders import holder_ends
from coordinator.planner.predict import UnitSeconds, predict
from coordinator.planner.score import Plan, Stage, for_plan, score_plan
from edge.runtime.allocator import tune_malloc
from edge.transport.mqtt import MqttTransport
from edgetrain.cli.signals import exit_on_sigterm

hybrid = sibling("hybrid")

DEMO_FLEET = "rpi4-4gb,rpi4-4gb,rpi4-4gb,laptop"
"""The demo's fleet (``edgetrain demo``'s default ``--fleet``)."""


@dataclass
class Row:
    mbps: float
    strategy: str
    planner: bool
    """Whether the planner runs this for its job at this rate (``holders alone`` for the
    fp32 job where it does not split)."""
    codecs: list[str]
    stages: list[dict[str, Any]]
    predicted_sps: float
    measured_sps: float
    bytes_per_sample: float
    link_share_predicted: float
    link_share_measured: float | None
    steps: int


def job(codec: str, args: argparse.Namespace) -> JobSpec:
    """The demo's job with ``codec``, at the bench's batch and microbatches."""
    body = job_body(1, args.batch_size, args.microbatches, 0.05, codec)
    return JobSpec.model_validate(body)


def _holder_shares(planned: PlannedJob) -> list[float]:
    """Each holder's share of a microbatch (by the data it holds)."""
    assert planned.holders is not None  # a job on local data
    return planned.holders.holders_alone.shares[0]


def predicted(
    planned: PlannedJob, plan: Plan, spec: JobSpec, own: dict[str, UnitSeconds]
) -> tuple[float, float]:
    """``plan``'s predicted samples/s on ``planned``'s problem, priced as the engine
    prices a job (the units each device timed itself, ``own``), and the share of its
    step on links and group sums."""
    units = job_unit_seconds(spec, own)
    fixed = holder_ends(plan, _holder_shares(planned))
    guess = predict(planned.problem, plan, units, fixed_shares=fixed)
    terms = StepTerms.of_prediction(for_plan(planned.problem, plan), guess)
    fractions = anatomy(plan, terms).fractions()
    return guess.throughput_sps, link_share(fractions)


@dataclass(frozen=True)
class Session:
    """What one rate's fleet gave beside its rows."""

    below: float | None
    """The rate below which the planner stops splitting the fp32 job (with a ladder)."""
    split: Plan
    """The fp32 split it ran, on the devices of ``ids``."""
    ids: list[str]
    gflops: list[float]
    """What each device announced, in the fleet's order."""


def _renamed(plan: Plan, old: list[str], new: list[str]) -> Plan:
    """``plan`` with device ``old[i]`` replaced by ``new[i]``."""
    ids = dict(zip(old, new, strict=True))
    stages = [Stage.group([ids[d] for d in st.devices], st.start, st.end) for st in plan.stages]
    return replace(plan, stages=tuple(stages))


def run_rate(
    mbps: float,
    args: argparse.Namespace,
    ladder: list[float] | None = None,
    fast: Session | None = None,
) -> tuple[list[Row], Session]:
    """The demo's fleet with every link at ``mbps``: each strategy of the module, run;
    with a ``ladder`` of rates, also the rate below which the planner stops splitting
    the fp32 job, on the profiles the agents announced. ``fast``: the session of a
    faster rate, whose split runs here where neither the planner nor its search
    splits."""
    fleet_of = DemoFleet.parse(DEMO_FLEET, link_mbps=mbps)
    rows: list[Row] = []
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="edgetrain-links-")))
        owned = start_owned_broker(work / "broker", log_dir=work)
        stack.callback(owned.stop)
        control = MqttTransport(owned.settings())
        control.connect(timeout=15)
        stack.callback(control.close)
        agents = stack.enter_context(
            LocalFleet(len(fleet_of.names), owned, roles=fleet_of.roles(), threads=1)
        )
        announced = agents.wait_online(control)
        fleet = [announced[d] for d in agents.ids]
        speeds = ", ".join(f"{d.gflops:.1f}" for d in fleet)
        print(f"# {mbps:g} Mbit/s: {owned.describe()}; GFLOP/s {speeds}", file=sys.stderr)
        exact, auto = job("fp32", args), job("auto", args)
        # The units each agent times itself, as the coordinator has them priced.
        engine = JobEngine(control, agents, agents, options=RunOptions(access=owned.accounts))
        own = engine.device_units(exact, fleet)
        below = None
        if ladder is not None:
            rungs = [at_links(exact, fleet, r, own) for r in ladder]
            below = split_stops_paying(rungs, lambda r: at_links(exact, fleet, r, own))
        planned = plan_over(exact, fleet, device_units=own)
        coded = plan_over(auto, fleet, device_units=own)
        assert planned.holders is not None
        alone = planned.holders.holders_alone
        split = planned.plan
        if len(split.stages) == 1:  # the planner keeps it home: the split it passed over
            best = planned.holders.best
            if best is not None and len(best.plan.stages) > 1:
                split = best.plan
            elif fast is not None:
                split = _renamed(fast.split, fast.ids, agents.ids)
        running = Agents(control, owned.accounts, own)
        runs = [
            ("holders alone", exact, alone.plan, len(planned.plan.stages) == 1),
            ("split fp32", exact, split, len(planned.plan.stages) > 1),
            ("split auto", auto, coded.plan, True),
        ]
        for strategy, spec, plan, chosen in runs:
            where = coded if spec is auto else planned
            rows.append(_run(running, where, spec, plan, strategy, chosen, mbps, args))
    gflops = [d.gflops for d in fleet]
    return rows, Session(below, split, list(agents.ids), gflops)


@dataclass(frozen=True)
class Agents:
    """A rate's running fleet, as a run needs it."""

    control: MqttTransport
    access: JobAccess | None
    """The broker's accounts, which grant each run its topics."""
    own: dict[str, UnitSeconds]
    """The units each agent timed itself."""


def _run(
    agents: Agents,
    planned: PlannedJob,
    spec: JobSpec,
    plan: Plan,
    strategy: str,
    chosen: bool,
    mbps: float,
    args: argparse.Namespace,
) -> Row:
    sps, share = predicted(planned, plan, spec, agents.own)
    steps = args.warmup + max(
        args.min_steps, min(args.max_steps, math.ceil(args.seconds * sps / spec.batch_size))
    )
    fixed = holder_ends(plan, _holder_shares(planned))
    shares = score_plan(for_plan(planned.problem, plan), plan, fixed_shares=fixed).shares
    run = spec.model_copy(update={"steps": steps, "microbatches": planned.problem.microbatches})
    started = time.perf_counter()
    measured = hybrid.measure(agents.control, run, plan, args.warmup, agents.access, shares)
    fractions = (measured.anatomy or {}).get("fractions")
    links = len(plan.stages) - 1
    row = Row(
        mbps=mbps,
        strategy=strategy,
        planner=chosen,
        codecs=list(plan.codecs) if plan.codecs else [spec.link_codec] * links,
        stages=plan.to_json(shares),
        predicted_sps=sps,
        measured_sps=measured.sps,
        bytes_per_sample=measured.bytes_per_sample,
        link_share_predicted=share,
        link_share_measured=None if fractions is None else link_share(fractions),
        steps=steps,
    )
    print(
        f"# {mbps:g} Mbit/s {strategy}: measured {measured.sps:.1f} predicted {sps:.1f} "
        f"samples/s, {measured.bytes_per_sample:.0f} B/sample, {steps} steps in "
        f"{time.perf_counter() - started:.0f} s",
        file=sys.stderr,
    )
    return row


# -- reporting ------------------------------------------------------------------------


def measured_crossover(rows: list[Row]) -> float | None:
    """The slowest rate at which the measured fp32 split beat the holders alone, where a
    slower rate then measured it behind (``0``: it never fell behind; ``None``: it never
    led)."""
    by_rate: dict[float, dict[str, Row]] = {}
    for r in rows:
        by_rate.setdefault(r.mbps, {})[r.strategy] = r
    ahead = [
        (mbps, got["split fp32"].measured_sps > got["holders alone"].measured_sps)
        for mbps, got in sorted(by_rate.items(), reverse=True)
        if {"split fp32", "holders alone"} <= set(got)
    ]
    if not ahead or not ahead[0][1]:
        return None
    for (fast, lead), (_, lead_below) in itertools.pairwise(ahead):
        if lead and not lead_below:
            return fast
    return 0.0


def table(rows: list[Row], predicted_below: float | None) -> str:
    head = (
        "| link Mbit/s | run | the planner's | codecs | predicted sps | measured sps | "
        "measured/predicted | kB/sample sent | on links, predicted | measured |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        share = "-" if r.link_share_measured is None else f"{r.link_share_measured:.0%}"
        ratio = r.measured_sps / r.predicted_sps if r.predicted_sps > 0 else math.nan
        lines.append(
            f"| {r.mbps:g} | {r.strategy} | {'yes' if r.planner else 'no'} | "
            f"{','.join(r.codecs) or '-'} | {r.predicted_sps:.0f} | {r.measured_sps:.0f} | "
            f"{ratio:.2f} | {r.bytes_per_sample / 1e3:.1f} | {r.link_share_predicted:.0%} | "
            f"{share} |"
        )
    lines += ["", _verdict(predicted_below, measured_crossover(rows), min(r.mbps for r in rows))]
    return "\n".join(lines)


def _verdict(predicted: float | None, measured: float | None, slowest: float) -> str:
    """The predicted and the measured rate where the fp32 split stops paying, in words."""
    if predicted is None:
        said = "the planner splits the fp32 job at no rate of the ladder"
    elif predicted == 0:
        said = "the planner splits the fp32 job at every rate of the ladder"
    else:
        said = f"the planner stops splitting the fp32 job below {predicted:.0f} Mbit/s (bisected)"
    if measured is None:
        return f"{said}; measured, the split never led the holders alone"
    if measured == 0:
        return f"{said}; measured, the split led the holders alone at every rate, to {slowest:g}"
    return f"{said}; measured, the split led the holders alone down to {measured:g} Mbit/s"


# -- main -----------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--mbps", default="1000,300,100,30,10", help="link rates, one fleet each")
    parser.add_argument("--batch-size", type=int, default=48)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1, help="steps left out of the rate")
    parser.add_argument("--seconds", type=float, default=4.0, help="steady state per run")
    parser.add_argument("--min-steps", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--quick", action="store_true", help="two rates, one measured step")
    parser.add_argument("--results", type=Path, help="the JSON file written")
    args = parser.parse_args(argv)
    results = Path(__file__).resolve().parent / "results"
    if args.quick:
        args.mbps = "300,10"
        args.warmup, args.min_steps, args.max_steps, args.seconds = 1, 1, 1, 0.0
        results = Path(tempfile.gettempdir())
    args.rates = [float(x) for x in args.mbps.split(",") if x.strip()]
    if not args.rates or not all(math.isfinite(r) and r > 0 for r in args.rates):
        parser.error("--mbps: positive rates, comma-separated")
    stem = "demo-links-quick" if args.quick else "demo-links"
    args.results = args.results or results / f"{stem}.json"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tune_malloc()  # as the agents do
    rows: list[Row] = []
    first: Session | None = None
    gflops: dict[str, list[float]] = {}
    for mbps in sorted(args.rates, reverse=True):
        got, session = run_rate(mbps, args, None if first else args.rates, first)
        rows += got
        first = first or session
        gflops[f"{mbps:g}"] = session.gflops
    assert first is not None
    below = first.below
    out = {
        "rows": [asdict(r) for r in rows],
        "split_stops_paying_below_mbps": below,
        "gflops": gflops,
    }
    args.results.write_text(json.dumps(out, indent=2) + "\n")
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"results: {args.results}")
    print(table(rows, below))
    return 0


if __name__ == "__main__":
    exit_on_sigterm()  # a stopped run stops the broker and agents it started
    sys.exit(main())
