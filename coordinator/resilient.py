"""Training that survives devices dying: detect, re-plan over the survivors, roll back, resume.

:func:`run_resilient` runs a job as a series of *attempts*, each an ordinary
:func:`~coordinator.runners.run_on_agents` run under its own job id (so no frame
of a cancelled attempt can reach the next one), with every stage publishing its
state (weights and optimizer state, safetensors) every ``replicate_every`` steps.

- **Detection** (:class:`DeviceWatch`): a device is dead when its retained
  status turns ``offline`` (its MQTT last will, sent by the broker the moment the
  connection drops, or its own goodbye) or when no heartbeat came for
  ``heartbeat_timeout_s``. A stage that reports a failure while a device of the
  plan is dead, or dies within the timeout, is a casualty of that death, not a
  failure of the job.
- **Recovery**: the attempt is cancelled on the survivors; the coordinator
  re-plans over the devices still alive (``replan``); every stage of the new
  plan starts at the newest step for which the replicas cover every unit
  (:class:`~coordinator.replicas.ReplicaStore`; step 0 needs none: stages build
  their seeded initial weights) with the state of exactly its units, and the
  data order continues from that step (the sampler is seeded by step). So a run
  with failures ends with the weights of a run without, up to rounding.
- **Reporting**: every failure and recovery is an event with its time; the
  result says how long recovery took (detection to the first step of the new
  attempt) and how many steps were redone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from coordinator.faults import FaultInjector
from coordinator.jobs import JobAborted, JobFailed, JobResult, JobSpec, new_job_id
from coordinator.planner.score import Plan
from coordinator.replicas import ReplicaStore
from coordinator.runners import run_on_agents
from edge.messages import DeviceStatus, StepReport
from edge.models.zoo import get_model
from edge.protocol import TOPIC_ROOT
from edge.transport.mqtt import MqttTransport

__all__ = ["DeviceWatch", "ResilientResult", "run_resilient"]

log = logging.getLogger(__name__)


class DeviceWatch:
    """Which of ``devices`` are dead, and since when (see the module docstring)."""

    def __init__(
        self, control: MqttTransport, devices: Iterable[str], heartbeat_timeout_s: float = 3.0
    ) -> None:
        self.control = control
        self.timeout_s = heartbeat_timeout_s
        self.devices = set(devices)
        self._seen = dict.fromkeys(self.devices, time.monotonic())
        self.dead: dict[str, tuple[float, str]] = {}
        """Device -> (``time.time()`` of detection, why)."""
        self._lock = threading.Lock()
        self._topics = [f"{TOPIC_ROOT}/devices/+/status", f"{TOPIC_ROOT}/devices/+/heartbeat"]

    def __enter__(self) -> DeviceWatch:
        self.control.subscribe(self._topics[0], self._on_status)
        self.control.subscribe(self._topics[1], self._on_heartbeat)
        return self

    def __exit__(self, *_exc: object) -> None:
        for topic in self._topics:
            self.control.unsubscribe(topic)

    def _device(self, topic: str) -> str | None:
        device = topic.split("/")[-2]
        return device if device in self.devices else None

    def _on_status(self, topic: str, payload: bytes) -> None:
        device = self._device(topic)
        if device is None:
            return
        try:
            status = DeviceStatus.model_validate_json(payload)
        except ValueError:
            return
        # Any offline is news: a running agent replaced the retained status with its
        # own online when it connected, and the last will was set before that.
        if status.state == "offline":
            self._mark(device, "offline (last will or goodbye)")
        elif status.state != "offline":
            with self._lock:
                self._seen[device] = time.monotonic()

    def _on_heartbeat(self, topic: str, _payload: bytes) -> None:
        device = self._device(topic)
        if device is not None:
            with self._lock:
                self._seen[device] = time.monotonic()

    def _mark(self, device: str, why: str) -> None:
        with self._lock:
            if device not in self.dead:
                self.dead[device] = (time.time(), why)
                log.warning("device %s is dead: %s", device, why)

    def dead_among(self, devices: Iterable[str]) -> list[str]:
        """Those of ``devices`` that are dead, checking heartbeats first."""
        now = time.monotonic()
        for device, seen in list(self._seen.items()):
            if now - seen > self.timeout_s:
                self._mark(device, f"no heartbeat for {now - seen:.1f} s")
        with self._lock:
            return [d for d in devices if d in self.dead]


@dataclass
class ResilientResult:
    result: JobResult
    """The whole job: every step's loss, all reports, the final weights."""
    events: list[dict[str, Any]] = field(default_factory=list)
    recovery_s: list[float] = field(default_factory=list)
    """Per recovery: from detecting the failure to the first step of the resumed run."""
    rolled_back_steps: int = 0
    steps_completed: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "events": self.events,
            "recovered": bool(self.recovery_s),
            "recovery_s": max(self.recovery_s) if self.recovery_s else None,
            "recoveries_s": self.recovery_s,
            "steps_completed": self.steps_completed,
            "rolled_back_steps": self.rolled_back_steps,
        }


def run_resilient(
    spec: JobSpec,
    plan: Plan,
    control: MqttTransport,
    replan: Callable[[list[str]], Plan],
    devices: list[str],
    *,
    replicate_every: int = 2,
    heartbeat_timeout_s: float = 3.0,
    faults: FaultInjector | None = None,
    on_step: Callable[[StepReport], None] | None = None,
    timeout_s: float = 3600.0,
    max_recoveries: int = 8,
) -> ResilientResult:
    """Run ``plan``, recovering from device deaths by re-planning over the living.

    ``replan(alive)`` gives the plan for the devices still alive (in ``devices``'
    order); ``faults`` fire as their steps are reported.
    """
    replicas = ReplicaStore(get_model(spec.model, **spec.model_options).unit_names)
    events: list[dict[str, Any]] = []
    losses: dict[int, float] = {}
    reports: list[StepReport] = []
    recovery_s: list[float] = []
    pending: dict[str, float] = {}  # detection time of the failure being recovered from
    rolled_back = 0
    started = time.perf_counter()

    def event(kind: str, **fields: Any) -> None:
        events.append({"type": kind, "ts": time.time(), **fields})

    def stepped(report: StepReport) -> None:
        reports.append(report)
        if report.loss is not None:
            losses[report.step] = report.loss
        if "t" in pending:
            recovery_s.append(time.time() - pending.pop("t"))
            event("resumed", step=report.step, recovery_s=recovery_s[-1])
        if faults is not None:
            faults.on_step(report)
        if on_step is not None:
            on_step(report)

    first_step = 0
    with DeviceWatch(control, devices, heartbeat_timeout_s) as watch, replicas.listening(control):
        for _ in range(max_recoveries + 1):
            job = new_job_id()
            replicas.accept(job)
            current = [st.device for st in plan.stages]
            if faults is not None:
                faults.use_plan(current)
            event("attempt", job=job, first_step=first_step, plan=plan.to_json())

            def abort(current: list[str] = current) -> str | None:
                dead = watch.dead_among(current)
                return f"device {dead[0]} died" if dead else None

            restore = None
            if first_step > 0:
                restore = {
                    s: replicas.compose(first_step, st.start, st.end, job, s)
                    for s, st in enumerate(plan.stages)
                }
            try:
                last = run_on_agents(
                    spec, plan, control, job=job, on_step=stepped, timeout_s=timeout_s,
                    first_step=first_step, replicate_every=replicate_every, restore=restore,
                    abort=abort,
                )  # fmt: skip
                break
            except JobAborted:
                pass
            except JobFailed:
                # A stage failing because its neighbour died: wait for the death to show.
                deadline = time.monotonic() + heartbeat_timeout_s + 0.5
                while not watch.dead_among(current) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if not watch.dead_among(current):
                    raise
            dead = watch.dead_among(current)
            detected = min(watch.dead[d][0] for d in dead)
            for d in dead:
                event("failure", device=d, detected_at=watch.dead[d][0], why=watch.dead[d][1])
            alive = [d for d in devices if d not in watch.dead]
            done = max(losses, default=-1) + 1
            first_step = replicas.newest_complete(done)
            rolled_back += done - first_step
            for step in [s for s in losses if s >= first_step]:
                del losses[step]
            if not alive:
                raise JobFailed("every device of the job died")
            plan = replan(alive)
            pending["t"] = detected
            event("recovery", rollback_to=first_step, redo_steps=done - first_step,
                  survivors=alive, plan=plan.to_json())  # fmt: skip
        else:
            raise JobFailed(f"gave up after {max_recoveries} recoveries")
    result = JobResult(
        last.job, plan, spec, [losses[s] for s in sorted(losses)], reports,
        time.perf_counter() - started, last.weights,
    )  # fmt: skip
    return ResilientResult(result, events, recovery_s, rolled_back, len(losses))
