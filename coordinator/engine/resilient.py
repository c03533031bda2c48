"""Training that survives devices dying: detect, re-plan over the survivors, roll back, resume.

:class:`ResilientRun` runs a job as a series of *attempts*, each an ordinary
:func:`~coordinator.engine.runners.run_on_agents` run under its own job id (so no frame
of a cancelled attempt can reach the next one), with every stage publishing its
state (weights and optimizer state, safetensors) every ``replicate_every`` steps.

- **Detection** (:class:`~coordinator.engine.watch.DeviceWatch`): a device is
  dead when its last will says ``offline`` or its heartbeats stop. A stage
  that reports a failure while a device of the plan is dead, or dies within the
  timeout, is a casualty of that death, not a failure of the job.
- **Recovery**: the attempt is cancelled on the survivors; the coordinator
  re-plans over the devices still alive (``replan``); every stage of the new
  plan starts at the newest step for which the replicas cover every unit
  (:class:`~coordinator.engine.replicas.ReplicaStore`; step 0 needs none: stages build
  their seeded initial weights) with the state of exactly its units, and the
  data order continues from that step (the sampler is seeded by step). So a run
  with failures ends with the weights of a run without, up to rounding.
- **A group member dies** ([Note: a group member dies] in
  :mod:`coordinator.engine.handover`): its co-members hold its units, so nothing
  rolls back. The stages stop holding their state, hand over the state of the
  step every stage reached, and the re-plan over the survivors resumes from it;
  only the step in flight then runs again.
- **Migration**: after every step (once an attempt has run ``settle_steps``)
  the ``rebalance`` callback weighs the measured stage times; a better plan it
  returns is moved to exactly as after a failure, without one.
- **Reporting**: every fault fired (which, on which device, at which step's
  report), failure and recovery is an event with its time; the result says how
  long recovery took (detection to the first step of the new attempt) and how
  many steps were redone.

Tested in tests/e2e/test_fault_tolerance.py (agents killed, the same result),
tests/e2e/test_group_faults.py (a group member dies: a hand-over, no rollback) and
tests/e2e/test_migration.py (a better plan moved to).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from coordinator.engine.faults import FaultInjector
from coordinator.engine.handover import Handover
from coordinator.engine.monitor import JobAborted, JobFailed, JobResult
from coordinator.engine.options import JobHooks, RunOptions
from coordinator.engine.replicas import ReplicaStore
from coordinator.engine.runners import Attempt, run_on_agents
from coordinator.engine.spec import JobSpec, new_job_id
from coordinator.engine.watch import RECONNECT_GRACE_S, DeviceWatch
from coordinator.planner.score import Plan
from edge.models.zoo import get_model
from edge.transport.mqtt import MqttTransport
from edge.wire.messages import CancelJob, StepReport
from edge.wire.topics import device_cmd

__all__ = ["PlanNotes", "Rebalance", "Resilience", "ResilientResult", "ResilientRun", "Shares"]

log = logging.getLogger(__name__)

Rebalance = Callable[[Plan, list[str], dict[str, float], int, int], Plan | None]
"""``rebalance(plan, alive, compute_s, steps_left, redo_steps)``: a better plan, or
``None``; ``redo_steps``: the steps a move now would run again."""
Shares = Callable[[Plan], Sequence[Sequence[float]] | None]
"""``shares(plan)``: each group member's share of a microbatch, per stage (``None``: equal)."""


@dataclass
class ResilientResult:
    result: JobResult
    """The whole job: every step's loss, all reports, the final weights."""
    events: list[dict[str, Any]] = field(default_factory=list)
    recovery_s: list[float] = field(default_factory=list)
    """Per recovery: from detecting the failure to the first step of the resumed run."""
    rolled_back_steps: int = 0
    steps_completed: int = 0

    @property
    def migrations(self) -> list[dict[str, Any]]:
        """Per migration: samples/s of the old plan just before it and of the new plan."""
        out = []
        for i, e in enumerate(self.events):
            if e["type"] == "migration":
                after = next((x for x in self.events[i:] if x["type"] == "attempt_end"), None)
                out.append(
                    {
                        "before_sps": e["before_sps"],
                        "after_sps": after["samples_per_s"] if after else None,
                    }
                )
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "migrations": self.migrations,
            "events": self.events,
            "recovered": bool(self.recovery_s),
            "recovery_s": max(self.recovery_s) if self.recovery_s else None,
            "recoveries_s": self.recovery_s,
            "steps_completed": self.steps_completed,
            "rolled_back_steps": self.rolled_back_steps,
        }


@dataclass
class _Migration:
    """A better plan the rebalancer found, to move to when the attempt has stopped."""

    plan: Plan
    before_sps: float | None
    at: float
    compute_s: dict[str, float]


@dataclass
class _Interruption:
    """A failure, broker loss or migration being handled: when it began, and its kind."""

    since: float
    kind: str  # "failure", "broker" or "migration"


@dataclass(frozen=True)
class Resilience:
    """How a :class:`ResilientRun` survives, and what it is put through."""

    replicate_every: int = 2
    """Every stage publishes its state every this many steps (0: never; the members of a
    group still hand over)."""
    rebalance: Rebalance | None = None
    """Asked after every step for a better plan to migrate to (``None``: no migration)."""
    faults: FaultInjector | None = None
    """Faults that fire as their steps are reported."""
    replicas: ReplicaStore | None = None
    """The stages' replicated states: a resumed job's; ``None``: new ones, in memory."""
    max_recoveries: int = 8
    settle_steps: int = 3
    """Steps an attempt runs before the rebalancer weighs it."""


@dataclass(frozen=True)
class PlanNotes:
    """What the caller knows of each plan a :class:`ResilientRun` runs."""

    shares: Shares | None = None
    """Each group member's share of a microbatch (``None``: equal shares)."""
    explain: Callable[[Plan, Plan], dict[str, Any]] | None = None
    """``explain(old, new)``: fields the recovery event adds (e.g. whose data left)."""


class ResilientRun:
    """Run ``plan``, recovering from device deaths by re-planning over the living.

    ``replan(alive)`` gives the plan for the devices still alive (in ``devices``' order;
    the caller may append devices that join, once they are online); the ``faults`` of
    ``resilience`` fire as their steps are reported. Its ``rebalance(plan, alive,
    compute_s, steps_left, redo)`` is asked (on the calling thread) after every step, once
    an attempt has run ``settle_steps`` steps, with each stage device's measured compute
    seconds per step (mean of the last two; the device's own seconds where its reports say
    them, so that other processes of a busy host do not count: [Note: a device's own
    compute seconds] in :mod:`edge.runtime.stage`): a plan it returns is migrated to at
    once (the stages roll back to the newest replica, as after a failure, and resume;
    ``redo`` says how many finished steps that would run again, by the replicas that have
    come so far).

    A plan with groups splits each microbatch by the ``shares`` of ``notes`` (equal
    without them); when a member of a group dies, the survivors hand over instead of
    rolling back. Rebalancing weighs plans of one-device stages only. Every attempt runs
    on agents as ``options`` say.

    To resume a job a previous coordinator ran: pass its ``replicas`` (kept on disk) and
    start :meth:`run` at the newest step they cover; ``hooks.on_attempt(job, plan,
    first_step)`` hears of every attempt before it starts, so that it can be cancelled
    later, and ``hooks.on_step`` of every step report.
    """

    def __init__(
        self,
        spec: JobSpec,
        control: MqttTransport,
        replan: Callable[[list[str]], Plan],
        devices: list[str],
        *,
        resilience: Resilience = Resilience(),
        options: RunOptions = RunOptions(),
        hooks: JobHooks = JobHooks(),
        notes: PlanNotes = PlanNotes(),
    ) -> None:
        self.spec = spec
        self.resilience = resilience
        self.options = options
        self.hooks = hooks
        self.notes = notes
        self.control = control
        self.replan = replan
        self.devices = devices
        """The job's devices; the caller appends those that join (once online)."""
        self.faults = resilience.faults
        self.rebalance = resilience.rebalance
        self.replicas = resilience.replicas or ReplicaStore(
            get_model(spec.model, **spec.model_options).unit_names
        )
        self.watch = DeviceWatch(control, devices, options.heartbeat_timeout_s)
        # The whole run:
        self.events: list[dict[str, Any]] = []
        self.losses: dict[int, float] = {}
        self.reports: list[StepReport] = []
        self.recovery_s: list[float] = []
        self.rolled_back = 0
        self.interruption: _Interruption | None = None
        """The failure, broker loss or migration being recovered from, until a step ends."""
        # The attempt in progress:
        self.plan: Plan | None = None
        self.first_step = 0
        self.attempt_reports: list[StepReport] = []
        self.due: StepReport | None = None
        """The newest step-ending report the rebalancer has not weighed yet."""
        self.migration: _Migration | None = None
        self.current: list[str] = []
        """The devices of the attempt's stages."""
        self.attempt_job = ""
        """The attempt's job id (each attempt runs under its own)."""
        self.handover: Handover | None = None
        """The attempt's hand-over, for a plan with groups."""
        self.reconnects = control.reconnects
        """The connection's reconnect count when the attempt started."""

    # -- what the attempt's stages report (paho's network thread) ------------------------

    def _event(self, kind: str, **fields: Any) -> None:
        self.events.append({"type": kind, "ts": time.time(), **fields})

    def _stepped(self, report: StepReport) -> None:
        self.reports.append(report)
        self.attempt_reports.append(report)
        if report.loss is not None:
            self.losses[report.step] = report.loss
        if self.rebalance is not None and report.stage == 0:
            self.due = report  # weighed by _abort(), on the caller's thread, not paho's
        if self.interruption is not None:
            took = time.time() - self.interruption.since
            kind = self.interruption.kind
            self.interruption = None
            if kind != "failure":
                self._event("resumed", step=report.step, **{f"{kind}_s": took})
            else:
                self.recovery_s.append(took)
                self._event("resumed", step=report.step, recovery_s=took)
        if self.faults is not None:
            for fault, device in self.faults.on_step(report):
                self._event(
                    "fault", fault=str(fault), stage=fault.stage, device=device, step=report.step
                )
        if self.hooks.on_step is not None:
            self.hooks.on_step(report)

    # -- decisions while an attempt runs (the calling thread) ---------------------------

    def _consider_rebalance(self, report: StepReport) -> None:
        plan = self.plan
        if self.rebalance is None or plan is None or self.migration is not None or plan.grouped:
            return
        if report.step - self.first_step + 1 < self.resilience.settle_steps:
            return
        last = [report.step - 1, report.step]
        compute: dict[str, float] = {}
        for s, st in enumerate(plan.stages):
            got = [
                r.compute_s if r.own_compute_s is None else r.own_compute_s
                for r in self.attempt_reports
                if r.stage == s and r.step in last
            ]
            if len(got) < 2:
                return
            compute[st.device] = sum(got) / len(got)
        step_s = [r.step_s for r in self.attempt_reports if r.stage == 0 and r.step in last]
        self.watch.follow(self.devices)  # the caller appends devices that joined
        alive = self.watch.alive(self.devices)
        done = max(self.losses, default=-1) + 1
        redo = done - self.replicas.newest_complete(done)
        better = self.rebalance(plan, alive, compute, self.spec.steps - report.step - 1, redo)
        if better is not None and better != plan:
            before = self.spec.batch_size / (sum(step_s) / len(step_s)) if step_s else None
            self.migration = _Migration(
                plan=better, before_sps=before, at=time.time(), compute_s=compute
            )

    def _abort(self, current: list[str], reconnects: int) -> str | None:
        dead = self.watch.dead_among(current)
        if dead:
            return f"device {dead[0]} died"
        if self.control.reconnects != reconnects:  # frames in flight were lost with it
            return "the broker connection was lost"
        due, self.due = self.due, None
        if due is not None:  # planning may take a while: never on paho's network thread
            self._consider_rebalance(due)
        return "migrating to a faster plan" if self.migration is not None else None

    def _attempt_end(self, job: str) -> None:
        """The attempt's steady samples/s (stage 0's step times after its first two steps)
        and how many steps it finished: those whose loss came, as the rollback counts them
        (a step a stage began when the broker or a device went is not one)."""
        first = self.first_step
        times = [r.step_s for r in self.attempt_reports if r.stage == 0 and r.step >= first + 2]
        sps = self.spec.batch_size * len(times) / sum(times) if times and sum(times) > 0 else None
        steps = len({r.step for r in self.attempt_reports if r.loss is not None})
        self._event("attempt_end", job=job, first_step=first, samples_per_s=sps, steps=steps)

    # -- the run --------------------------------------------------------------------------

    def run(self, plan: Plan, first_step: int = 0) -> ResilientResult:
        """Train from ``first_step`` with ``plan`` until the last step, however many
        attempts that takes; :class:`JobFailed` if it cannot."""
        started = time.perf_counter()
        self.first_step = first_step
        with self.watch, self.replicas.listening(self.control):
            for _ in range(self.resilience.max_recoveries + 1):
                last = self._attempt(plan)
                if last is not None:
                    break
                plan = self._next_plan()
            else:
                raise JobFailed(f"gave up after {self.resilience.max_recoveries} recoveries")
        result = JobResult(
            job=last.job,
            plan=plan,
            spec=self.spec,
            losses=[self.losses[s] for s in sorted(self.losses)],
            reports=self.reports,
            wall_s=time.perf_counter() - started,
            weights=last.weights,
        )
        return ResilientResult(
            result=result,
            events=self.events,
            recovery_s=self.recovery_s,
            rolled_back_steps=self.rolled_back,
            steps_completed=len(self.losses),
        )

    def _attempt(self, plan: Plan) -> JobResult | None:
        """One attempt of ``plan`` from :attr:`first_step`: its result if it finished the
        job, ``None`` if it was stopped by a death, the broker or a migration."""
        job = new_job_id()
        self.replicas.accept(job, [(st.start, st.end) for st in plan.stages])
        self.current = plan.devices
        if self.faults is not None:
            self.faults.use_plan([st.devices for st in plan.stages])
        self._event("attempt", job=job, first_step=self.first_step, plan=plan.to_json())
        if self.hooks.on_attempt is not None:
            self.hooks.on_attempt(job, plan, self.first_step)
        self.attempt_reports.clear()
        self.due = None
        self.plan = plan
        self.attempt_job = job
        self.reconnects = self.control.reconnects
        restore = None
        if self.first_step > 0:
            restore = {
                s: self.replicas.compose(self.first_step, st.start, st.end, job, s)
                for s, st in enumerate(plan.stages)
            }
        current, reconnects = self.current, self.reconnects
        self.handover = None
        if plan.grouped:
            self.handover = Handover(
                job, plan, lambda: self.watch.dead_among(current), self.replicas
            )
        try:
            last = run_on_agents(
                self.spec,
                plan,
                self.control,
                job=job,
                on_step=self._stepped,
                shares=self.notes.shares(plan) if self.notes.shares is not None else None,
                options=self.options,
                attempt=Attempt(
                    first_step=self.first_step,
                    replicate_every=self.resilience.replicate_every,
                    restore=restore,
                    abort=lambda: self._abort(current, reconnects),
                    handover=self.handover,
                ),
            )
            self._attempt_end(job)
            return last
        except JobAborted:
            self._attempt_end(job)  # a device died, or a migration: see _next_plan
        except JobFailed:
            self._attempt_end(job)
            # A stage failing because its neighbour died: wait for the death to show.
            deadline = time.monotonic() + self.options.heartbeat_timeout_s + 0.5
            while not self._explained() and time.monotonic() < deadline:
                time.sleep(0.05)
            if not self._explained():
                raise
        return None

    def _explained(self) -> bool:
        """A failed attempt is explained by a death or a lost broker connection."""
        dead = self.watch.dead_among(self.current)
        return bool(dead) or self.control.reconnects != self.reconnects

    def _next_plan(self) -> Plan:
        """After an attempt stopped: roll back to the newest complete replica and say what
        runs next (the same plan after a broker loss, the migration's, or a re-plan over
        the survivors of a death)."""
        assert self.plan is not None
        self.watch.settle()
        dead = self.watch.dead_among(self.current)
        done = max(self.losses, default=-1) + 1
        handed = self.handover.step if self.handover is not None else None
        if handed is not None:  # the survivors' states: no finished step is redone
            self.first_step = self.replicas.newest_complete(handed, hold=True)
            redo = 0
        else:
            self.first_step = self.replicas.newest_complete(done, hold=True)
            redo = done - self.first_step
        decided = time.time()  # the replicas that had come by now chose the step
        self.rolled_back += redo
        for step in [s for s in self.losses if s >= self.first_step]:
            del self.losses[step]
        alive = self.watch.alive(self.devices)
        if not dead and self.control.reconnects != self.reconnects:  # the broker went away
            self._event(
                "broker-lost", rollback_to=self.first_step, redo_steps=redo, decided_at=decided
            )
            self.interruption = _Interruption(time.time(), "broker")
            self.migration = None
            self._await_broker(alive)
            return self.plan
        migration, self.migration = self.migration, None
        if not dead and migration is not None:  # no failure: a rebalance
            self.interruption = _Interruption(migration.at, "migration")
            self._event(
                "migration",
                rollback_to=self.first_step,
                redo_steps=redo,
                decided_at=decided,
                before_sps=migration.before_sps,
                compute_s=migration.compute_s,
                plan=migration.plan.to_json(),
            )
            return migration.plan
        detected = min(self.watch.dead[d][0] for d in dead)
        for d in dead:
            when, why = self.watch.dead[d]
            self._event("failure", device=d, detected_at=when, why=why)
        if not alive:
            raise JobFailed("every device of the job died")
        old, plan = self.plan, self.replan(alive)
        self.interruption = _Interruption(detected, "failure")
        told = self.notes.explain(old, plan) if self.notes.explain is not None else {}
        self._event(
            "recovery",
            rollback_to=self.first_step,
            redo_steps=redo,
            decided_at=decided,
            survivors=alive,
            plan=plan.to_json(),
            handed_over=handed is not None,
            **told,
        )
        return plan

    def _await_broker(self, alive: list[str]) -> None:
        """The broker went away: wait for it and for the agents, then cancel the attempt
        again (the first cancel may have been lost while an agent was away)."""
        back = time.monotonic()
        if not self.control.wait_ready(60):
            raise JobFailed("the broker did not come back within 60 s")
        # Commands to an agent still backing off would be lost: wait for each.
        silent = self.watch.wait_heard(alive, back, RECONNECT_GRACE_S)
        if silent:
            log.warning("devices %s not heard since the broker came back", silent)
        # The cancel sent when the attempt stopped may have reached the broker before
        # an agent had subscribed again, and then it is lost: the agent keeps the
        # stale stage and refuses the next attempt as busy. A device heard now has
        # resubscribed (it does so first on reconnecting), so say it again.
        cancel = CancelJob(job=self.attempt_job, reason="the broker restarted").model_dump_json()
        for device in self.current:
            with contextlib.suppress(ConnectionError):
                self.control.publish(device_cmd(device), cancel, 1)
