"""Training that survives devices dying: detect, re-plan over the survivors, roll back, resume.

:func:`run_resilient` runs a job as a series of *attempts*, each an ordinary
:func:`~coordinator.engine.runners.run_on_agents` run under its own job id (so no frame
of a cancelled attempt can reach the next one), with every stage publishing its
state (weights and optimizer state, safetensors) every ``replicate_every`` steps.

- **Detection** (:class:`DeviceWatch`): a device is dead when its retained
  status turns ``offline`` (its MQTT last will, sent by the broker the moment
  the connection drops, or its own goodbye; confirmed after :data:`CONFIRM_S`,
  as a broker shutting down sends every client's will) or when no heartbeat came
  for ``heartbeat_timeout_s`` while the coordinator itself had the broker. A
  stage that reports a failure while a device of the plan is dead, or dies
  within the timeout, is a casualty of that death, not a failure of the job.
- **Recovery**: the attempt is cancelled on the survivors; the coordinator
  re-plans over the devices still alive (``replan``); every stage of the new
  plan starts at the newest step for which the replicas cover every unit
  (:class:`~coordinator.engine.replicas.ReplicaStore`; step 0 needs none: stages build
  their seeded initial weights) with the state of exactly its units, and the
  data order continues from that step (the sampler is seeded by step). So a run
  with failures ends with the weights of a run without, up to rounding.
- **Reporting**: every fault fired (which, on which device, at which step's
  report), failure and recovery is an event with its time; the result says how
  long recovery took (detection to the first step of the new attempt) and how
  many steps were redone.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from coordinator.engine.faults import FaultInjector
from coordinator.engine.replicas import ReplicaStore
from coordinator.engine.runners import run_on_agents
from coordinator.engine.spec import JobAborted, JobFailed, JobResult, JobSpec, new_job_id
from coordinator.planner.score import Plan
from edge.models.zoo import get_model
from edge.transport.mqtt import MqttTransport
from edge.wire.messages import CancelJob, DeviceStatus, StepReport
from edge.wire.topics import TOPIC_ROOT, device_cmd

__all__ = ["DeviceWatch", "ResilientResult", "run_resilient"]

log = logging.getLogger(__name__)


CONFIRM_S = 0.3
"""An offline status counts once the broker connection outlived it by this long."""
RECONNECT_GRACE_S = 35.0
"""After the broker came back, heartbeats are not judged for this long (an agent's
reconnect back-off is at most 30 s by default)."""


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
        self._reconnects = control.reconnects
        self._grace_until = 0.0
        self._heard: dict[str, float] = {}  # only real messages, unlike _seen
        self._suspects: dict[str, tuple[float, float]] = {}
        """Devices reported offline: (when, monotonic) until confirmed (see dead_among)."""

    def __enter__(self) -> DeviceWatch:
        self.control.subscribe(self._topics[0], self._on_status)
        self.control.subscribe(self._topics[1], self._on_heartbeat)
        return self

    def __exit__(self, *_exc: object) -> None:
        for topic in self._topics:
            self.control.unsubscribe(topic)

    def follow(self, devices: Iterable[str]) -> None:
        """Watch these too (devices that joined); their heartbeat clock starts now."""
        with self._lock:
            for device in devices:
                if device not in self.devices:
                    self.devices.add(device)
                    self._seen[device] = time.monotonic()

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
            with self._lock:  # confirmed by dead_among unless the broker goes away first
                self._suspects.setdefault(device, (time.time(), time.monotonic()))
        else:
            with self._lock:
                self._seen[device] = self._heard[device] = time.monotonic()
                self._suspects.pop(device, None)

    def _on_heartbeat(self, topic: str, _payload: bytes) -> None:
        device = self._device(topic)
        if device is not None:
            with self._lock:
                self._seen[device] = self._heard[device] = time.monotonic()

    def wait_heard(self, devices: list[str], since: float, timeout: float) -> list[str]:
        """Wait until each of ``devices`` was heard after ``since`` (monotonic); the silent."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                silent = [d for d in devices if self._heard.get(d, -1.0) < since]
            if not silent or time.monotonic() >= deadline:
                return silent
            time.sleep(0.05)

    def _mark(self, device: str, why: str, when: float | None = None) -> None:
        with self._lock:
            self._suspects.pop(device, None)
            if device not in self.dead:
                self.dead[device] = (when or time.time(), why)
                log.warning("device %s is dead: %s", device, why)

    def settle(self, timeout_s: float = 2 * CONFIRM_S) -> None:
        """Wait (at most ``timeout_s``) until no offline report awaits confirmation.

        Devices that die together (two agents killed at once) send their last wills
        milliseconds apart, so the first may be confirmed while the next is still a
        suspect; recovering then would plan over a dead device and recover again.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            self.dead_among(())
            with self._lock:
                if not self._suspects or time.monotonic() >= deadline:
                    return
            time.sleep(0.05)

    def dead_among(self, devices: Iterable[str]) -> list[str]:
        """Those of ``devices`` that are dead, checking heartbeats first.

        Heartbeats are not judged while this side has no broker, and the clocks
        restart when it is back: the silence was the broker's, not the devices'.
        """
        now = time.monotonic()
        if self.control.reconnects != self._reconnects or not self.control.connected:
            # A broker that shuts down publishes every client's last will: offline
            # reports that came just before losing it prove nothing.
            self._reconnects = self.control.reconnects
            with self._lock:
                self._seen = dict.fromkeys(self._seen, now)
                self._suspects.clear()
            # Agents back off between reconnects (up to their reconnect_max_s): give them
            # time to find the broker again before their silence counts.
            self._grace_until = now + RECONNECT_GRACE_S
        with self._lock:
            confirmed = [(d, t) for d, (t, m) in self._suspects.items() if now - m >= CONFIRM_S]
        for device, when in confirmed:
            self._mark(device, "offline (last will or goodbye)", when)
        if self.control.connected and now >= self._grace_until:
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
    rebalance: Callable[[Plan, list[str], dict[str, float], int], Plan | None] | None = None,
    settle_steps: int = 3,
    replicas: ReplicaStore | None = None,
    first_step: int = 0,
    on_attempt: Callable[[str, Plan, int], None] | None = None,
) -> ResilientResult:
    """Run ``plan``, recovering from device deaths by re-planning over the living.

    ``replan(alive)`` gives the plan for the devices still alive (in ``devices``' order;
    the caller may append devices that join, once they are online); ``faults`` fire as
    their steps are reported. ``rebalance(plan, alive, compute_s, steps_left)`` is asked
    (on the calling thread) after every step, once an attempt has run ``settle_steps``
    steps, with each stage device's measured compute seconds per step (mean of the last
    two): a plan it returns is migrated to at once (the stages roll back to the newest
    replica, as after a failure, and resume).

    To resume a job a previous coordinator ran: pass its ``replicas`` (kept on disk) and
    ``first_step``, the newest step they cover; ``on_attempt(job, plan, first_step)``
    hears of every attempt before it starts, so that it can be cancelled later.
    """
    if replicas is None:
        replicas = ReplicaStore(get_model(spec.model, **spec.model_options).unit_names)
    events: list[dict[str, Any]] = []
    losses: dict[int, float] = {}
    reports: list[StepReport] = []
    recovery_s: list[float] = []
    pending: dict[str, Any] = {}  # "t": when the failure (or migration) being handled began
    rolled_back = 0
    started = time.perf_counter()

    def event(kind: str, **fields: Any) -> None:
        events.append({"type": kind, "ts": time.time(), **fields})

    current_reports: list[StepReport] = []
    migrate: dict[str, Any] = {}
    state: dict[str, Any] = {"plan": plan, "first": 0}

    def consider_rebalance(report: StepReport) -> None:
        attempt_plan: Plan = state["plan"]
        if rebalance is None or migrate or report.stage != 0:  # stage 0 ends a step last
            return
        if report.step - state["first"] + 1 < settle_steps:
            return
        last = [report.step - 1, report.step]
        compute: dict[str, float] = {}
        for s, st in enumerate(attempt_plan.stages):
            got = [r.compute_s for r in current_reports if r.stage == s and r.step in last]
            if len(got) < 2:
                return
            compute[st.device] = sum(got) / len(got)
        step_s = [r.step_s for r in current_reports if r.stage == 0 and r.step in last]
        watch.follow(devices)  # the caller appends devices that joined
        alive = [d for d in devices if d not in watch.dead]
        better = rebalance(attempt_plan, alive, compute, spec.steps - report.step - 1)
        if better is not None and better != attempt_plan:
            before = spec.batch_size / (sum(step_s) / len(step_s)) if step_s else None
            migrate.update(plan=better, before_sps=before, at=time.time(), compute_s=compute)

    due: list[StepReport] = []  # the newest step-ending report not yet weighed

    def stepped(report: StepReport) -> None:
        reports.append(report)
        current_reports.append(report)
        if report.loss is not None:
            losses[report.step] = report.loss
        if rebalance is not None and report.stage == 0:
            due[:] = [report]  # weighed by abort(), on the caller's thread, not paho's
        if "t" in pending:
            took = time.time() - pending.pop("t")
            kind = pending.pop("kind", "failure")
            if kind != "failure":
                event("resumed", step=report.step, **{f"{kind}_s": took})
            else:
                recovery_s.append(took)
                event("resumed", step=report.step, recovery_s=took)
        if faults is not None:
            for fault, device in faults.on_step(report):
                event("fault", fault=str(fault), stage=fault.stage, device=device, step=report.step)
        if on_step is not None:
            on_step(report)

    def attempt_end(job: str, first: int) -> None:
        """The attempt's steady samples/s: stage 0's step times after its first two steps."""
        times = [r.step_s for r in current_reports if r.stage == 0 and r.step >= first + 2]
        sps = spec.batch_size * len(times) / sum(times) if times and sum(times) > 0 else None
        event(
            "attempt_end",
            job=job,
            first_step=first,
            samples_per_s=sps,
            steps=len({r.step for r in current_reports}),
        )

    with DeviceWatch(control, devices, heartbeat_timeout_s) as watch, replicas.listening(control):
        for _ in range(max_recoveries + 1):
            job = new_job_id()
            replicas.accept(job)
            current = [st.device for st in plan.stages]
            if faults is not None:
                faults.use_plan(current)
            event("attempt", job=job, first_step=first_step, plan=plan.to_json())
            if on_attempt is not None:
                on_attempt(job, plan, first_step)

            current_reports.clear()
            due.clear()
            state.update(plan=plan, first=first_step)

            reconnects = control.reconnects

            def abort(current: list[str] = current, reconnects: int = reconnects) -> str | None:
                dead = watch.dead_among(current)
                if dead:
                    return f"device {dead[0]} died"
                if control.reconnects != reconnects:  # frames in flight were lost with it
                    return "the broker connection was lost"
                if due:  # planning may take a while: never on paho's network thread
                    consider_rebalance(due.pop())
                return "migrating to a faster plan" if migrate else None

            restore = None
            if first_step > 0:
                restore = {
                    s: replicas.compose(first_step, st.start, st.end, job, s)
                    for s, st in enumerate(plan.stages)
                }
            try:
                last = run_on_agents(
                    spec,
                    plan,
                    control,
                    job=job,
                    on_step=stepped,
                    timeout_s=timeout_s,
                    first_step=first_step,
                    replicate_every=replicate_every,
                    restore=restore,
                    abort=abort,
                )
                attempt_end(job, first_step)
                break
            except JobAborted:
                attempt_end(job, first_step)  # a device died, or a migration: see below
            except JobFailed:
                attempt_end(job, first_step)
                # A stage failing because its neighbour died: wait for the death to show.
                deadline = time.monotonic() + heartbeat_timeout_s + 0.5

                def explained(current: list[str] = current, reconnects: int = reconnects) -> bool:
                    return bool(watch.dead_among(current)) or control.reconnects != reconnects

                while not explained() and time.monotonic() < deadline:
                    time.sleep(0.05)
                if not explained():
                    raise
            watch.settle()
            dead = watch.dead_among(current)
            done = max(losses, default=-1) + 1
            first_step = replicas.newest_complete(done, hold=True)
            rolled_back += done - first_step
            for step in [s for s in losses if s >= first_step]:
                del losses[step]
            alive = [d for d in devices if d not in watch.dead]
            if not dead and control.reconnects != reconnects:  # the broker went away
                event("broker-lost", rollback_to=first_step, redo_steps=done - first_step)
                pending.update(t=time.time(), kind="broker")
                migrate.clear()
                back = time.monotonic()
                if not control.wait_ready(60):
                    raise JobFailed("the broker did not come back within 60 s")
                # Commands to an agent still backing off would be lost: wait for each.
                silent = watch.wait_heard(alive, back, RECONNECT_GRACE_S)
                if silent:
                    log.warning("devices %s not heard since the broker came back", silent)
                # The cancel sent when the attempt stopped may have reached the broker before
                # an agent had subscribed again, and then it is lost: the agent keeps the
                # stale stage and refuses the next attempt as busy. A device heard now has
                # resubscribed (it does so first on reconnecting), so say it again.
                cancel = CancelJob(job=job, reason="the broker restarted").model_dump_json()
                for device in current:
                    with contextlib.suppress(ConnectionError):
                        control.publish(device_cmd(device), cancel, 1)
                continue
            if not dead and migrate:  # no failure: a rebalance
                plan = migrate["plan"]
                pending.update(t=migrate["at"], kind="migration")
                event(
                    "migration",
                    rollback_to=first_step,
                    redo_steps=done - first_step,
                    before_sps=migrate["before_sps"],
                    compute_s=migrate["compute_s"],
                    plan=plan.to_json(),
                )
                migrate.clear()
                continue
            migrate.clear()
            detected = min(watch.dead[d][0] for d in dead)
            for d in dead:
                event("failure", device=d, detected_at=watch.dead[d][0], why=watch.dead[d][1])
            if not alive:
                raise JobFailed("every device of the job died")
            plan = replan(alive)
            pending["t"] = detected
            event(
                "recovery",
                rollback_to=first_step,
                redo_steps=done - first_step,
                survivors=alive,
                plan=plan.to_json(),
            )
        else:
            raise JobFailed(f"gave up after {max_recoveries} recoveries")
    result = JobResult(
        last.job,
        plan,
        spec,
        [losses[s] for s in sorted(losses)],
        reports,
        time.perf_counter() - started,
        last.weights,
    )
    return ResilientResult(result, events, recovery_s, rolled_back, len(losses))
