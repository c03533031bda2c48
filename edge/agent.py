"""The agent daemon: one per device, it connects, registers, and runs stages it is given.

Lifecycle:

1. Connect to the broker with a last-will that marks the device ``offline``
   (retained), then publish the device's profile and ``online`` (both
   retained, the profile first), and again after every reconnect (noticed at the next heartbeat),
   so a coordinator that starts later, or a broker that restarted, still
   learns about the device. The profile lists the datasets the device holds
   (``local_data``), by size and shape only ([Note: local data] in
   :mod:`edge.models.local_data`).
2. Publish a heartbeat every ``heartbeat_s``.
3. Obey commands on the device's ``cmd`` topic: ``assign`` builds the stage (only
   its units) and attaches it to the transport, then reports ``ready``; ``start``
   runs it in a thread, reporting every step on the job's ``events`` topic and, at
   the end, the stage's weights (safetensors) and ``done``; ``cancel`` stops it
   (with ``hold``, the agent keeps the stopped stage, answers ``held`` with the
   newest step it finished, and publishes the state of the step a later
   ``handover`` names on the stage's replica topic: [Note: a group member dies] in
   :mod:`coordinator.engine.handover`). A command that cannot be parsed is logged
   and counted, never fatal; an assignment refused so (options that are not what
   the model takes: [Note: options are data] in :mod:`edge.models.options`) is
   answered with ``failed`` and the reason when its job and stage can be read, as
   is one whose dataset would need more memory than the device has free
   (:func:`edge.runtime.data.check_data_fits`, before any weight is built). One
   job at a time: an assignment for another job while busy is answered with
   ``failed`` (reason ``busy``). An assignment naming a user
   model or dataset (``package.module:function``) outside ``allow_code`` is
   answered with ``failed`` before anything is imported ([Note: user code on
   devices] in :mod:`edge.models.user_code`).
   ``time-units`` times a model's units in a training step here, under the device's
   own limits, and answers on its ``units`` topic (the planner's per-device unit
   seconds: :mod:`coordinator.engine.unit_profiles`); never while a stage is held.
   One exception to one stage at a time: a job whose labels stay home gives each
   holder two stages, 0 and the last ([Note: labels stay home] in
   :mod:`edge.runtime.stage`). The second assignment of that job (``labels_local``,
   the last stage) joins the first instead of replacing it; each runs in its own
   thread (a device waits on itself otherwise: the tail's forward needs the
   helpers', which need stage 0's), both start on ``start`` and ``cancel`` stops both.
4. SIGTERM (or :meth:`Agent.stop`) cancels the running stage, publishes
   ``offline`` and disconnects.

Fault tolerance ([Note: the step of a state] in :mod:`edge.runtime.checkpoint`):
an assignment with ``restore`` waits (on the worker, at most ``recv_timeout_s``)
for the state retained on ``job_restore(job, stage)`` and loads it before
``ready``; none in time, or one that does not fit, is a ``failed``. With
``replicate_every`` the stage publishes its state on ``job_replica`` (QoS 1,
never link-shaped), and the agent keeps its predecessor's newest (stage 0: the
last stage's) in memory and in ``data_dir/<job>/replica-of-stage<N>.safetensors``:
FTPipeHD's neighbour replica. A cancelled stage ends without ``failed``; a new
assignment retires a cancelled or same-job stage first.

Commands arrive on paho's network thread and are handed to a worker thread,
which builds stages (building waits for subscriptions, which needs the
network thread free).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from edge.errors import UserError
from edge.files import write_atomic
from edge.logs import bind
from edge.models.local_data import LocalData, announce
from edge.models.user_code import ZOO_ONLY, CodeAllowance
from edge.models.zoo import get_model
from edge.problem import DeviceSpec
from edge.profiling.device import cgroup_limits
from edge.profiling.fixed_costs import (
    cpu_quota_of,
    measure_transport_byte_s,
    time_publish,
    with_publish_cost,
    with_transport_byte_cost,
)
from edge.runtime.checkpoint import ReplicaKeeper
from edge.runtime.stage import Replicator, StageRuntime
from edge.runtime.unit_times import UnitTime, cpu_seconds_clock, measure_unit_times
from edge.server.groups import join_group, leave_group
from edge.transport.base import Transport
from edge.transport.credentials import device_client_id
from edge.transport.mqtt import MqttTransport
from edge.transport.settings import MqttSettings, parse_broker_url
from edge.wire.messages import (
    CancelJob,
    DeviceStatus,
    HandOver,
    Heartbeat,
    MessageError,
    StageAssignment,
    StageDone,
    StageFailed,
    StageHeld,
    StageReady,
    StartJob,
    StepReport,
    Throttle,
    TimeUnits,
    UnitTimes,
    UnitTiming,
    parse_command,
    refused_assignment,
)
from edge.wire.topics import (
    device_cmd,
    device_heartbeat,
    device_probe,
    device_profile,
    device_status,
    device_units,
    job_events,
    job_replica,
    job_restore,
    job_weights,
)

__all__ = ["Agent"]

log = logging.getLogger("edgetrain.agent")

_KEEP = "keep-replicas"  # work item: store the neighbour replicas that arrived


@dataclass(frozen=True)
class _Refused:
    """Work item: an assignment that could not be used, to be answered ``failed``."""

    job: str
    stage: int
    member: int
    reason: str


_Work = (
    StageAssignment | StartJob | CancelJob | HandOver | Throttle | TimeUnits | _Refused | str | None
)


class _Cancelled(RuntimeError):
    """The job was cancelled before its stage could start: not a failure."""


class Agent:
    """One device's daemon (see the module docstring)."""

    def __init__(
        self,
        settings: MqttSettings,
        device_id: str,
        profile: Callable[[], DeviceSpec],
        *,
        data_dir: Path,
        heartbeat_s: float = 1.0,
        version: str = "",
        slowdown: float = 1.0,
        torch_device: str = "cpu",
        allow_code: CodeAllowance = ZOO_ONLY,
        store_hosts: Sequence[str] = (),
        local_data: LocalData | None = None,
    ) -> None:
        self.device_id = device_id
        self.local_data = local_data or LocalData()
        """The datasets this device holds, by name ([Note: local data])."""
        self.allow_code = allow_code
        """The user code its assignments may name ([Note: user code on devices])."""
        self.torch_device = torch_device
        self.slowdown = slowdown
        self.data_dir = data_dir
        self.heartbeat_s = heartbeat_s
        self.version = version
        self._profile_fn = profile
        self._profile: DeviceSpec | None = None
        self._publish_timed = False
        self._stop = threading.Event()
        self._commands: queue.Queue[_Work] = queue.Queue()
        self._cancelled: dict[str, None] = {}  # jobs cancelled lately, newest last
        self._runtimes: list[StageRuntime] = []
        """The stages of one job this device runs, in the order assigned (two at most: the
        ends of a U-shaped job)."""
        self._threads: dict[int, threading.Thread] = {}
        """Each started stage's job thread, by stage."""
        self._stages_lock = threading.Lock()  # the worker and the job threads let stages go
        self._finished: set[int] = set()
        """The stages whose steps all ran, while their job thread reports and lets them go."""
        self._held: StageRuntime | None = None
        """A stage stopped with ``hold``, kept for its hand-over (one at most)."""
        self._step: int | None = None
        self.bad_commands = 0
        self._incoming: dict[tuple[str, int], bytes] = {}  # neighbour replicas not yet kept
        self._incoming_lock = threading.Lock()
        self._watching: str | None = None  # the neighbour replica topic subscribed to
        self.replicas = ReplicaKeeper(data_dir)
        self.store_hosts = (parse_broker_url(settings.url)[1], *store_hosts)
        """Where a server-tier stage may find its rendezvous store, beside loopback."""
        self.bad_replicas = 0
        self.transport = MqttTransport(
            settings.model_copy(
                update={"client_id": settings.client_id or device_client_id(device_id)}
            )
        )
        offline = DeviceStatus(device=device_id, state="offline", version=version)
        self.transport.will_set(device_status(device_id), offline.model_dump_json(), 1, True)

    # -- connection ------------------------------------------------------------------

    @property
    def _runtime(self) -> StageRuntime | None:
        """The first stage this device runs (its status and heartbeat name it), if any."""
        runtimes = list(self._runtimes)  # a copy: job threads let stages go meanwhile
        return runtimes[0] if runtimes else None

    def _status(self, state: Literal["online", "offline", "busy"]) -> DeviceStatus:
        rt = self._runtime
        return DeviceStatus(
            device=self.device_id,
            state=state,
            version=self.version,
            job=rt.a.job if rt else None,
            stage=rt.a.stage if rt else None,
        )

    def _announce(self) -> None:
        """On every (re)connect: profile, then status, both retained. The first time, it
        first times a few small QoS 1 publishes on its probe topic (part of the fixed cost
        of every frame and report), then the CPU each byte of a tensor costs through this
        connection (:mod:`edge.profiling.fixed_costs`)."""
        state: Literal["online", "busy"] = "busy" if self._runtime is not None else "online"
        if not self._publish_timed and self._profile is not None:
            self._publish_timed = True
            # On the probe topic: a heartbeat before the profile would be a sign of life
            # of a device nobody can plan on yet.
            beat = Heartbeat(device=self.device_id).model_dump_json()
            seconds = time_publish(
                lambda: self.transport.publish(device_probe(self.device_id), beat, 1)
            )
            self._profile = with_publish_cost(self._profile, seconds)
            self._time_transport_bytes()
        # The profile first: a coordinator that hears ``online`` can plan on the device.
        if self._profile is not None:
            self.transport.publish(
                device_profile(self.device_id), self._profile.model_dump_json(), 1, True
            )
        self.transport.publish(
            device_status(self.device_id), self._status(state).model_dump_json(), 1, True
        )

    def _time_transport_bytes(self) -> None:
        """Replace the profile's per-byte cost by one measured through this connection,
        the broker and back (:func:`~edge.profiling.fixed_costs.measure_transport_byte_s`),
        over the share of a core it runs with: the one its profile announces a quota will
        hold it to (``details["cpu_quota"]``, a testbed's: [Note: the transport probe's
        share of a core]), else its cgroup's quota, else a whole core. Runs before the
        worker starts, never on the network thread, whose deliveries it waits for. A
        failure keeps the profile's."""
        assert self._profile is not None
        share = cpu_quota_of(self._profile) or cgroup_limits().cpu_quota_cores or 1.0
        try:
            byte_s = measure_transport_byte_s(
                self.transport, device_probe(self.device_id), cpu_share=min(1.0, share)
            )
        except (UserError, ConnectionError) as exc:
            log.warning("kept the probe's per-byte cost: %s", exc)
            return
        self._profile = with_transport_byte_cost(self._profile, byte_s)
        log.info(
            "transport: %.1f ms per MiB of tensors at %.3f of a core",
            byte_s * (1 << 20) * 1e3,
            min(1.0, share),
        )

    def _connect(self) -> bool:
        """Connect, retrying with backoff until connected or stopped."""
        delay = 0.5
        while not self._stop.is_set():
            try:
                self.transport.connect(timeout=10.0)
                return True
            except UserError as exc:
                log.warning("cannot reach the broker yet: %s; retrying in %.1f s", exc, delay)
                self._stop.wait(delay)
                delay = min(delay * 2, 30.0)
        return False

    # -- lifecycle -------------------------------------------------------------------

    def run(self) -> int:
        """Serve until :meth:`stop`; returns the process exit status."""
        self._profile = announce(self._profile_fn(), self.local_data)
        for name, held in self.local_data.items():
            log.info(
                "holds local dataset %s: %d samples of shape %s (%s)",
                name,
                held.info.samples,
                list(held.info.input_shape),
                held.info.kind,
            )
        if not self._connect():
            return 0
        self.transport.subscribe(device_cmd(self.device_id), self._on_command)
        self._announce()
        log.info("agent online on %s; it runs %s", self.transport.url, self.allow_code.describe())
        if self.transport.link is not None:
            log.info("emulating a link of %s for stage frames", self.transport.link.describe())
        worker = threading.Thread(target=self._work, name="agent-worker", daemon=True)
        worker.start()
        announced = self.transport.reconnects
        while not self._stop.wait(self.heartbeat_s):
            if self.transport.reconnects != announced and self.transport.connected:
                # A broker that restarted lost our retained status and profile.
                announced = self.transport.reconnects
                with contextlib.suppress(ConnectionError):
                    self._announce()
            rt = self._runtime
            beat = Heartbeat(
                device=self.device_id,
                job=rt.a.job if rt else None,
                stage=rt.a.stage if rt else None,
                step=self._step,
            )
            # While the broker is away publishing fails; paho reconnects, _announce runs again.
            with contextlib.suppress(ConnectionError):
                self.transport.publish(device_heartbeat(self.device_id), beat.model_dump_json(), 0)
        self._shutdown(worker)
        return 0

    def stop(self) -> None:
        self._stop.set()

    def _shutdown(self, worker: threading.Thread) -> None:
        for rt in list(self._runtimes):
            rt.cancel()
        self._commands.put(None)
        worker.join(timeout=5)
        for thread in list(self._threads.values()):
            thread.join(timeout=5)
        with contextlib.suppress(ConnectionError):
            offline = self._status("offline").model_dump_json()
            self.transport.publish(device_status(self.device_id), offline, 1, True)
        self.transport.close()
        log.info("agent stopped")

    # -- commands --------------------------------------------------------------------

    def _on_command(self, _topic: str, payload: bytes) -> None:
        try:
            cmd = parse_command(payload)
        except MessageError as exc:
            self.bad_commands += 1
            log.warning("ignored a command: %s", exc)
            place = refused_assignment(payload)
            if place is not None:  # answered by the worker: no publishing in a callback
                self._commands.put(_Refused(*place, reason=str(exc)))
            return
        if isinstance(cmd, CancelJob):  # seen at once, also by a worker waiting on a restore
            self._cancelled[cmd.job] = None
            while len(self._cancelled) > 64:
                del self._cancelled[next(iter(self._cancelled))]
        self._commands.put(cmd)

    def _work(self) -> None:
        while True:
            cmd = self._commands.get()
            if cmd is None:
                return
            try:
                if cmd == _KEEP:
                    self._keep_replicas()
                elif isinstance(cmd, _Refused):
                    raise UserError(cmd.reason)
                elif isinstance(cmd, StageAssignment) and cmd.job in self._cancelled:
                    log.info("skipped an assignment of a cancelled job", extra={"job": cmd.job})
                elif isinstance(cmd, StageAssignment):
                    self._assign(cmd)
                elif isinstance(cmd, StartJob):
                    self._start(cmd.job)
                elif isinstance(cmd, Throttle):
                    log.info("compute now %.2fx slower (was %.2fx)", cmd.slowdown, self.slowdown)
                    self.slowdown = cmd.slowdown
                    for rt in list(self._runtimes):
                        rt.slowdown = cmd.slowdown
                elif isinstance(cmd, HandOver):
                    self._hand_over(cmd)
                elif isinstance(cmd, TimeUnits):
                    self._time_units(cmd)
                elif (
                    isinstance(cmd, CancelJob) and self._runtime and self._runtime.a.job == cmd.job
                ):
                    log.info("cancelling: %s", cmd.reason, extra={"job": cmd.job})
                    for rt in list(self._runtimes):
                        rt.cancel(hold=cmd.hold)
                        thread = self._threads.get(rt.a.stage)
                        if cmd.hold and (thread is None or not thread.is_alive()):
                            self._hold(rt)  # it never started: nothing else will say it
            except _Cancelled as exc:
                log.info("%s", exc, extra={"job": getattr(cmd, "job", None)})
            except Exception as exc:  # a command must never kill the daemon
                if isinstance(exc, UserError):  # bad input, e.g. code not allowed: no traceback
                    log.warning("command %s failed: %s", type(cmd).__name__, exc)
                else:
                    log.exception("command %s failed", type(cmd).__name__)
                if isinstance(cmd, str):
                    continue
                job = getattr(cmd, "job", "unknown")
                stage = getattr(cmd, "stage", 0)
                self._event(
                    StageFailed(
                        job=job,
                        stage=stage,
                        member=getattr(cmd, "member", 0),
                        device=self.device_id,
                        error=f"{type(exc).__name__}: {exc}",
                    )
                )

    def _time_units(self, cmd: TimeUnits) -> None:
        """Answer ``cmd`` on this device's ``units`` topic: its model's units timed here, on
        the worker (a job's assignment waits behind it), at the device's throttle (each
        time times ``slowdown``: the throttle sleeps that much longer than it computes);
        or, with no times, why not: a stage is held, the model is not allowed or cannot
        be built, the timing failed."""
        started = time.perf_counter()
        full: list[UnitTiming] = []
        small: list[UnitTiming] | None = None
        error = None
        if self._runtimes:
            error = f"busy with job {self._runtimes[0].a.job}"
        else:
            try:
                spec = get_model(cmd.model, allow_code=self.allow_code, **cmd.model_options)
                timed = functools.partial(
                    measure_unit_times,
                    microbatches=cmd.microbatches,
                    steps=cmd.steps,
                    warmup=cmd.warmup,
                    optimizer=cmd.optimizer,
                    timed_microbatches=cmd.timed_microbatches,
                    budget_s=cmd.budget_s,
                    cpu_clock=cpu_seconds_clock(),  # [Note: a stall lands on one unit]
                )
                full = self._timings(timed(spec, cmd.batch_size))
                if cmd.small_batch_size is not None:
                    small = self._timings(timed(spec, cmd.small_batch_size))
            except Exception as exc:  # any failure is the answer, never the daemon's end
                error = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
                full, small = [], None
        answer = UnitTimes(
            request=cmd.request, device=self.device_id, full=full, small=small, error=error
        )
        if error is None:
            log.info(
                "timed the units of %s at batch %d in %.1f s",
                cmd.model,
                cmd.batch_size,
                time.perf_counter() - started,
            )
        else:
            log.warning("could not time the units of %s: %s", cmd.model, error)
        with contextlib.suppress(ConnectionError):
            self.transport.publish(device_units(self.device_id), answer.model_dump_json(), 1)

    def _timings(self, times: Sequence[UnitTime]) -> list[UnitTiming]:
        """``times`` on the wire, at this device's throttle."""
        k = self.slowdown
        return [UnitTiming(name=t.name, fwd_s=t.fwd_s * k, bwd_s=t.bwd_s * k) for t in times]

    def _event(self, event: StageReady | StepReport | StageDone | StageFailed | StageHeld) -> None:
        if isinstance(event, StepReport):
            self._step = event.step
            bind(log, job=event.job, stage=event.stage, step=event.step).info(
                "step done in %.3f s (compute %.3f, wait %.3f)",
                event.step_s,
                event.compute_s,
                event.wait_s,
            )
        try:
            self.transport.publish(
                job_events(event.job, self.device_id), event.model_dump_json(), 1
            )
        except ConnectionError as exc:
            log.warning("could not report %s: %s", event.type, exc, extra={"job": event.job})

    def _failed(self, a: StageAssignment, error: str) -> None:
        """Report that stage ``a`` failed, with ``error`` (one line)."""
        self._event(
            StageFailed(
                job=a.job, stage=a.stage, member=a.member, device=self.device_id, error=error
            )
        )

    def _joins(self, a: StageAssignment) -> bool:
        """Whether ``a`` is the tail of the U-shaped job whose stage 0 this device holds,
        built and not started: it runs beside it ([Note: labels stay home])."""
        runtimes = self._runtimes
        if len(runtimes) != 1 or not (a.labels_local and a.is_last and a.num_stages > 1):
            return False
        first = runtimes[0]
        return (
            first.a.job == a.job
            and first.a.stage == 0
            and first.a.member == a.member
            and not first.cancelled
            and 0 not in self._threads
        )

    def _assign(self, a: StageAssignment) -> None:
        runtimes = list(self._runtimes)
        if runtimes and all(rt.a.stage in self._finished for rt in runtimes):
            # Their last steps ran and ``done`` may be out already: the next job can come
            # before the job threads have let the stages go. A bounded wait, not a refusal.
            for rt in runtimes:
                thread = self._threads.get(rt.a.stage)
                if thread is not None:
                    thread.join(timeout=10.0)
        joins = self._joins(a)
        busy = self._runtime
        if busy is not None and not joins and (busy.cancelled or busy.a.job == a.job):
            self._retire(busy)  # a cancelled attempt, or a re-plan of this job
            busy = None
        if busy is not None and not joins:
            self._failed(a, f"busy with job {busy.a.job}")
            return
        self._held = None  # a hand-over not asked for by now never will be
        bind(log, job=a.job, stage=a.stage).info(
            "assigned units [%d, %d) of %s", a.start, a.end, a.model
        )
        self.replicas.forget_other_jobs(a.job)
        replicate = self._replicator(a) if a.replicate_every else None
        transport: Transport = self.transport
        if a.dist is not None:  # blocks until every rank of the group has joined
            transport = join_group(a, self.transport, self.store_hosts)
        try:
            rt = StageRuntime(
                a,
                transport,
                device=self.device_id,
                report=self._event,
                slowdown=self.slowdown,
                replicate=replicate,
                torch_device=self.torch_device,
                allow_code=self.allow_code,
                local=self.local_data,
            )
        except BaseException:
            if a.dist is not None:
                leave_group()
            raise
        try:
            if a.restore:
                self._restore(rt)
            if not joins:
                self._watch_neighbour(a)
        except BaseException:
            transport.detach(a.job, a.stage, a.member)
            if a.dist is not None:
                leave_group()
            raise
        self._runtimes.append(rt)
        self._announce()
        self._event(
            StageReady(
                job=a.job,
                stage=a.stage,
                member=a.member,
                device=self.device_id,
                parameters=rt.parameters,
            )
        )

    def _retire(self, busy: StageRuntime) -> None:
        """Stop ``busy``'s job's stages here (if they run, wait a bounded time for them)
        and forget them."""
        for rt in [r for r in self._runtimes if r.a.job == busy.a.job] or [busy]:
            rt.cancel()
            thread = self._threads.get(rt.a.stage)
            if thread is not None:  # at most one step's work left
                thread.join(timeout=10.0)
            rt.transport.detach(rt.a.job, rt.a.stage, rt.a.member)
            if rt.a.dist is not None:
                leave_group()
            self._forget(rt)

    def _forget(self, rt: StageRuntime) -> None:
        """Let ``rt`` go (if it is still one of this device's stages)."""
        with self._stages_lock:
            if rt not in self._runtimes:
                return
            self._runtimes.remove(rt)
            self._threads.pop(rt.a.stage, None)
            self._finished.discard(rt.a.stage)
            last = not self._runtimes
        if last:
            self._step = None
            self._unwatch_neighbour()

    def _restore(self, rt: StageRuntime) -> None:
        """Wait (on this worker thread) for the retained state of ``rt``'s stage; load it.

        Raises :class:`TimeoutError` if none arrives within ``recv_timeout_s`` and
        :class:`ValueError` for one that does not fit; either way the stage fails.
        """
        a = rt.a
        topic = job_restore(a.job, a.stage)
        got: queue.Queue[bytes] = queue.Queue()
        self.transport.subscribe(topic, lambda _t, payload: got.put(payload))
        deadline, blob = time.monotonic() + a.recv_timeout_s, b""
        try:
            while not blob:  # an empty payload clears a retained message: not a state
                if a.job in self._cancelled:  # the coordinator gave this attempt up
                    raise _Cancelled(f"job {a.job} was cancelled while its state was awaited")
                try:
                    blob = got.get(timeout=min(0.05, max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    if time.monotonic() >= deadline:
                        why = f"no state on {topic} within {a.recv_timeout_s:g} s"
                        raise TimeoutError(f"restore: {why}") from None
            step = rt.restore(blob)
        finally:
            self.transport.unsubscribe(topic)
        bind(log, job=a.job, stage=a.stage, step=step).info(
            "restored units [%d, %d) for step %d (%d bytes)", a.start, a.end, step, len(blob)
        )

    def _replicator(self, a: StageAssignment) -> Replicator:
        topic = job_replica(a.job, a.stage)

        def replicate(step: int, state: bytes) -> None:
            bound = bind(log, job=a.job, stage=a.stage, step=step)
            try:  # on the job's thread; publishing only queues the message
                self.transport.publish(topic, state, 1)
                bound.info("replicated the state for step %d (%d bytes)", step, len(state))
            except (ConnectionError, ValueError) as exc:  # training goes on without it
                bound.warning("state for step %d not replicated: %s", step, exc)

        return replicate

    # -- hand-over ([Note: a group member dies]) -------------------------------------

    def _hold(self, rt: StageRuntime) -> None:
        """Keep the stopped ``rt`` and say which step it finished."""
        a = rt.a
        self._held = rt
        self._event(
            StageHeld(
                job=a.job,
                stage=a.stage,
                member=a.member,
                device=self.device_id,
                finished=rt.finished,
            )
        )
        bind(log, job=a.job, stage=a.stage).info(
            "holding the state (finished step %d)", rt.finished
        )

    def _hand_over(self, cmd: HandOver) -> None:
        """Publish the held stage's state for ``cmd.step`` on its replica topic."""
        rt, self._held = self._held, None
        if rt is None or rt.a.job != cmd.job:
            log.warning("hand-over for job %s, which is not held here", cmd.job)
            return
        a = rt.a
        try:
            state = rt.state_at(cmd.step)
        except ValueError as exc:
            self._failed(a, f"hand-over: {exc}")
            return
        self.transport.publish(job_replica(a.job, a.stage), state, 1)
        bind(log, job=a.job, stage=a.stage, step=cmd.step).info(
            "handed over the state for step %d (%d bytes)", cmd.step, len(state)
        )

    # -- neighbour replicas ----------------------------------------------------------

    def _watch_neighbour(self, a: StageAssignment) -> None:
        self._unwatch_neighbour()
        if not a.replicate_every or a.num_stages == 1:
            return
        job, prev = a.job, (a.stage - 1) % a.num_stages
        topic = job_replica(job, prev)

        def arrived(_topic: str, payload: bytes) -> None:
            # On paho's thread: only note it; the worker parses and writes it.
            with self._incoming_lock:
                self._incoming[(job, prev)] = payload  # only the newest waits
            self._commands.put(_KEEP)

        self.transport.subscribe(topic, arrived)
        self._watching = topic

    def _unwatch_neighbour(self) -> None:
        if self._watching is not None:
            self.transport.unsubscribe(self._watching)
            self._watching = None

    def _keep_replicas(self) -> None:
        """Check and keep the neighbour replicas that arrived, newest per (job, stage)."""
        with self._incoming_lock:
            incoming, self._incoming = self._incoming, {}
        for (job, stage), payload in incoming.items():
            try:
                st = self.replicas.keep(job, stage, payload)
            except ValueError as exc:
                self.bad_replicas += 1
                bind(log, job=job, stage=stage).warning("ignored a neighbour replica: %s", exc)
                continue
            if st is not None:
                bind(log, job=job, stage=stage, step=st.step).info(
                    "kept stage %d's state for step %d", stage, st.step
                )

    def _start(self, job: str) -> None:
        runtimes = [rt for rt in self._runtimes if rt.a.job == job]
        if not runtimes:
            log.warning("start for job %s, which is not assigned here", job, extra={"job": job})
            return
        for rt in runtimes:  # a U's holder hears start once per stage: each starts once
            if rt.a.stage not in self._threads:
                thread = threading.Thread(target=self._run_job, args=(rt,), daemon=True)
                self._threads[rt.a.stage] = thread
                thread.start()

    def _run_job(self, rt: StageRuntime) -> None:
        a = rt.a
        started = time.perf_counter()
        try:
            steps = rt.run()
            if not rt.cancelled:
                self._finished.add(a.stage)
                weights = rt.weights()
                write_atomic(self.data_dir / a.job / f"stage{a.stage}.safetensors", weights)
                if a.member == 0:  # a group's members hold the same weights: one copy goes
                    self.transport.publish(job_weights(a.job, a.stage), weights, 1)
                self._event(
                    StageDone(
                        job=a.job,
                        stage=a.stage,
                        member=a.member,
                        device=self.device_id,
                        steps=steps,
                        weights_sha256=hashlib.sha256(weights).hexdigest(),
                    )
                )
                bind(log, job=a.job, stage=a.stage).info(
                    "job done: %d steps in %.1f s", steps, time.perf_counter() - started
                )
        except Exception as exc:
            if rt.cancelled:  # the coordinator stopped it: nothing to report
                bind(log, job=a.job, stage=a.stage).info("stage cancelled (%s)", exc)
            else:
                bind(log, job=a.job, stage=a.stage).exception("stage failed")
                self._failed(a, f"{type(exc).__name__}: {exc}")
        finally:
            if a.dist is not None:
                leave_group()
            if rt.cancelled and rt.hold:
                self._hold(rt)
            self._forget(rt)  # unless replaced by a newer assignment meanwhile
            with contextlib.suppress(ConnectionError):
                self._announce()
