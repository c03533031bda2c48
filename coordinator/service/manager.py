"""The job manager: accepts jobs, plans them over the fleet, drives them, stores everything.

A job moves through the states of :mod:`coordinator.service.store.sqlite`:
``pending`` when submitted; ``planning`` while a plan over the online devices
it may use is searched; ``running`` while the job engine
(:class:`~coordinator.engine.engine.JobEngine`) runs its stages on the agents;
then ``completed``, ``failed`` (with the reason) or ``cancelled``. One job runs
at a time, in submission order, on a worker thread; every step report is stored and announced on the
event bus as it arrives, and the trained weights are kept as safetensors in
the data directory. On start, jobs a previous coordinator left planning or
running are marked failed (``coordinator restarted``) and pending ones are
queued again.

A job is planned by the engine with its ``partition`` and ``stages``; with
``stages=N`` it fails when fewer than ``N`` devices may run it, except when
it is planned again (after a device died, or when a restarted coordinator
resumes it): then it runs on one stage per device left and logs a ``replan``
event saying so.

Whether a job runs with fault tolerance (it has ``replicate_every``) is the
engine's to say (:meth:`~coordinator.engine.engine.JobEngine.fault_tolerant`); the
manager asks it, to keep such a job's replicas on disk and to resume it after a
restart. Such a job runs exactly as ``edgetrain train`` runs one: it survives
device deaths and migrates to a faster plan when its measured stage times drift or
a device joins. Its ``faults`` fire through the
manager's :class:`~coordinator.engine.faults.FaultActuator`; a job whose
first plan lacks a fault's stage fails at once, naming the fault and the
plan's stages (it would never fire); each is a ``fault`` event of the job when
it fires (a coordinator that resumes the job skips those), and a device that
joins is added to the job's devices once the registry has it online. The
manager keeps what the engine reports: steps, plans, attempts (in
``attempts.json``, so that a restarted coordinator can cancel them and resume
from the replicas), and events.

Tested in tests/unit/coordinator/service/test_final_jobs.py (its paths to an end that
need no agent), tests/e2e/test_service.py (jobs planned, run and stored on real agents)
and tests/e2e/test_coordinator_restart.py (a job resumed by a new coordinator).
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from coordinator.engine.egress import egress
from coordinator.engine.engine import JobEngine, PlannedJob
from coordinator.engine.faults import (
    Fault,
    FaultActuator,
    ThrottleActuator,
    check_fault_stages,
    parse_fault,
)
from coordinator.engine.links import at_links, holders_of, link_ladder, split_stops_paying
from coordinator.engine.monitor import JobFailed, JobResult
from coordinator.engine.options import JobAccess, JobHooks, RunOptions, Tolerance
from coordinator.engine.replicas import ReplicaStore
from coordinator.engine.runners import server_tier
from coordinator.engine.spec import JobSpec, new_job_id
from coordinator.planner.anatomy import AnatomyMeter
from coordinator.planner.baselines import job_baselines
from coordinator.planner.bounds import certificate
from coordinator.planner.predict import Prediction
from coordinator.planner.score import Plan, for_plan
from coordinator.planner.simulator import simulate
from coordinator.service.events import EventBus
from coordinator.service.registry import DeviceRegistry
from edge.errors import UserError
from edge.files import write_atomic
from edge.models.zoo import get_model
from edge.problem import DeviceSpec
from edge.transport.mqtt import MqttTransport
from edge.wire.messages import CancelJob, StepReport
from edge.wire.topics import device_cmd

__all__ = ["JobManager"]

log = logging.getLogger(__name__)

RESUME_WAIT_S = 20.0
"""Resuming a job: how long the devices of its last attempt may take to be idle again."""


class JobManager:
    """Runs submitted jobs one at a time (see the module docstring)."""

    def __init__(
        self,
        store: Any,
        bus: EventBus,
        registry: DeviceRegistry,
        control: MqttTransport,
        *,
        on_step: Callable[[str, StepReport], None] | None = None,
        actuator: FaultActuator | None = None,
        access: JobAccess | None = None,
    ) -> None:
        self.store = store
        self.bus = bus
        self.registry = registry
        self.control = control
        self.actuator: FaultActuator = actuator or ThrottleActuator(control)
        """What jobs' faults are done with (kill and join need a testbed's)."""
        self.engine = JobEngine(
            control,
            registry,
            self.actuator,
            options=RunOptions(access=access),
            servers=self._servers,
        )
        """Every job is driven by it: planned, run, recovered, migrated."""
        self.on_step = on_step
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._cancelled: set[str] = set()
        self._running: dict[str, list[str]] = {}
        self._attempt: dict[str, str] = {}  # job -> id of the attempt its stages run under
        self._resume: set[str] = set()  # jobs a previous coordinator left running
        self._meters: dict[str, AnatomyMeter] = {}  # job -> its plan's measured anatomy
        self._stopping = False
        self._lock = threading.Lock()
        self._worker = threading.Thread(target=self._work, name="job-worker", daemon=True)

    def start(self) -> None:
        for record in self.store.list_jobs(limit=10_000, offset=0, state="running"):
            if self.engine.fault_tolerant(JobSpec.model_validate(record.spec)):
                why = "coordinator restarted: resuming from the replicas"
                self.store.set_job_state(record.id, "planning", reason=why)
                self._resume.add(record.id)
                log.warning("job %s was running when the coordinator stopped: resuming", record.id)
        for job in self.store.mark_interrupted("coordinator restarted", keep=self._resume):
            log.warning("job %s was running when the coordinator stopped: failed", job)
        for job in sorted(self._resume):
            self._queue.put(job)
        for job in reversed(self.store.list_jobs(limit=10_000, offset=0, state="pending")):
            self._queue.put(job.id)
        self._worker.start()

    def stop(self) -> None:
        """Stop the agents' stages and the worker; a running job stays ``running`` in the
        store, so the next coordinator marks it failed (``coordinator restarted``)."""
        with self._lock:
            self._stopping = True
            running = dict(self._running)
        for job, devices in running.items():
            for device in devices:
                attempt = self._attempt.get(job, job)
                cancel = CancelJob(job=attempt, reason="coordinator stopping")
                with contextlib.suppress(ConnectionError):
                    self.control.publish(device_cmd(device), cancel.model_dump_json(), 1)
        self._queue.put(None)
        self._worker.join(timeout=10)

    def submit(self, spec: JobSpec, devices_allowed: list[str] | None = None) -> str:
        job = new_job_id()
        self.store.create_job(job, spec.model_dump(mode="json"), devices_allowed)
        self._announce(job)
        self._queue.put(job)
        return job

    def cancel(self, job: str) -> bool:
        """Cancel a pending or running job; ``False`` if it had already ended."""
        record = self.store.get_job(job)
        if record is None or record.state in ("completed", "failed", "cancelled"):
            return False
        with self._lock:
            self._cancelled.add(job)
            devices = self._running.get(job, [])
            attempt = self._attempt.get(job, job)
        for device in devices:
            self.control.publish(device_cmd(device), CancelJob(job=attempt).model_dump_json(), 1)
        if record.state == "pending":
            with contextlib.suppress(ValueError):  # the worker may have just taken it
                self.store.set_job_state(job, "cancelled", reason="cancelled by the user")
            self._announce(job)
        return True

    def links(self, job: str, rates: list[float] | None = None) -> dict[str, Any]:
        """Job ``job`` (known) planned on slower links (:mod:`coordinator.engine.links`),
        over the devices online now that it allows (idle or busy, its own run too),
        each priced by the unit seconds it timed already (none is asked to time them):
        the ladder of ``rates`` and the rate below which its plan stops handing units to
        helpers. A one-line :class:`UserError` for a job on no local data, or whose
        devices are offline."""
        record = self.store.get_job(job)
        if record is None:
            raise KeyError(job)
        spec = JobSpec.model_validate(record.spec)
        devices = self.registry.planning_profiles(record.devices_allowed)
        if not holders_of(spec, devices):
            raise UserError(f"no holder of job {job}'s data is online")
        own = None
        if spec.unit_times == "devices":
            own = self.engine.device_units(spec, devices, ask_new=False)
        ladder = link_ladder(spec, devices, rates, own)
        below = split_stops_paying(ladder, lambda mbps: at_links(spec, devices, mbps, own))
        return {
            "job": job,
            "ladder": [rung.to_json() for rung in ladder],
            "split_stops_paying_below_mbps": below,
        }

    def _announce(self, job: str) -> None:
        record = self.store.get_job(job)
        if record is not None:
            self.bus.publish("job", {"id": job, "state": record.state, "reason": record.reason})

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            record = self.store.get_job(job)
            resuming = job in self._resume and record is not None and record.state == "planning"
            if record is None or (record.state != "pending" and not resuming):
                continue
            try:
                self._run(job, JobSpec.model_validate(record.spec), record.devices_allowed)
            except Exception as exc:  # never let one job end the worker
                log.exception("job %s failed", job, extra={"job": job})
                self._finish(job, "failed", f"{type(exc).__name__}: {exc}")

    def _finish(self, job: str, state: str, reason: str | None = None, **fields: Any) -> None:
        self._meters.pop(job, None)
        with self._lock:
            self._running.pop(job, None)
            if self._stopping and state != "completed":
                return  # the next start marks it failed: "coordinator restarted"
            if job in self._cancelled and state == "failed":
                state, reason = "cancelled", "cancelled by the user"
            self._cancelled.discard(job)
        try:
            self.store.set_job_state(job, state, reason=reason, **fields)
        except ValueError:  # it reached a final state meanwhile (a cancel won the race)
            log.info("job %s already ended; not marking it %s", job, state)
        else:
            level = logging.WARNING if state == "failed" else logging.INFO
            log.log(level, "job %s %s", job, state, extra={"job": job, "reason": reason})
        self._announce(job)

    def _measure(self, job: str, report: StepReport) -> None:
        """Add one step report to the job's measured anatomy; store the mean each time a
        step was measured ([Note: the measured anatomy] in
        :mod:`coordinator.planner.anatomy`)."""
        meter = self._meters.get(job)
        if meter is not None and meter.add(report):
            measured = _measured(meter)
            if measured is not None:
                self.store.set_job_anatomy(job, measured)

    def _store_plan(self, job: str, spec: JobSpec, planned: PlannedJob) -> None:
        """The job's plan, its baselines and simulation, as the API shows them; a re-plan
        on fewer stages than asked is a ``replan`` event."""
        if planned.fewer_stages is not None:
            detail = {
                "stages_asked": spec.stages,
                "stages": len(planned.plan.stages),
                "why": planned.fewer_stages,
            }
            self.store.add_job_event(job, "replan", detail)
        problem, score = planned.problem, planned.score
        # A plan on groups is scored (and so simulated) under version 2, as it was planned.
        as_planned = for_plan(problem, score.plan)
        sim = simulate(as_planned, score.plan, planned.schedule)
        members = sum(len(st.devices) for st in score.plan.stages)
        self._meters[job] = AnatomyMeter(members)  # a new plan is measured afresh
        self.store.set_job_plan(
            job,
            {
                **score.to_json(),
                "stages": score.plan.to_json(score.shares),  # each with devices and shares
                "method": planned.found.method,
                "exact": planned.found.exact,
                "partition": spec.partition,
                "stages_asked": spec.stages,
                "microbatches": problem.microbatches,  # an "auto" job's: the plan's choice
                "schedule": planned.schedule,  # likewise
                "training": spec.training,  # exact, or non-exact and why
                "compute_s": score.compute_s,
                "link_s": score.link_s,
                # What the job shows is the internal model's prediction (fixed costs and
                # measured unit times); the spec's figures stay under "spec".
                **_predicted(score.to_json(), planned.found.prediction),
                "units": [unit.name for unit in problem.layers],
                "baselines": job_baselines(problem, planned.holders),
                "egress": egress(spec, score.plan),
                "simulation": sim.to_json(),
                "anatomy": planned.anatomy().to_json(),
                # The spec's step against the least any plan of the problem could take.
                **certificate(as_planned, score.step_time_s),
            },
        )

    def _run(self, job: str, spec: JobSpec, allowed: list[str] | None) -> None:
        try:
            self.store.set_job_state(job, "planning")
        except ValueError:  # cancelled between the queue and here
            return
        self._announce(job)
        resuming = job in self._resume
        if resuming:
            self._stop_previous(job)
        try:
            planned = self.engine.plan(spec, allowed, again=resuming)
        except UserError as exc:
            self._finish(job, "failed", exc.message)
            return
        spec = planned.resolve(spec)  # "auto": the plan's microbatches and schedule
        self._store_plan(job, spec, planned)
        plan = planned.plan
        if not resuming:  # a resumed job's plan may have lost stages to failures
            try:
                check_fault_stages(
                    map(parse_fault, spec.faults), [len(st.devices) for st in plan.stages], "fault"
                )
            except UserError as exc:
                self._finish(job, "failed", exc.message)
                return
        with self._lock:
            cancelled = job in self._cancelled
            if not cancelled:
                self._running[job] = plan.devices  # a group's every member: cancels reach all
        if cancelled:
            self._finish(job, "cancelled", "cancelled by the user")
            return
        self.store.set_job_state(job, "running", started=time.time())
        self._announce(job)

        def on_step(report: StepReport) -> None:
            self.store.add_step(job, report)
            self._measure(job, report)
            if report.loss is not None:  # the last stage's report closes the step
                with contextlib.suppress(ValueError):
                    self.store.set_job_state(job, "running", steps_done=report.step + 1)
            self.bus.publish("step", {"job": job, **report.model_dump(mode="json")})
            if self.on_step is not None:
                self.on_step(job, report)

        try:
            result = self._drive(job, spec, allowed, planned, on_step)
        except JobFailed as exc:
            self._finish(job, "failed", str(exc), finished=time.time())
            return
        if result.rejected:  # messages the sender checks ignored: a device spoke out of turn
            self.store.add_job_event(job, "rejected", dict(result.rejected))
        self.store.add_job_event(job, "traffic", result.traffic())
        write_atomic(self.store.model_path(job), result.weights_bytes())
        self._finish(
            job, "completed", None, finished=time.time(), samples_per_s=result.samples_per_s
        )

    def _drive(
        self,
        job: str,
        spec: JobSpec,
        allowed: list[str] | None,
        planned: PlannedJob,
        on_step: Callable[[StepReport], None],
    ) -> JobResult:
        """Run ``job`` through the engine, keeping what it reports.

        A job the engine runs with fault tolerance (:meth:`JobEngine.fault_tolerant`)
        survives device deaths, migrates to faster plans and resumes what a previous
        coordinator began: its replicas live in the job's folder (``replicas/``) and the
        attempts it ran in ``attempts.json``, so that a restarted coordinator cancels those
        attempts on their devices and resumes from the newest step the replicas cover.
        """
        folder = self.store.model_path(job).parent
        attempts_file = folder / "attempts.json"
        attempts: list[dict[str, Any]] = (
            json.loads(attempts_file.read_text()) if attempts_file.exists() else []
        )
        self._resume.discard(job)  # _stop_previous stopped what a previous coordinator ran
        tolerance = Tolerance()
        if self.engine.fault_tolerant(spec):
            units = get_model(spec.model, **spec.model_options).unit_names
            replicas = ReplicaStore(units, folder / "replicas")
            tolerance = Tolerance(
                faults=tuple(self._faults_left(job, spec)),
                replicas=replicas,
                first_step=replicas.newest_complete(spec.steps),
            )

        def on_attempt(attempt: str, attempt_plan: Plan, first: int) -> None:
            devices = attempt_plan.devices
            with self._lock:
                self._attempt[job], self._running[job] = attempt, devices
            attempts.append({"job": attempt, "devices": devices})
            folder.mkdir(parents=True, exist_ok=True)
            write_atomic(attempts_file, json.dumps(attempts).encode())
            detail = {"attempt": attempt, "devices": devices, "first_step": first}
            self.store.add_job_event(job, "attempt", detail)

        def on_fault(fault: Fault, detail: dict[str, Any]) -> None:
            event = {"fault": str(fault), "fired": True, "step": fault.step, **detail}
            self.store.add_job_event(job, "fault", event)

        def on_join(device: str, online: bool) -> None:
            self.store.add_job_event(job, "joined", {"device": device, "online": online})

        def step(report: StepReport) -> None:  # stored as the job's, not the attempt's
            on_step(report.model_copy(update={"job": job}))

        hooks = JobHooks(
            on_step=step,
            on_plan=lambda again: self._store_plan(job, spec, again),
            on_attempt=on_attempt,
            on_fault=on_fault,
            on_join=on_join,
        )
        got = self.engine.run(job, spec, planned, hooks=hooks, allowed=allowed, tolerance=tolerance)
        events = got.resilient.events if got.resilient is not None else []
        for e in events:
            if e["type"] in ("failure", "recovery", "migration", "broker-lost", "resumed"):
                self.store.add_job_event(job, e["type"], e)
        for fault in got.unfired:
            why = f"no stage {fault.stage} was running when step {fault.step} was reported"
            self.store.add_job_event(
                job, "fault", {"fault": str(fault), "fired": False, "why": why}
            )
        with self._lock:
            self._attempt.pop(job, None)
        return got.result

    def _stop_previous(self, job: str) -> None:
        """Cancel the attempts a previous coordinator left running for ``job`` and wait
        (at most :data:`RESUME_WAIT_S`) until the devices of the last one are idle, so
        that the job is planned again over all of them."""
        attempts_file = self.store.model_path(job).parent / "attempts.json"
        if not attempts_file.exists():
            return
        attempts: list[dict[str, Any]] = json.loads(attempts_file.read_text())
        for old in attempts:
            for device in old["devices"]:
                cancel = CancelJob(job=old["job"], reason="coordinator restarted")
                with contextlib.suppress(ConnectionError):
                    self.control.publish(device_cmd(device), cancel.model_dump_json(), 1)
        last = attempts[-1]["devices"] if attempts else []
        deadline = time.monotonic() + RESUME_WAIT_S
        while time.monotonic() < deadline:
            views = [self.registry.get(d) for d in last]
            if all(v is not None and v.state == "online" for v in views):
                return
            time.sleep(0.1)
        log.warning("job %s: not every device of its last attempt is idle: %s", job, last)

    def _servers(self) -> dict[str, str]:
        """Devices that announced themselves as server tier (``edgetrain agent --server`` or
        ``--device cuda``): their stages of a job form one torch.distributed group."""
        profiles = {
            d.id: DeviceSpec.model_validate({**d.profile, "id": d.id})
            for d in self.registry.devices()
            if d.profile
        }
        return server_tier(profiles)

    def _faults_left(self, job: str, spec: JobSpec) -> list[Fault]:
        """The job's faults, less those a previous coordinator already fired."""
        fired = {
            e.detail.get("fault")
            for e in self.store.job_events(job)
            if e.kind == "fault" and e.detail and e.detail.get("fired")
        }
        return [f for f in (parse_fault(t) for t in spec.faults) if str(f) not in fired]


def _measured(meter: AnatomyMeter) -> dict[str, Any] | None:
    """What the job stores of its measured anatomy: the mean, and over how many steps."""
    mean = meter.mean()
    return None if mean is None else {**mean.to_json(), "steps": meter.steps}


def _predicted(spec: dict[str, Any], prediction: Prediction | None) -> dict[str, Any]:
    """A job plan record's predicted figures: the internal model's where there is one,
    beside the spec score's (``spec``)."""
    if prediction is None:
        return {}
    keep = ("step_time_s", "bottleneck_s", "throughput_sps")
    return {
        **prediction.to_json(),
        "predicted_by": "fixed costs and measured unit times",
        "spec": {k: spec[k] for k in keep},
    }
