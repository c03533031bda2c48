"""The job engine: plan -> assign -> run -> watch -> replicate -> recover or migrate -> collect.

:class:`JobEngine` is the one place a job over agents is driven, whoever asks:
the service's job manager (:mod:`coordinator.service.manager`), ``edgetrain
train`` over a local fleet, and through the service the demo and the testbed.
It knows no FastAPI and no store; what a caller keeps (steps, events, plans) it
hears through :class:`JobHooks`.

- **Plan** (:meth:`JobEngine.plan`): a planning problem over the devices the
  :class:`Fleet` says are online and idle, planned with the job's ``partition``,
  ``stages`` and ``codec`` (:func:`~coordinator.planner.partition.plan_job`).
  The planner places device groups wherever :func:`plans_groups` says the job's
  run can train them, within the model's limits (:func:`group_limits`).
  Re-planning after a death with fewer devices than ``stages`` plans one stage
  per device left and says so.
- **Run** (:meth:`JobEngine.run`), as the engine's
  :class:`~coordinator.engine.options.RunOptions` say. Whether a run has fault
  tolerance, and how often it replicates, the engine alone decides from the spec and
  what the run is told (:class:`~coordinator.engine.options.Tolerance`;
  :meth:`JobEngine.replication`): callers that prepare for it ask
  :meth:`JobEngine.fault_tolerant`. A run without runs once
  (:func:`~coordinator.engine.runners.run_on_agents`); one with it runs as a
  :class:`~coordinator.engine.resilient.ResilientRun` on a connection of its own
  (its device watch holds that connection's status and heartbeat filters): it
  survives deaths, its faults fire through the :class:`FaultActuator`, and a
  :class:`~coordinator.engine.rebalance.Rebalancer` migrates it to a faster plan
  when measured stage times drift or a device joins.

[Note: choosing the schedule]
The planner cuts a job by 1F1B's step and checks 1F1B's memory. Then the job's schedule
is fitted to the plan (:func:`_with_schedule`). Another schedule keeps more microbatches
in flight on the later stages (GPipe ``M``, ZB-H1 ``min(S, M)``), so a named one the
plan's devices cannot hold is refused, naming the stage. ``auto`` simulates the plan's
step under every schedule they hold (:func:`~coordinator.planner.simulator.simulate`,
on the spec's times) and takes the fastest, 1F1B on a tie; a job with ``compile`` runs
none that splits a backward ([Note: compiled stages] in :mod:`edge.runtime.compiling`).
The internal model's prediction is then moved to that schedule
(:func:`~coordinator.planner.predict.under_schedule`). The plan is not cut again for
it: a cut for ZB-H1's step might differ.

[Note: planning a DiLoCo job]
A job with ``diloco`` ([Note: DiLoCo in a group] in :mod:`edge.runtime.outer_sync`) is cut
by the planner as an exact one, whose search prices a group's sum every step. Its groups
sum once in ``every`` steps, so the engine predicts the plan with that
(:func:`~coordinator.planner.predict.predict`'s ``sum_every``) and sets it beside the plan
DiLoCo is made for: one group of every device over the whole model, each member a data
replica on its share of the rows (where each device holds the model and the runtime can
train the group). It takes whichever is predicted faster and says so in the plan's
method. Plans between the two, cut for the rarer sum, are not searched yet.

Tested in tests/unit/coordinator/engine/test_schedule_memory.py (the schedule fitted to
the plan), tests/unit/coordinator/engine/test_plan_groups.py (where a job is planned on
groups), tests/unit/coordinator/engine/test_plan_objective.py (the energy objective and
deadlines) and tests/unit/coordinator/engine/test_tolerance.py (when a run has fault
tolerance); whole jobs through the service in tests/e2e/test_service.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from coordinator.engine.assignments import batchnorm_units, microbatch_choices_of, planning_start
from coordinator.engine.faults import Fault, FaultActuator, FaultInjector, parse_fault
from coordinator.engine.monitor import JobResult
from coordinator.engine.options import JobHooks, RunOptions, Tolerance
from coordinator.engine.rebalance import Rebalancer, replication_interval
from coordinator.engine.resilient import PlanNotes, Resilience, ResilientResult, ResilientRun
from coordinator.engine.runners import run_on_agents
from coordinator.engine.spec import JobSpec, microbatches_of
from coordinator.engine.unit_profiles import (
    time_units_on_devices,
    timing_request,
    whole_model_bytes,
)
from coordinator.planner.anatomy import Anatomy, StepTerms, anatomy
from coordinator.planner.build import build_problem
from coordinator.planner.group_tables import GroupLimits
from coordinator.planner.holders import HolderPlans, holder_ends
from coordinator.planner.microbatches import best_microbatches, first_microbatches
from coordinator.planner.partition import (
    FoundPlan,
    PartitionOptions,
    plan_holders_job,
    plan_job,
    plan_job_microbatches,
)
from coordinator.planner.predict import (
    Prediction,
    UnitSeconds,
    calibrated,
    measure_unit_seconds,
    predict,
    under_schedule,
)
from coordinator.planner.score import Plan, PlanScore, Stage, for_plan, score_plan
from coordinator.planner.simulator import fastest_schedule, memory_error
from edge.config import Schedule
from edge.errors import UserError
from edge.models.local_data import announced
from edge.models.zoo import get_model
from edge.problem import DeviceSpec, Objective, PlanningProblem
from edge.transport.mqtt import MqttTransport

__all__ = [
    "GROUPS_WITH_FAULT_TOLERANCE",
    "Fleet",
    "JobEngine",
    "JobRun",
    "PlannedJob",
    "group_limits",
    "holders_at_best",
    "job_problem",
    "job_unit_seconds",
    "plan_over",
    "plans_groups",
]

log = logging.getLogger(__name__)

IDLE_WAIT_S = 10.0
"""Before re-planning: how long survivors of a cancelled attempt may take to be idle."""
JOIN_WAIT_S = 120.0
"""How long a device started by a ``join`` fault may take to come online."""
GROUPS_WITH_FAULT_TOLERANCE = True
"""Whether the planner may place device groups in a job with fault tolerance (replication,
faults): resilient runs train groups, and a member that dies costs no rollback
([Note: a group member dies] in :mod:`coordinator.engine.handover`)."""


class Fleet(Protocol):
    """Where a job's devices come from: :class:`~coordinator.service.registry.DeviceRegistry`
    in the service, :class:`~coordinator.local.fleet.LocalFleet` for ``edgetrain train``."""

    def available(self, allowed: list[str] | None = None) -> list[DeviceSpec]:
        """Profiles of the online, idle devices (those in ``allowed`` when given)."""
        ...


@dataclass
class PlannedJob:
    """A plan for a job, the problem it was planned over, and how it was found."""

    problem: PlanningProblem
    found: FoundPlan
    fewer_stages: str | None = None
    """Set when a re-plan had fewer devices than the job's ``stages``: what it did."""
    holders: HolderPlans | None = None
    """On local data: the alternatives the job allows (the holders alone, each alone)."""
    own_units: tuple[str, ...] = ()
    """The devices whose own unit seconds (``unit_times="devices"``) priced the plan."""
    schedule: Schedule = "1f1b"
    """The schedule the job runs: its own, or the plan's choice for ``auto``."""

    @property
    def plan(self) -> Plan:
        return self.found.plan

    def resolve(self, spec: JobSpec) -> JobSpec:
        """``spec`` as this plan runs it: an ``auto`` job at the plan's microbatches and
        schedule."""
        return spec.at_microbatches(self.problem.microbatches).at_schedule(self.schedule)

    @property
    def score(self) -> PlanScore:
        """The plan's score: its predicted step, memory and (in groups) shares."""
        return self.found.score

    @property
    def shares(self) -> list[list[float]] | None:
        """Each group member's share of a microbatch, per stage; ``None`` without groups."""
        return self.score.shares if self.plan.grouped else None

    def anatomy(self) -> Anatomy:
        """Where the plan's step goes, per member: the internal model's prediction, or
        without one the spec's score (both on the problem as the plan runs it)."""
        problem, prediction = for_plan(self.problem, self.plan), self.found.prediction
        terms = (
            StepTerms.of_score(problem, self.score)
            if prediction is None
            else StepTerms.of_prediction(problem, prediction)
        )
        return anatomy(self.plan, terms)


@dataclass
class JobRun:
    """What :meth:`JobEngine.run` returns."""

    result: JobResult
    resilient: ResilientResult | None = None
    """Events, recoveries and migrations of a job run with ``replicate_every``."""
    replicate_every: int = 0
    unfired: list[Fault] = field(default_factory=list)
    """Faults whose step came while no stage of theirs ran."""


def plans_groups(spec: JobSpec, *, resilient: bool = False, servers: bool = False) -> bool:
    """Whether the planner may train a stage of ``spec`` on a device group: with
    ``partition="plan"`` (``even`` takes its groups from ``group_sizes``), unless the
    run cannot train groups yet: fault tolerance (``resilient``, or the spec's
    ``replicate_every`` or faults) until :data:`GROUPS_WITH_FAULT_TOLERANCE`, server-tier
    devices in the fleet (``servers``: groups run over MQTT), or ``codec="auto"`` (the
    codec search plans one-device stages), except on local data, whose holders are a
    group anyway and whose plans choose their codecs with their groups."""
    auto = spec.codec.lower() == "auto" and spec.data is None
    if spec.partition != "plan" or servers or auto:
        return False
    if resilient or spec.replicate_every or spec.faults:
        return GROUPS_WITH_FAULT_TOLERANCE
    return True


def group_limits(spec: JobSpec) -> GroupLimits | None:
    """What the runtime cannot train on a group of ``spec``'s model: its units with
    BatchNorm, and a member without a sample of a microbatch; ``None`` for a user model
    that cannot be built here (the planner then places no groups)."""
    solo = batchnorm_units(spec)
    return None if solo is None else GroupLimits(solo_units=solo, whole_samples=True)


def job_problem(
    spec: JobSpec, devices: list[DeviceSpec], pin_first: str | None = None, *, groups: bool = False
) -> PlanningProblem:
    """The planning problem of ``spec`` over ``devices`` (``pin_first`` holds the data):
    version 2 when the planner may place device groups (``groups``, see
    :func:`plans_groups`) or the job has an objective (the energy objective, or a
    deadline), else version 1; ``"groups"`` is ``groups``."""
    objective = spec.objective != "time" or spec.max_step_time_s is not None
    problem = build_problem(
        spec.model,
        devices,
        batch_size=spec.batch_size,
        microbatches=microbatches_of(planning_start(spec)),
        model_options=spec.model_options,
        pin_first=pin_first or spec.pin_first,
        version=2 if objective or groups else 1,
    )
    if not (objective or groups):
        return problem
    if spec.objective == "energy" and not any(d.watts_busy for d in devices):
        raise UserError(
            "objective energy: no device has power figures (watts_busy); "
            "agents announce them with a catalogue --profile"
        )
    goal = Objective(minimize=spec.objective, max_step_time_s=spec.max_step_time_s)
    return problem.model_copy(update={"groups": groups, "objective": goal})


def plan_over(
    spec: JobSpec,
    devices: list[DeviceSpec],
    *,
    again: bool = False,
    pin_first: str | None = None,
    where: str = "the devices",
    previous: Plan | None = None,
    groups: bool | None = None,
    device_units: Mapping[str, UnitSeconds] | None = None,
) -> PlannedJob:
    """Plan ``spec`` over ``devices`` with its ``partition``, ``stages`` and ``codec``; a
    one-line :class:`UserError` when it cannot be. ``again``: a re-plan, which plans one
    stage per device when fewer are left than the job's ``stages``, warm-started from
    ``previous`` when given (:func:`~coordinator.planner.partition.plan_job`). A re-plan
    of a job with ``group_sizes`` keeps the previous plan's groups, less the devices
    that are gone (a group left empty is dropped and the units split over the rest).
    ``groups``: whether the planner may place device groups (``None``:
    :func:`plans_groups` of the spec alone). ``device_units``: the unit seconds devices
    timed themselves (:mod:`coordinator.engine.unit_profiles`), which the cost model
    takes for those devices instead of this machine's scaled."""
    if not devices:
        raise UserError(f"no device of {where} may run this job")
    # "auto": planned with the plan ([Note: choosing the microbatches])
    choices = microbatch_choices_of(spec) if spec.microbatches == "auto" else None
    spec = planning_start(spec)
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
    if spec.data is not None:
        planned = _plan_on_holders(
            spec,
            devices,
            where,
            groups=plans_groups(spec) if groups is None else groups,
            device_units=device_units,
            choices=choices,
        )
        return _with_schedule(spec, planned)
    sizes = spec.group_sizes
    if again and sizes is not None and previous is not None:
        by_id = {d.id: d for d in devices}
        kept = [[d for d in st.devices if d in by_id] for st in previous.stages]
        devices = [by_id[d] for group in kept for d in group]
        sizes = tuple(len(group) for group in kept if group)
        stages = len(sizes)
    if groups is None:
        groups = plans_groups(spec)
    limits = group_limits(spec) if groups else None
    groups = limits is not None
    problem = job_problem(spec, devices, first, groups=groups)
    timed_rows = problem.batch_size / problem.microbatches
    # Agents that measured their fixed costs: predict what they will do.
    units = job_unit_seconds(spec, device_units) if calibrated(problem) else None
    options = PartitionOptions(
        partition=spec.partition, stages=stages, codec=spec.codec, group_sizes=sizes
    )
    search: dict[str, Any] = {
        "where": where,
        "previous": previous if again else None,
        "limits": limits,
        "units": units,
    }
    if choices is None:
        found = plan_job(problem, options, **search)
    else:
        problem, found = plan_job_microbatches(problem, choices, options, **search)
    if spec.diloco is not None and limits is not None:
        rows = problem.batch_size / problem.microbatches
        moved = None if units is None else units.at_rows(rows, timed_rows)
        found = _diloco_found(problem, found, moved, limits, spec.diloco.every)
    own = tuple(sorted(units.devices)) if units is not None else ()
    planned = PlannedJob(problem=problem, found=found, fewer_stages=fewer, own_units=own)
    return _with_schedule(spec, planned)


def _diloco_found(
    problem: PlanningProblem,
    found: FoundPlan,
    units: UnitSeconds | None,
    limits: GroupLimits,
    every: int,
) -> FoundPlan:
    """A non-exact job's plan ([Note: planning a DiLoCo job]): the search's, or one group
    of every device over the whole model, whichever the internal model predicts faster
    with groups that sum once in ``every`` steps."""
    guess = predict(problem, found.plan, units, sum_every=every)
    note = f"groups sum every {every} steps (DiLoCo, non-exact)"
    said = note if found.plan.grouped else "DiLoCo asked, but no group: exact"
    best = replace(found, prediction=guess, method=f"{found.method}; {said}")
    ids = [d.id for d in problem.devices]
    whole = Plan((Stage.group(ids, 0, len(problem.layers)),))
    if len(ids) < 2 or not limits.allows(problem, whole):
        return best
    score = score_plan(problem, whole)
    if not score.feasible:
        return best
    other = predict(problem, whole, units, sum_every=every)
    if other.step_time_s >= guess.step_time_s:
        return best
    ms = f"{other.step_time_s * 1e3:.1f} ms against the search's {guess.step_time_s * 1e3:.1f} ms"
    method = f"one group of every device over the whole model, {note}: predicted {ms}"
    return FoundPlan(score, method, exact=False, prediction=other)


def _with_schedule(spec: JobSpec, planned: PlannedJob) -> PlannedJob:
    """``planned`` under the job's schedule ([Note: choosing the schedule]), or a one-line
    :class:`UserError` when it does not fit its devices' memory under it."""
    plan = planned.plan
    problem = for_plan(planned.problem, plan)
    if spec.schedule == "auto":
        every = spec.diloco.every if spec.diloco is not None else 1
        schedule, steps = fastest_schedule(problem, plan, sum_every=every, split=not spec.compile)
        how = f"{schedule} of {', '.join(f'{n} {t * 1e3:.1f} ms' for n, t in steps.items())}"
    else:
        schedule, how = spec.schedule, ""
        why = None if schedule == "1f1b" else memory_error(problem, plan, schedule)
        if why is not None:
            raise UserError(why)
    found = planned.found
    if found.prediction is not None and schedule != found.prediction.schedule:
        prediction = under_schedule(planned.problem, plan, found.prediction, schedule)
        found = replace(found, prediction=prediction)
    if how:
        found = replace(found, method=f"{found.method}; schedule {how} (simulated)")
    return replace(planned, found=found, schedule=schedule)


def job_unit_seconds(
    spec: JobSpec, device_units: Mapping[str, UnitSeconds] | None = None
) -> UnitSeconds | None:
    """The model's units timed on this machine for the cost model (cached per shape), with
    the ``device_units`` devices timed themselves; ``None`` (the spec's FLOPs then) for
    a job on another dataset than its model's own, whose samples the timing cannot
    make, or a model that cannot be timed here."""
    try:
        if spec.dataset is not None and spec.dataset != get_model(spec.model).dataset:
            return None
        units = measure_unit_seconds(
            spec.model,
            spec.batch_size,
            microbatches_of(spec),
            model_options=spec.model_options,
            optimizer=spec.optimizer,
        )
    except Exception as exc:  # a user model: the prediction falls back to FLOPs
        log.warning("could not time the units of %s: %s", spec.model, exc)
        return None
    return replace(units, devices=dict(device_units)) if device_units else units


def _plan_on_holders(
    spec: JobSpec,
    devices: list[DeviceSpec],
    where: str,
    *,
    groups: bool,
    device_units: Mapping[str, UnitSeconds] | None = None,
    choices: tuple[int, ...] | None = None,
) -> PlannedJob:
    """The plan of a job on local data (``spec.data``): the devices that announce the
    dataset are stage 0, each with a share of every microbatch by how many samples it
    holds; the planner places the rest (:func:`~coordinator.planner.partition.plan_holders_job`),
    between two ends on the holders when the labels stay home too. ``choices``: an
    ``auto`` job's numbers of microbatches, the best of which the plan runs with (the
    holders' alternatives stay priced at the first).

    [Note: the split that does not pay]
    The holders' search chooses its cut by the spec's score, which prices a link's
    bytes at the link's rate and nothing else. The internal model (:func:`predict`)
    also sees each frame's fixed cost and the CPU that moves its bytes, which is
    what binds on slow links: on the demo's fleet with 100 Mbit/s links the score
    put the split ahead of the holders alone (355 against 312 samples/s) and the
    model behind (396 against 435). So the search's plan, if it hands units to
    helpers, runs only where the model predicts it faster than the holders alone,
    each at its best microbatches; otherwise the holders train alone.
    :mod:`coordinator.engine.links` shows where that happens for a job."""
    assert spec.data is not None
    name = spec.data.name
    held = {d.id: announced(d.model_dump()).get(name) for d in devices}
    holders = [d.id for d in devices if held[d.id] is not None]
    if not holders:
        raise UserError(f"no device of {where} holds local data {name!r}")
    counts = [held[h].samples for h in holders]  # type: ignore[union-attr]
    shares = [c / sum(counts) for c in counts]
    solo = batchnorm_units(spec) or frozenset()
    if not groups:  # the helpers train one device a stage
        solo = frozenset(range(get_model(spec.model, **spec.model_options).num_units))
    problem = job_problem(spec, devices, None, groups=True)
    units = job_unit_seconds(spec, device_units) if calibrated(problem) else None
    if choices is not None:  # [Note: a row for every holder]
        problem, units, choices = _rows_for_holders(problem, units, choices, len(holders))
    found, alternatives = plan_holders_job(
        problem,
        holders,
        shares,
        min_local_units=spec.data.min_local_units,
        limits=GroupLimits(solo_units=solo, whole_samples=True),
        where=where,
        labels_local=spec.data.labels_local,
        codec=spec.codec,
    )
    every = spec.diloco.every if spec.diloco is not None else 1

    def at_best(plan: Plan, score: PlanScore) -> tuple[PlanningProblem, PlanScore, Prediction]:
        return holders_at_best(
            problem, plan, score, units, shares=shares, choices=choices, sum_every=every
        )

    at, score, guess = at_best(found.plan, found.score)
    alone = alternatives.holders_alone
    if len(found.plan.stages) > 1 and alone.feasible:
        # [Note: the split that does not pay]
        alone_at, alone_score, alone_guess = at_best(alone.plan, alone)
        if alone_guess.step_time_s < guess.step_time_s:
            a, b = alone_guess.step_time_s * 1e3, guess.step_time_s * 1e3
            method = (
                f"the holders alone, predicted faster than the split: {a:.1f} ms a step "
                f"against its {b:.1f} ms"
            )
            found = FoundPlan(alone, method, False)
            at, score, guess = alone_at, alone_score, alone_guess
    if spec.diloco is not None:
        note = f"the holders average every {every} steps (DiLoCo, non-exact)"
        found = replace(found, method=f"{found.method}; {note}")
    found = replace(found, score=score, prediction=guess)
    own = tuple(sorted(units.devices)) if units is not None else ()
    return PlannedJob(problem=at, found=found, holders=alternatives, own_units=own)


def _rows_for_holders(
    problem: PlanningProblem,
    units: UnitSeconds | None,
    choices: tuple[int, ...],
    holders: int,
) -> tuple[PlanningProblem, UnitSeconds | None, tuple[int, ...]]:
    """An ``auto`` job on local data planned from a number of microbatches that gives
    each of its ``holders`` a sample of every microbatch.

    [Note: a row for every holder]
    An ``auto`` job's planning starts at :func:`~coordinator.planner.microbatches.
    first_microbatches` of its choices, and its units are timed at that shape
    (:func:`~coordinator.engine.assignments.planning_start`). On local data every
    holder computes whole samples of every microbatch, so a microbatch needs at least
    as many samples as there are holders: 32 holders cannot share 4 microbatches of
    16. Such a job keeps the choices with a sample a holder and starts from the first
    of those; its unit seconds move along their fitted lines to its rows
    (:meth:`~coordinator.planner.predict.UnitSeconds.at_rows`). A job that names its
    microbatches is planned at them, and too few samples a holder is its error."""
    fits = tuple(m for m in choices if problem.batch_size // m >= holders)
    if not fits or problem.microbatches in fits:
        return problem, units, choices
    rows = problem.batch_size / problem.microbatches
    m = first_microbatches(fits)
    at = problem.model_copy(update={"microbatches": m})
    moved = None if units is None else units.at_rows(at.batch_size / m, rows)
    return at, moved, fits


def holders_at_best(
    problem: PlanningProblem,
    plan: Plan,
    score: PlanScore,
    units: UnitSeconds | None,
    *,
    shares: list[float],
    choices: tuple[int, ...] | None,
    sum_every: int = 1,
) -> tuple[PlanningProblem, PlanScore, Prediction]:
    """``plan`` of a job on local data (stage 0 the holders, by their data ``shares``)
    predicted at its best number of microbatches of ``choices`` (an ``auto`` job;
    ``None``: at ``problem``'s, with ``score``), its groups summing once in
    ``sum_every`` steps: the problem at that number, the score and the prediction."""
    ends = holder_ends(plan, shares)

    def holders_scored(
        q: PlanningProblem, p: Plan, moved: UnitSeconds | None
    ) -> tuple[PlanScore, Prediction]:
        score = score_plan(for_plan(q, p), p, fixed_shares=ends)
        return score, predict(q, p, moved, fixed_shares=ends, sum_every=sum_every)

    guess = predict(problem, plan, units, fixed_shares=ends, sum_every=sum_every)
    chose = None
    if choices is not None:
        chose = best_microbatches(problem, plan, units, choices, holders_scored)
    if chose is None:
        return problem, score, guess
    at = problem.model_copy(update={"microbatches": chose.microbatches})
    return at, chose.score, chose.prediction


def _data_left(old: Plan, new: Plan) -> dict[str, Any]:
    """On local data, what a re-plan says: the holders whose data left the job with them
    (the job goes on with the rest's), and the holders it trains on now."""
    now = new.stages[0].devices
    return {
        "data_left_with": [d for d in old.stages[0].devices if d not in now],
        "holders": list(now),
    }


class JobEngine:
    """Drives jobs over the agents of ``fleet`` through the connected ``control``, every
    run as ``options`` say; ``servers()`` gives the fleet's server tier at each run
    (default: ``options.servers``)."""

    def __init__(
        self,
        control: MqttTransport,
        fleet: Fleet,
        actuator: FaultActuator,
        *,
        options: RunOptions = RunOptions(),
        servers: Callable[[], dict[str, str]] | None = None,
    ) -> None:
        self.control = control
        self.fleet = fleet
        self.actuator = actuator
        self.options = options
        self.servers = servers or (lambda: dict(options.servers))
        """Device -> torch device of the server-tier devices, whose stages form one process
        group; asked at each plan and run, as the fleet changes."""
        self._own_units: dict[tuple[str, str], UnitSeconds] = {}
        """(device, what was timed) -> the unit seconds that device timed itself."""
        self._own_units_lock = threading.Lock()

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
        resilient: bool = False,
    ) -> PlannedJob:
        """Plan ``spec`` over the fleet's available devices (in ``allowed``): :func:`plan_over`,
        with device groups where :func:`plans_groups` allows them (``resilient``: the run
        will have fault tolerance, which the spec may not say)."""
        devices = self.fleet.available(allowed)
        groups = plans_groups(spec, resilient=resilient, servers=bool(self.servers()))
        own = self.device_units(spec, devices) if spec.unit_times == "devices" else None
        return plan_over(
            spec,
            devices,
            again=again,
            pin_first=pin_first,
            where=where,
            previous=previous,
            groups=groups,
            device_units=own,
        )

    def device_units(
        self,
        spec: JobSpec,
        devices: list[DeviceSpec],
        timeout_s: float = 900.0,
        *,
        ask_new: bool = True,
    ) -> dict[str, UnitSeconds]:
        """The unit seconds each of ``devices`` timed itself for ``spec``'s model and batch
        shape (:mod:`coordinator.engine.unit_profiles`): asked of those that have not
        timed it yet (all at once, at most ``timeout_s``; not those too small to hold the
        whole model; none with ``ask_new`` false), kept for later jobs and re-plans. A
        device that could not time them is asked again next time."""
        request = timing_request(spec)
        what = request.model_dump_json(exclude={"request"})
        with self._own_units_lock:
            known = {d.id: self._own_units.get((d.id, what)) for d in devices}
            ask = [d for d in devices if known[d.id] is None and ask_new]
            if ask:
                needs = whole_model_bytes(job_problem(spec, devices))
                got = time_units_on_devices(
                    self.control, ask, request, timeout_s=timeout_s, needs_bytes=needs
                )
                log.info(
                    "%d of %d devices timed the units of %s in %.0f s",
                    len(got.seconds),
                    len(ask),
                    spec.model,
                    got.took_s,
                )
                for device, units in got.seconds.items():
                    self._own_units[(device, what)] = units
                    known[device] = units
        return {d: u for d, u in known.items() if u is not None}

    # -- running --------------------------------------------------------------------------

    def run(
        self,
        job: str,
        spec: JobSpec,
        planned: PlannedJob,
        *,
        hooks: JobHooks = JobHooks(),
        allowed: list[str] | None = None,
        pin_first: str | None = None,
        tolerance: Tolerance = Tolerance(),
    ) -> JobRun:
        """Run ``planned`` as job ``job``; :class:`~coordinator.engine.monitor.JobFailed` if
        it fails. Whether it runs with fault tolerance, and how often it replicates, is
        :meth:`replication`'s to say from ``spec`` and ``tolerance``; such a run re-plans
        over the devices still ``allowed`` (``pin_first`` on stage 0 while it lives).
        """
        spec = planned.resolve(spec)  # "auto": the plan's microbatches and schedule
        every = self.replication(spec, planned, tolerance)
        if every and planned.plan.u_shaped:  # its replicas, re-plans and hand-overs: not yet
            raise UserError('labels "local" cannot be combined with fault tolerance yet')
        if every == 0:
            result = run_on_agents(
                spec,
                planned.plan,
                self.control,
                job=job,
                on_step=hooks.on_step,
                shares=planned.shares,
                options=replace(self.options, servers=self.servers()),
            )
            return JobRun(result)
        told = replace(tolerance, replicate_every=every)
        return self._run_surviving(spec, planned, hooks, told, allowed, pin_first)

    @staticmethod
    def replication_asked(spec: JobSpec, tolerance: Tolerance = Tolerance()) -> int:
        """Replicate every how many steps a run of ``spec`` is asked to: ``tolerance``'s
        ``replicate_every``, else the spec's; with neither, faults to inject ask for fault
        tolerance (``-1``). 0: none; negative: as often as the plan's costs allow."""
        if tolerance.replicate_every is not None:
            return tolerance.replicate_every
        if spec.replicate_every:
            return spec.replicate_every
        faults = spec.faults if tolerance.faults is None else tolerance.faults
        return -1 if faults else 0

    @classmethod
    def fault_tolerant(cls, spec: JobSpec, tolerance: Tolerance = Tolerance()) -> bool:
        """Whether a run of ``spec`` told ``tolerance`` survives deaths and replicates:
        the one answer to that, for whoever must prepare for it (the service keeps such a
        job's replicas on disk, and resumes it when it restarts)."""
        return cls.replication_asked(spec, tolerance) != 0

    @classmethod
    def replication(
        cls, spec: JobSpec, planned: PlannedJob, tolerance: Tolerance = Tolerance()
    ) -> int:
        """Replicate every how many steps (0: no fault tolerance): :meth:`replication_asked`;
        a negative value is chosen from the plan's costs (:func:`replication_interval`), at
        most a tenth of the job so that a failure never costs more than that."""
        every = cls.replication_asked(spec, tolerance)
        if every < 0:
            most = max(1, spec.steps // 10)
            every = replication_interval(planned.problem, planned.plan, most=most)
        return every

    def _run_surviving(
        self,
        spec: JobSpec,
        planned: PlannedJob,
        hooks: JobHooks,
        tolerance: Tolerance,
        allowed: list[str] | None,
        pin_first: str | None,
    ) -> JobRun:
        """:meth:`run` with fault tolerance: a :class:`ResilientRun` on a connection of its
        own, replicating every ``tolerance.replicate_every`` steps."""
        every = tolerance.replicate_every or 0
        devices = [d.id for d in self.fleet.available(allowed)]
        for st in planned.plan.stages:  # a resumed job's devices may still be busy
            if st.device not in devices:
                devices.append(st.device)
        members = None if allowed is None else list(allowed)  # devices that join are added
        faults = tolerance.faults
        if faults is None:
            faults = tuple(parse_fault(text) for text in spec.faults)
        act = self._actor(hooks, devices, members)
        injector = FaultInjector(list(faults), act) if faults else None

        def first_of(alive: list[str]) -> str | None:
            """The pinned device while it lives; the first survivor after it died."""
            return pin_first if pin_first is None or pin_first in alive else alive[0]

        current = [planned.plan]  # the plan a re-plan starts from
        shares = {planned.plan: planned.shares}  # each plan's group shares

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
                resilient=True,
            )
            if hooks.on_plan is not None:
                hooks.on_plan(again)
            current[0] = again.plan
            shares[again.plan] = again.shares
            return again.plan

        def problem_for(alive: list[str]) -> PlanningProblem:
            profiles = {d.id: d for d in self.fleet.available(None)}
            profiles.update({d.id: d for d in planned.problem.devices if d.id not in profiles})
            known = [profiles[d] for d in alive if d in profiles]
            groups = plans_groups(spec, resilient=True, servers=bool(self.servers()))
            return job_problem(spec, known, first_of([d.id for d in known]), groups=groups)

        rebalance = (
            Rebalancer(problem_for, replicate_every=every, stages=spec.stages)
            if tolerance.rebalance
            else None
        )
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
                resilience=Resilience(
                    replicate_every=every,
                    rebalance=rebalance,
                    faults=injector,
                    replicas=tolerance.replicas,
                ),
                # Its attempts run over MQTT alone: no server tier (not yet).
                options=replace(self.options, servers={}),
                hooks=hooks,
                notes=PlanNotes(
                    shares=shares.get, explain=_data_left if spec.data is not None else None
                ),
            )
            got = run.run(planned.plan, tolerance.first_step)
        finally:
            control.close()
        return JobRun(
            got.result,
            resilient=got,
            replicate_every=every,
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
