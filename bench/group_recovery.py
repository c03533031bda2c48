"""Recovering from a group member's death (hand-over) against a one-device stage's (rollback).

The same job on local agents (:class:`~coordinator.local.fleet.LocalFleet`, a real
Mosquitto, each agent slowed in software by ``--slowdown`` so that a step costs what
it would on a small device), every stage replicating its state every ``R`` steps,
one agent SIGKILLed once step ``K`` is reported:

- **one-device stage**: an even pipeline of three one-device stages; stage 1's device
  dies and takes its units along, so the run rolls back to the newest replicas
  and redoes the steps since (up to ``R``), as FTPipeHD does;
- **group member**: the same three stages, stage 1 on a group of two; one member
  dies, its co-member holds the units, and the stages hand over the state of the
  step they all reached ([Note: a group member dies] in
  :mod:`coordinator.engine.handover`): nothing rolls back.

Both re-plan the same way (the same stages, on the devices still alive). Per row:
seconds from detecting the death to the first step of the resumed run (``resume``),
to the first loss beyond the newest one reported before the death (``caught up``:
what the job lost, redone steps included), the steps redone, and how far the final
weights are from a single-device run without faults.

    .venv/bin/python bench/group_recovery.py [--model gpt-mini] [--rounds 2]
        [--slowdown 4] [--json] [--save bench/results/group_recovery.json]

About two minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's packages

from bench.recovery import even_plan, max_rel_diff
from coordinator.engine.faults import FaultInjector, parse_fault
from coordinator.engine.options import RunOptions
from coordinator.engine.resilient import Resilience, ResilientRun
from coordinator.engine.runners import run_inprocess
from coordinator.engine.spec import JobSpec
from coordinator.local.broker import start_broker
from coordinator.local.fleet import AgentRoles, LocalFleet
from coordinator.planner.score import Plan, Stage
from edge.models.zoo import get_model
from edge.transport.mqtt import MqttSettings, MqttTransport
from edgetrain.cli.signals import exit_on_sigterm

HEARTBEAT_TIMEOUT_S = 3.0
STEPS, KILL_STEP, EVERY = 16, 6, 4


@dataclass
class Row:
    case: str
    resume_s: float
    caught_up_s: float
    redone_steps: int
    rolled_back_steps: int
    max_rel_diff: float


def _plan(devices: list[str], sizes: list[int], n_units: int) -> Plan:
    cuts = [round(i * n_units / len(sizes)) for i in range(len(sizes) + 1)]
    stages, at = [], 0
    for s, size in enumerate(sizes):
        stages.append(Stage.group(devices[at : at + size], cuts[s], cuts[s + 1]))
        at += size
    return Plan(tuple(stages))


def _survivors(plan: Plan, alive: list[str]) -> Plan:
    """The same stages on the devices still alive; when a stage lost every device, an
    even split over the survivors (as ``bench/recovery.py`` re-plans)."""
    groups = [[d for d in st.devices if d in alive] for st in plan.stages]
    if all(groups):
        return Plan(
            tuple(
                Stage.group(g, st.start, st.end) for g, st in zip(groups, plan.stages, strict=True)
            )
        )
    return even_plan(alive, plan.stages[-1].end)


def run_case(
    url: str, spec: JobSpec, sizes: list[int], fault: str, slowdown: float, reference: Any
) -> Row:
    n_units = get_model(spec.model).num_units
    control = MqttTransport(MqttSettings(url=url))
    control.connect(timeout=15)
    try:
        with LocalFleet(
            sum(sizes), url, threads=1, roles=AgentRoles(slowdowns=[slowdown] * sum(sizes))
        ) as fleet:
            fleet.wait_online(control, timeout=120)
            plan = _plan(list(fleet.ids), sizes, n_units)
            injector = FaultInjector([parse_fault(fault)], lambda _f, device: fleet.kill(device))
            got = ResilientRun(
                spec,
                control,
                lambda alive: _survivors(plan, alive),
                list(fleet.ids),
                resilience=Resilience(replicate_every=EVERY, faults=injector),
                options=RunOptions(heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, timeout_s=600),
            ).run(plan)
    finally:
        control.close()
    if len(got.recovery_s) != 1 or got.steps_completed != spec.steps:
        raise RuntimeError(f"{fault}: expected one recovery and every step: {got.to_json()}")
    failure = next(e for e in got.events if e["type"] == "failure")
    detected = failure["detected_at"]
    first, second = [e for e in got.events if e["type"] == "attempt"]
    before = [r for r in got.result.reports if r.job == first["job"] and r.ts <= detected]
    newest = max((r.step for r in before if r.loss is not None), default=-1)
    after = [r.ts for r in got.result.reports if r.job == second["job"] and r.step > newest]
    recovery = next(e for e in got.events if e["type"] == "recovery")
    return Row(
        case="group member" if recovery.get("handed_over") else "one-device stage",
        resume_s=got.recovery_s[0],
        caught_up_s=min(after) - detected if after else float("nan"),
        redone_steps=max(0, newest + 1 - second["first_step"]),
        rolled_back_steps=got.rolled_back_steps,
        max_rel_diff=max_rel_diff(got.result.weights, reference),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-mini")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--slowdown", type=float, default=4.0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--save", type=Path)
    args = parser.parse_args(argv)
    spec = JobSpec(model=args.model, steps=STEPS, batch_size=16, microbatches=4, seed=5)
    n_units = get_model(args.model).num_units
    reference = run_inprocess(spec, Plan.of(("ref", 0, n_units))).weights
    cases = [([1, 1, 1], f"kill:1@{KILL_STEP}"), ([1, 2, 1], f"kill:1.1@{KILL_STEP}")]
    rows: list[Row] = []
    with start_broker() as broker:
        for _ in range(args.rounds):
            for sizes, fault in cases:
                rows.append(run_case(broker.url, spec, sizes, fault, args.slowdown, reference))
    summary = {}
    for name in ("one-device stage", "group member"):
        mine = [r for r in rows if r.case == name]
        summary[name] = {
            "resume_s": statistics.median(r.resume_s for r in mine),
            "caught_up_s": statistics.median(r.caught_up_s for r in mine),
            "redone_steps": statistics.median(r.redone_steps for r in mine),
            "rolled_back_steps": max(r.rolled_back_steps for r in mine),
            "max_rel_diff": max(r.max_rel_diff for r in mine),
        }
    ratio = summary["one-device stage"]["caught_up_s"] / summary["group member"]["caught_up_s"]
    out = {
        "model": args.model,
        "steps": STEPS,
        "kill_step": KILL_STEP,
        "replicate_every": EVERY,
        "slowdown": args.slowdown,
        "rounds": [asdict(r) for r in rows],
        "median": summary,
        "caught_up_speedup": ratio,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if args.save:
        args.save.write_text(json.dumps(out, indent=2) + "\n")
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{args.model}, {STEPS} steps, kill at step {KILL_STEP}, replicas every {EVERY}")
    print(f"{'who dies':<18} {'resume s':>9} {'caught up s':>12} {'redone':>7} {'max diff':>9}")
    for name, s in summary.items():
        print(
            f"{name:<18} {s['resume_s']:>9.2f} {s['caught_up_s']:>12.2f} "
            f"{s['redone_steps']:>7.0f} {s['max_rel_diff']:>9.1e}"
        )
    print(f"a group member's death is caught up {ratio:.2f}x faster")
    return 0


if __name__ == "__main__":
    exit_on_sigterm()  # a stopped run stops the broker and agents it started
    sys.exit(main())
