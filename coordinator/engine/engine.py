"""The job engine: plan -> assign -> run -> watch -> replicate -> recover or migrate -> collect.

:class:`JobEngine` is the one place a job over agents is driven, whoever asks:
the service's job manager (:mod:`coordinator.service.manager`), ``edgetrain
train`` over a local fleet, and through the service the demo and the testbed.
It knows no FastAPI and no store; what a caller keeps (steps, events, plans) it
hears through :class:`JobHooks`.

- **Plan** (:meth:`JobEngine.plan`): a planning problem over the devices the
  :class:`Fleet` says are online and idle, planned with the job's ``partition``,
  ``stages`` and ``codec`` (:func:`~coordinator.planner.partition.plan_job`).
  Re-planning after a death with fewer devices than ``stages`` plans one stage
  per device left and says so.
- **Run**: a job without ``replicate_every`` runs once
  (:func:`~coordinator.engine.runners.run_on_agents`); one with it runs as a
  :class:`~coordinator.engine.resilient.ResilientRun` on a connection of its own
  (its device watch holds that connection's status and heartbeat filters): it
  survives deaths, its faults fire through the :class:`FaultActuator`, and a
  :class:`~coordinator.engine.rebalance.Rebalancer` migrates it to a faster plan
  when measured stage times drift or a device joins.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from coordinator.engine.faults import Fault, FaultActuator, FaultInjector, parse_fault
from coordinator.engine.rebalance import Rebalancer, replication_interval
from coordinator.engine.replicas import ReplicaStore
from coordinator.engine.resilient import ResilientResult, ResilientRun
from coordinator.engine.runners import run_on_agents
from coordinator.engine.spec import JobAccess, JobResult, JobSpec
from coordinator.planner.build import build_problem
from coordinator.planner.partition import JobPlan, plan_job
from coordinator.planner.predict import calibrated, measure_unit_seconds
from coordinator.planner.score import Plan
from edge.errors import UserError
from edge.problem import DeviceSpec, Objective, PlanningProblem
from edge.transport.mqtt import MqttTransport
from edge.wire.messages import StepReport

__all__ = ["Fleet", "JobEngine", "JobHooks", "JobRun", "PlannedJob", "job_problem", "plan_over"]

log = logging.getLogger(__name__)

IDLE_WAIT_S = 10.0
"""Before re-planning: how long survivors of a cancelled attempt may take to be idle."""
JOIN_WAIT_S = 120.0
"""How long a device started by a ``join`` fault may take to come online."""


class Fleet(Protocol):
    """Where a job's devices come from: :class:`~coordinator.service.registry.DeviceRegistry`
    in the service, :class:`~coordinator.local.fleet.LocalFleet` for ``edgetrain train``."""

    def available(self, allowed: list[str] | None = None) -> list[DeviceSpec]:
        """Profiles of the online, idle devices (those in ``allowed`` when given)."""
        ...


@dataclass
class JobHooks:
    """What a caller hears of a job as it runs; every hook is optional."""

    on_step: Callable[[StepReport], None] | None = None
    """Every stage's report of every step (paho's thread: quick)."""
    on_plan: Callable[[PlannedJob], None] | None = None
    """Every plan made for the job: the first and each re-plan after a death."""
    on_attempt: Callable[[str, Plan, int], None] | None = None
    """``(attempt job id, plan, first step)`` before each attempt starts."""
    on_fault: Callable[[Fault, dict[str, Any]], None] | None = None
    """A fault fired: what was done (``device``, ``done``) or why not (``error``)."""
    on_join: Callable[[str, bool], None] | None = None
    """A device started by a ``join`` fault came online (``True``) or did not in time."""


@dataclass
class PlannedJob:
    """A plan for a job, the problem it was planned over, and how it was found."""

    problem: PlanningProblem
    found: JobPlan
    fewer_stages: str | None = None
    """Set when a re-plan had fewer devices than the job's ``stages``: what it did."""

    @property
    def plan(self) -> Plan:
        return self.found.plan

    @property
    def shares(self) -> list[list[float]] | None:
        """Each group member's share of a microbatch, per stage; ``None`` without groups."""
        return self.found.score.shares if self.plan.grouped else None


@dataclass
class JobRun:
    """What :meth:`JobEngine.run` returns."""

    result: JobResult
    resilient: ResilientResult | None = None
    """Events, recoveries and migrations of a job run with ``replicate_every``."""
    replicate_every: int = 0
    unfired: list[Fault] = field(default_factory=list)
    """Faults whose step came while no stage of theirs ran."""


def job_problem(
    spec: JobSpec, devices: list[DeviceSpec], pin_first: str | None = None
) -> PlanningProblem:
    """The planning problem of ``spec`` over ``devices`` (``pin_first`` holds the data):
    version 2 with the job's objective when it has one (the energy objective, or a
    deadline), its stages one device each (the planner does not place groups in jobs yet)."""
    objective = spec.objective != "time" or spec.max_step_time_s is not None
    problem = build_problem(
        spec.model,
        devices,
        batch_size=spec.batch_size,
        microbatches=spec.microbatches,
        model_options=spec.model_options,
        pin_first=pin_first or spec.pin_first,
        version=2 if objective else 1,
    )
    if not objective:
        return problem
    if spec.objective == "energy" and not any(d.watts_busy for d in devices):
        raise UserError(
            "objective energy: no device has power figures (watts_busy); "
            "agents announce them with a catalogue --profile"
        )
    goal = Objective(minimize=spec.objective, max_step_time_s=spec.max_step_time_s)
    return problem.model_copy(update={"groups": False, "objective": goal})


def plan_over(
    spec: JobSpec,
    devices: list[DeviceSpec],
    *,
    again: bool = False,
    pin_first: str | None = None,
    where: str = "the devices",
    previous: Plan | None = None,
) -> PlannedJob:
    """Plan ``spec`` over ``devices`` with its ``partition``, ``stages`` and ``codec``; a
    one-line :class:`UserError` when it cannot be. ``again``: a re-plan, which plans one
    stage per device when fewer are left than the job's ``stages``, warm-started from
    ``previous`` when given (:func:`~coordinator.planner.partition.plan_job`)."""
    if not devices:
        raise UserError(f"no device of {where} may run this job")
    first = pin_first or spec.pin_first
    if first is not None and first not in {d.id for d in devices}:
        raise UserError(f"pin_first device {first} is not online")
    stages = spec.stages
    fewer = None
    if stages is not None and len(devices) < stages:
        have = f"{len(devices)} online and allowed ({', '.join(d.id for d in devices)})"
        if not again:
            raise UserError(f"stages={stages} needs {stages} devices; {have}")
        fewer = f"stages={stages}, but only {have}: planning {len(devices)} stages"
        stages = len(devices)
    problem = job_problem(spec, devices, first)
    units = None
    if calibrated(problem):  # agents that measured their fixed costs: predict what they'll do
        units = measure_unit_seconds(
            spec.model,
            spec.batch_size,
            spec.microbatches,
            model_options=spec.model_options,
            optimizer=spec.optimizer,
        )
    found = plan_job(
        problem,
        partition=spec.partition,
        stages=stages,
        codec=spec.codec,
        where=where,
        previous=previous if again else None,
        group_sizes=spec.group_sizes,
        units=units,
    )
    return PlannedJob(problem=problem, found=found, fewer_stages=fewer)


class JobEngine:
    """Drives jobs over the agents of ``fleet`` through the connected ``control``."""

    def __init__(
        self,
        control: MqttTransport,
        fleet: Fleet,
        actuator: FaultActuator,
        *,
        heartbeat_timeout_s: float = 3.0,
        ready_timeout_s: float = 120.0,
        servers: Callable[[], dict[str, str]] | None = None,
        access: JobAccess | None = None,
    ) -> None:
        self.control = control
        self.access = access
        """The broker's ACLs, when the coordinator manages its accounts: they follow each plan."""
        self.fleet = fleet
        self.actuator = actuator
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.servers = servers or dict
        """Device -> host of the server-tier devices, whose stages form one process group."""

    # -- planning -------------------------------------------------------------------------

    def plan(
        self,
        spec: JobSpec,
        allowed: list[str] | None = None,
        *,
        again: bool = False,
        pin_first: str | None = None,
        where: str = "the online devices",
        previous: Plan | None = None,
    ) -> PlannedJob:
        """Plan ``spec`` over the fleet's available devices (in ``allowed``): :func:`plan_over`."""
        devices = self.fleet.available(allowed)
        return plan_over(
            spec, devices, again=again, pin_first=pin_first, where=where, previous=previous
        )

    # -- running --------------------------------------------------------------------------

    def run(
        self,
        job: str,
        spec: JobSpec,
        planned: PlannedJob,
        *,
        hooks: JobHooks | None = None,
        allowed: list[str] | None = None,
        faults: list[Fault] | None = None,
        replicate_every: int | None = None,
        rebalance: bool = True,
        replicas: ReplicaStore | None = None,
        first_step: int = 0,
        pin_first: str | None = None,
    ) -> JobRun:
        """Run ``planned`` as job ``job``; :class:`~coordinator.engine.spec.JobFailed` if
        it fails. ``replicate_every`` (default: the spec's; negative: chosen from the
        plan's costs) makes the run resilient; ``faults`` fire during it (default: the
        spec's). A resumed job passes its ``replicas`` and the ``first_step`` they cover.
        """
        hooks = hooks or JobHooks()
        every = self.replication(spec, planned, replicate_every)
        if every == 0:
            result = run_on_agents(
                spec,
                planned.plan,
                self.control,
                job=job,
                on_step=hooks.on_step,
                ready_timeout_s=self.ready_timeout_s,
                servers=self.servers(),
                access=self.access,
                shares=planned.shares,
            )
            return JobRun(result)
        return self._run_resilient(
            spec,
            planned,
            hooks=hooks,
            allowed=allowed,
            faults=faults,
            replicate_every=every,
            rebalance=rebalance,
            replicas=replicas,
            first_step=first_step,
            pin_first=pin_first,
        )

    @staticmethod
    def replication(spec: JobSpec, planned: PlannedJob, replicate_every: int | None = None) -> int:
        """Replicate every how many steps: ``replicate_every``, else the spec's; a negative
        value is chosen from the plan's costs (:func:`replication_interval`), at most a
        tenth of the job so that a failure never costs more than that."""
        every = spec.replicate_every if replicate_every is None else replicate_every
        if every < 0:
            most = max(1, spec.steps // 10)
            every = replication_interval(planned.problem, planned.plan, most=most)
        return every

    def _run_resilient(
        self,
        spec: JobSpec,
        planned: PlannedJob,
        *,
        hooks: JobHooks,
        allowed: list[str] | None,
        faults: list[Fault] | None,
        replicate_every: int,
        rebalance: bool,
        replicas: ReplicaStore | None,
        first_step: int,
        pin_first: str | None,
    ) -> JobRun:
        devices = [d.id for d in self.fleet.available(allowed)]
        for st in planned.plan.stages:  # a resumed job's devices may still be busy
            if st.device not in devices:
                devices.append(st.device)
        members = None if allowed is None else list(allowed)  # devices that join are added
        if faults is None:
            faults = [parse_fault(text) for text in spec.faults]
        injector = FaultInjector(faults, self._actor(hooks, devices, members)) if faults else None

        def first_of(alive: list[str]) -> str | None:
            """The pinned device while it lives; the first survivor after it died."""
            return pin_first if pin_first is None or pin_first in alive else alive[0]

        current = [planned.plan]  # the plan a re-plan starts from

        def replan(alive: list[str]) -> Plan:
            self._wait_available(alive, IDLE_WAIT_S)
            alive = [d for d in alive if members is None or d in members]
            again = self.plan(
                spec,
                alive,
                again=True,
                pin_first=first_of(alive),
                where="the survivors",
                previous=current[0],
            )
            if hooks.on_plan is not None:
                hooks.on_plan(again)
            current[0] = again.plan
            return again.plan

        def problem_for(alive: list[str]) -> PlanningProblem:
            profiles = {d.id: d for d in self.fleet.available(None)}
            profiles.update({d.id: d for d in planned.problem.devices if d.id not in profiles})
            known = [profiles[d] for d in alive if d in profiles]
            return job_problem(spec, known, first_of([d.id for d in known]))

        # Its own connection: the run's device watch takes this connection's status and
        # heartbeat filters, and the caller's connection keeps its own.
        control = MqttTransport(self.control.settings.model_copy(update={"client_id": None}))
        control.connect(timeout=15)
        try:
            run = ResilientRun(
                spec,
                control,
                replan,
                devices,
                replicate_every=replicate_every,
                heartbeat_timeout_s=self.heartbeat_timeout_s,
                faults=injector,
                on_step=hooks.on_step,
                rebalance=(
                    Rebalancer(problem_for, replicate_every=replicate_every, stages=spec.stages)
                    if rebalance
                    else None
                ),
                replicas=replicas,
                on_attempt=hooks.on_attempt,
                ready_timeout_s=self.ready_timeout_s,
                access=self.access,
            )
            got = run.run(planned.plan, first_step)
        finally:
            control.close()
        return JobRun(
            got.result,
            resilient=got,
            replicate_every=replicate_every,
            unfired=injector.pending if injector is not None else [],
        )

    def _wait_available(self, devices: list[str], timeout_s: float) -> None:
        """Wait (bounded) until each of ``devices`` is available again: survivors of a
        cancelled attempt say ``online`` once their stage has stopped."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if len(self.fleet.available(devices)) == len(set(devices)):
                return
            time.sleep(0.05)

    def _actor(
        self, hooks: JobHooks, devices: list[str], members: list[str] | None
    ) -> Callable[[Fault, str], None]:
        """How a fault is done: through :attr:`actuator`; a device that joins is appended
        to ``devices`` (and ``members``) once the fleet has it online."""

        def record(fault: Fault, **detail: Any) -> None:
            if hooks.on_fault is not None:
                hooks.on_fault(fault, detail)

        def join(fault: Fault) -> None:
            try:
                device = self.actuator.join(fault.profile or "")
            except (UserError, OSError, RuntimeError) as exc:
                record(fault, error=getattr(exc, "message", str(exc)))
                return
            record(fault, device=device, done=f"started {device} ({fault.profile})")
            deadline = time.monotonic() + JOIN_WAIT_S
            while not self.fleet.available([device]):
                if time.monotonic() > deadline:
                    if hooks.on_join is not None:
                        hooks.on_join(device, False)
                    return
                time.sleep(0.1)
            if members is not None:
                members.append(device)
            devices.append(device)
            if hooks.on_join is not None:
                hooks.on_join(device, True)

        def act(fault: Fault, device: str) -> None:  # on paho's thread: nothing slow here
            if fault.kind == "join":
                threading.Thread(target=join, args=(fault,), name="join", daemon=True).start()
                return
            try:
                if fault.kind == "kill":
                    done = self.actuator.kill(device)
                else:
                    done = self.actuator.slow(device, fault.factor)
            except (UserError, OSError, ConnectionError) as exc:
                record(fault, device=device, error=getattr(exc, "message", str(exc)))
                return
            log.warning("fault %s: %s", fault, done)
            record(fault, device=device, done=done)

        return act
