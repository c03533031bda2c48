"""Recovery after a device dies versus restarting the job from its last checkpoint.

Each model trains on three local agents (:class:`~coordinator.local.fleet.LocalFleet`,
a real Mosquitto) with every stage replicating its state every ``R`` steps, and
the agent of stage 1 is SIGKILLed once step ``K`` is reported. Two ways on from there,
one after the other on fresh fleets, the same job, the same seed:

- **recovery** (what edgetrain does, :class:`coordinator.engine.resilient.ResilientRun`):
  the death is detected (last will), the survivors' stages are cancelled, the
  job is re-planned over them and resumes from the newest step the replicas cover.
- **restart** (what a job without recovery would do): the death is detected the
  same way (:class:`~coordinator.engine.watch.DeviceWatch`), the job is torn down
  (every agent stopped), the survivors' agents start again (new processes, torch
  imported anew), come online and announce their profiles, the plan is made over
  them, each stage is restored from the checkpoint (the replicas, reloaded from
  the folder they were written to) and the job runs to its end.

Both re-plan with the same plan function (an even split over the devices alive;
the dead device stays dead in both) and redo the same steps, so what differs is
exactly the restart's teardown, process start and set-up. Reported per model:
the number of stages of the plans run (before the kill -> after it), seconds
from detection to the first step of the resumed run (``recovery s`` /
``restart s``) and from the kill, the total wall time of each run (from the
first attempt's start to the final weights), and how far each run's final
weights are from a single-device run without faults (both should be ~1e-6).

    .venv/bin/python bench/recovery.py [--models cnn-digits,gpt-mini] [--rounds N]
        [--json] [--save bench/results/recovery.json]

About two minutes on 2 cores; the last results are in bench/results/recovery.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's packages

from coordinator.engine.faults import FaultInjector, parse_fault
from coordinator.engine.monitor import JobAborted, JobFailed
from coordinator.engine.options import JobHooks, RunOptions
from coordinator.engine.replicas import ReplicaStore
from coordinator.engine.resilient import Resilience, ResilientRun
from coordinator.engine.runners import Attempt, run_inprocess, run_on_agents
from coordinator.engine.spec import JobSpec, new_job_id
from coordinator.engine.watch import DeviceWatch
from coordinator.local.broker import start_broker
from coordinator.local.fleet import LocalFleet
from coordinator.planner.score import Plan
from edge.models.zoo import get_model
from edge.transport.mqtt import MqttSettings, MqttTransport
from edge.wire.messages import StepReport
from edgetrain.cli.signals import exit_on_sigterm

HEARTBEAT_TIMEOUT_S = 3.0
AGENTS = 3


@dataclass(frozen=True)
class Case:
    model: str
    steps: int
    kill_step: int
    replicate_every: int
    batch_size: int = 16
    microbatches: int = 4
    seed: int = 5

    def spec(self) -> JobSpec:
        return JobSpec(
            model=self.model,
            steps=self.steps,
            batch_size=self.batch_size,
            microbatches=self.microbatches,
            seed=self.seed,
        )


CASES = {
    "cnn-digits": Case("cnn-digits", steps=40, kill_step=21, replicate_every=4),
    "gpt-mini": Case("gpt-mini", steps=30, kill_step=13, replicate_every=4),
}


@dataclass
class Run:
    """One way on after the kill; times in seconds."""

    resume_s: float
    """From detecting the death to the first step report of the resumed run."""
    kill_to_resume_s: float
    wall_s: float
    """From the first attempt's start to the final weights."""
    resumed_at: int
    """The step training resumed from (the newest checkpoint)."""
    max_rel_diff: float
    """Largest |w - w_ref| / max|w_ref| over the final tensors, against no faults."""
    parts: dict[str, float]
    """Restart only: where the time went (teardown, agents online, plan and restore)."""
    stages: list[int]
    """The number of stages of each plan the run ran, in order: before the kill, after it."""


def even_plan(devices: list[str], n_units: int) -> Plan:
    """``devices`` (at most one per unit) each given a contiguous, near-equal share."""
    k = min(len(devices), n_units)
    cuts = [round(i * n_units / k) for i in range(k + 1)]
    return Plan.of(*((devices[i], cuts[i], cuts[i + 1]) for i in range(k)))


def max_rel_diff(weights: dict[str, Any], reference: dict[str, Any]) -> float:
    """Largest difference of any tensor, relative to that reference tensor's largest entry."""
    if set(weights) != set(reference):
        return float("inf")
    return max(
        (weights[k] - ref).abs().max().item() / max(ref.abs().max().item(), 1e-12)
        for k, ref in reference.items()
    )


def _control(url: str) -> MqttTransport:
    control = MqttTransport(MqttSettings(url=url))
    control.connect(timeout=15)
    return control


def run_recovery(case: Case, url: str, reference: dict[str, Any]) -> Run:
    """The job under :class:`ResilientRun`; the kill is recovered from."""
    n_units = get_model(case.model).num_units
    control = _control(url)
    try:
        with LocalFleet(AGENTS, url, threads=1) as fleet:
            fleet.wait_online(control, timeout=120)
            injector = FaultInjector(
                [parse_fault(f"kill:1@{case.kill_step}")], lambda _f, device: fleet.kill(device)
            )
            stages: list[int] = []
            started = time.perf_counter()
            got = ResilientRun(
                case.spec(),
                control,
                lambda alive: even_plan(alive, n_units),
                list(fleet.ids),
                resilience=Resilience(replicate_every=case.replicate_every, faults=injector),
                options=RunOptions(heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, timeout_s=600),
                hooks=JobHooks(
                    on_attempt=lambda _job, plan, _first: stages.append(len(plan.stages))
                ),
            ).run(even_plan(fleet.ids, n_units))
            wall = time.perf_counter() - started
    finally:
        control.close()
    if len(got.recovery_s) != 1 or got.steps_completed != case.steps:
        raise RuntimeError(f"{case.model}: expected one recovery and every step: {got.to_json()}")
    resumed = next(e for e in got.events if e["type"] == "resumed")
    recovery = next(e for e in got.events if e["type"] == "recovery")
    kill_to_resume = resumed["ts"] - injector.fired[0][2]
    diff = max_rel_diff(got.result.weights, reference)
    return Run(got.recovery_s[0], kill_to_resume, wall, recovery["rollback_to"], diff, {}, stages)


def _first_attempt(
    case: Case, control: MqttTransport, fleet: LocalFleet, replicas: ReplicaStore
) -> tuple[float, float, int, int]:
    """Run until the kill is detected: (kill time, detection time, steps done, stages)."""
    n_units = get_model(case.model).num_units
    plan = even_plan(fleet.ids, n_units)
    current = [st.device for st in plan.stages]
    injector = FaultInjector(
        [parse_fault(f"kill:1@{case.kill_step}")], lambda _f, device: fleet.kill(device)
    )
    injector.use_plan(current)
    losses: dict[int, float] = {}

    def on_step(report: StepReport) -> None:
        if report.loss is not None:
            losses[report.step] = report.loss
        injector.on_step(report)

    job = new_job_id()
    replicas.accept(job, [(st.start, st.end) for st in plan.stages])
    with DeviceWatch(control, fleet.ids, HEARTBEAT_TIMEOUT_S) as watch:

        def abort() -> str | None:
            dead = watch.dead_among(current)
            return f"device {dead[0]} died" if dead else None

        try:
            run_on_agents(
                case.spec(),
                plan,
                control,
                job=job,
                on_step=on_step,
                options=RunOptions(timeout_s=600),
                attempt=Attempt(replicate_every=case.replicate_every, abort=abort),
            )
            raise RuntimeError(f"{case.model}: the job ended without the kill")
        except JobAborted:
            pass
        except JobFailed:  # a neighbour's failure first: wait for the death to show
            deadline = time.monotonic() + HEARTBEAT_TIMEOUT_S + 0.5
            while not watch.dead_among(current) and time.monotonic() < deadline:
                time.sleep(0.05)
            if not watch.dead_among(current):
                raise
        dead = watch.dead_among(current)
        done = max(losses, default=-1) + 1
        return injector.fired[0][2], watch.dead[dead[0]][0], done, len(plan.stages)


def run_restart(case: Case, url: str, reference: dict[str, Any], work: Path) -> Run:
    """The job torn down at the kill and started again from its checkpoint."""
    units = get_model(case.model).unit_names
    checkpoints = work / f"{case.model}-checkpoints"
    control = _control(url)
    try:
        fleet = LocalFleet(AGENTS, url, threads=1).start()
        try:
            fleet.wait_online(control, timeout=120)
            replicas = ReplicaStore(units, checkpoints)
            started = time.perf_counter()
            with replicas.listening(control):
                killed, detected, done, stages = _first_attempt(case, control, fleet, replicas)
        finally:
            fleet.stop()  # the teardown: every agent of the job
        torn_down = time.time()
        survivors = AGENTS - 1  # the dead device stays dead, as under recovery
        with LocalFleet(survivors, url, threads=1) as again:
            again.wait_online(control, timeout=120)
            online = time.time()
            restored = ReplicaStore(units, checkpoints)  # the checkpoint, read back from disk
            first = restored.newest_complete(done)
            plan = even_plan(again.ids, len(units))
            job = new_job_id()
            restore = (
                {
                    s: restored.compose(first, st.start, st.end, job, s)
                    for s, st in enumerate(plan.stages)
                }
                if first > 0
                else None
            )
            planned = time.time()
            resumed: list[float] = []

            def on_step(_report: StepReport) -> None:
                if not resumed:
                    resumed.append(time.time())

            result = run_on_agents(
                case.spec(),
                plan,
                control,
                job=job,
                on_step=on_step,
                options=RunOptions(timeout_s=600),
                attempt=Attempt(
                    first_step=first, replicate_every=case.replicate_every, restore=restore
                ),
            )
            wall = time.perf_counter() - started
    finally:
        control.close()
    parts = {
        "detect_s": detected - killed,
        "teardown_s": torn_down - detected,
        "agents_online_s": online - torn_down,
        "plan_restore_s": planned - online,
        "first_step_s": resumed[0] - planned,
    }
    diff = max_rel_diff(result.weights, reference)
    plans = [stages, len(plan.stages)]
    return Run(resumed[0] - detected, resumed[0] - killed, wall, first, diff, parts, plans)


def summarize(model: str, recovery: list[Run], restart: list[Run]) -> dict[str, Any]:
    """One table row: medians over the rounds, and restart / recovery."""
    rec = statistics.median(r.resume_s for r in recovery)
    res = statistics.median(r.resume_s for r in restart)
    shapes = list(dict.fromkeys(tuple(r.stages) for r in [*recovery, *restart]))
    return {
        "model": model,
        # Each sequence of stage counts the runs' plans had (one, when all ran alike).
        "stages": [list(shape) for shape in shapes],
        "recovery_s": rec,
        "restart_s": res,
        "ratio": res / rec if rec > 0 else float("inf"),
        "recovery_wall_s": statistics.median(r.wall_s for r in recovery),
        "restart_wall_s": statistics.median(r.wall_s for r in restart),
        "recovery_runs": [asdict(r) for r in recovery],
        "restart_runs": [asdict(r) for r in restart],
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'model':>12} {'stages':>7} {'recovery s':>10} {'restart s':>9} "
        f"{'restart/recovery':>16} {'wall recovery s':>15} {'wall restart s':>14}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        stages = " / ".join("->".join(str(n) for n in shape) for shape in r["stages"])
        lines.append(
            f"{r['model']:>12} {stages:>7} {r['recovery_s']:>10.2f} {r['restart_s']:>9.2f} "
            f"{r['ratio']:>15.1f}x {r['recovery_wall_s']:>15.2f} {r['restart_wall_s']:>14.2f}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CASES))
    parser.add_argument("--rounds", type=int, default=1, help="runs of each; medians reported")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--save", type=Path, help="also write the JSON object here")
    args = parser.parse_args()
    cases = [CASES[m] for m in args.models.split(",")]
    broker = start_broker()
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="edgetrain-recovery-") as work:
            for case in cases:
                n_units = get_model(case.model).num_units
                reference = run_inprocess(case.spec(), Plan.of(("ref", 0, n_units))).weights
                recovery, restart = [], []
                for _ in range(args.rounds):
                    recovery.append(run_recovery(case, broker.url, reference))
                    restart.append(run_restart(case, broker.url, reference, Path(work)))
                rows.append({**asdict(case), **summarize(case.model, recovery, restart)})
    finally:
        broker.stop()
    out = {
        "agents": AGENTS,
        "threads_per_agent": 1,
        "broker": broker.kind,
        "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
        "rows": rows,
    }
    if args.save is not None:
        args.save.write_text(json.dumps(out, indent=2) + "\n")
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"stage 1's agent killed at step K on {AGENTS} local agents: the plans' stages "
        f"(before -> after the kill), seconds from detection to the first resumed step "
        f"(median of {args.rounds}); each run's wall time"
    )
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    exit_on_sigterm()  # a stopped run stops the broker and agents it started
    sys.exit(main())
