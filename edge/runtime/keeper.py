"""The stages one device keeps: those it runs, the one it holds, its neighbour's replica.

:class:`StageKeeper` is the agent's (:mod:`edge.agent`) keeper of stages. It owns:

- **the stages this device runs**: one job's, two at most (a job whose labels stay home
  gives each holder stage 0 and the last, [Note: labels stay home] in
  :mod:`edge.runtime.stage`: the tail's assignment joins stage 0's instead of
  replacing it); built on an assignment (only their units, in a process group when
  the assignment has one), each run in its own job thread on ``start``
  (a device waits on itself otherwise: the tail's forward needs the helpers', which
  need stage 0's), cancelled together (a cancelled stage ends without ``failed``),
  and let go when their job thread ends. One job at a time: another job's assignment
  while busy is answered ``failed`` (``busy with job ...``); a newer assignment retires
  a cancelled or same-job stage first;
- **restore** ([Note: the step of a state] in :mod:`edge.runtime.checkpoint`): an
  assignment with ``restore`` waits, at most ``recv_timeout_s``, for the state retained
  on ``job_restore(job, stage)`` and loads it before ``ready``; none in time, or one that
  does not fit, fails the assignment; a cancel meanwhile ends the wait
  (:class:`AssignmentCancelled`, not a failure);
- **replicas**: with ``replicate_every`` its stage publishes its state on
  ``job_replica`` (QoS 1, never link-shaped), and it watches its predecessor's (stage
  0: the last stage's) and keeps the newest in memory and in
  ``data_dir/<job>/replica-of-stage<N>.safetensors``: FTPipeHD's neighbour replica;
- **hold and hand-over** ([Note: a group member dies] in
  :mod:`coordinator.engine.handover`): a stage cancelled with ``hold`` is kept (one
  at most), answered ``held`` with the newest step it finished, and a later
  ``handover`` publishes the state of the step it names on the stage's replica topic.

It reads no commands: the agent's worker thread calls it, one command at a time (paho's
network thread only notes a cancel as it arrives, for a restore that waits), and it
speaks through the callbacks it is given: events, re-announcing the device, and waking
the worker to keep a replica that arrived on the network thread.

Tested in tests/e2e/test_agent.py (a busy agent refuses another job),
tests/e2e/test_agent_replicas.py (replicas kept, a stage restored) and
tests/e2e/test_group_faults.py (hold and hand-over).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from edge.files import write_atomic
from edge.logs import bind
from edge.models.local_data import LocalData
from edge.models.user_code import ZOO_ONLY, CodeAllowance
from edge.runtime.checkpoint import ReplicaKeeper
from edge.runtime.stage import Replicator, StageDevice, StageRuntime
from edge.server.groups import join_group, leave_group
from edge.transport.base import Transport
from edge.transport.mqtt import MqttTransport
from edge.wire.messages import (
    CancelJob,
    HandOver,
    StageAssignment,
    StageDone,
    StageFailed,
    StageHeld,
    StageReady,
    StepReport,
)
from edge.wire.topics import job_replica, job_restore, job_weights

__all__ = ["AssignmentCancelled", "Event", "StageKeeper", "StageSettings"]

log = logging.getLogger("edgetrain.agent")  # the daemon's records, whichever part writes them

Event = StageReady | StepReport | StageDone | StageFailed | StageHeld
"""What a stage here reports on its job's ``events`` topic."""


@dataclass(frozen=True, kw_only=True)
class StageSettings(StageDevice):
    """What every stage this device builds is built with: the device it runs on (an
    agent's allows zoo code only unless told otherwise), and the settings of keeping it."""

    device_id: str
    allow_code: CodeAllowance = ZOO_ONLY
    local_data: LocalData = field(default_factory=LocalData)
    data_dir: Path
    """Where finished stages' weights and neighbour replicas are written."""
    slowdown: float = 1.0
    """The compute throttle stages start at (a ``throttle`` command changes it)."""
    store_hosts: tuple[str, ...] = ()
    """Where a server-tier stage may find its rendezvous store, beside loopback and the
    broker's host."""


class AssignmentCancelled(RuntimeError):
    """The job was cancelled before its stage could start: not a failure."""


class StageKeeper:
    """The stages of one device (see the module docstring)."""

    def __init__(
        self,
        transport: MqttTransport,
        settings: StageSettings,
        *,
        report: Callable[[Event], None],
        announce: Callable[[], None],
        wake: Callable[[], None],
    ) -> None:
        """``report`` publishes an event, ``announce`` re-announces the device (its status
        names its stage), ``wake`` has the worker call :meth:`keep_replicas` soon."""
        self.transport = transport
        self.settings = settings
        self.slowdown = settings.slowdown
        """The compute throttle of every stage here, now."""
        self.store_hosts = (transport.host, *settings.store_hosts)
        """Where a server-tier stage may find its rendezvous store, beside loopback."""
        self._report = report
        self._announce = announce
        self._wake = wake
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
        self.step: int | None = None
        """The newest step a stage here reported (the heartbeat's), ``None`` without one."""
        self._incoming: dict[tuple[str, int], bytes] = {}  # neighbour replicas not yet kept
        self._incoming_lock = threading.Lock()
        self._watching: str | None = None  # the neighbour replica topic subscribed to
        self.replicas = ReplicaKeeper(settings.data_dir)
        self.bad_replicas = 0

    @property
    def first(self) -> StageRuntime | None:
        """The first stage this device runs (its status and heartbeat name it), if any."""
        runtimes = list(self._runtimes)  # a copy: job threads let stages go meanwhile
        return runtimes[0] if runtimes else None

    # -- cancelling ------------------------------------------------------------------

    def note_cancelled(self, job: str) -> None:
        """Remember that ``job`` was cancelled (on paho's thread, as the command arrives:
        a worker waiting on a restore sees it at once)."""
        self._cancelled[job] = None
        while len(self._cancelled) > 64:
            del self._cancelled[next(iter(self._cancelled))]

    def was_cancelled(self, job: str) -> bool:
        """Whether ``job`` was cancelled lately."""
        return job in self._cancelled

    def cancel(self, cmd: CancelJob) -> None:
        """Stop the stages of ``cmd.job`` if this device runs them (keeping them with
        ``hold``)."""
        rt = self.first
        if rt is None or rt.a.job != cmd.job:
            return
        log.info("cancelling: %s", cmd.reason, extra={"job": cmd.job})
        for rt in list(self._runtimes):
            rt.cancel(hold=cmd.hold)
            thread = self._threads.get(rt.a.stage)
            if cmd.hold and (thread is None or not thread.is_alive()):
                self._hold(rt)  # it never started: nothing else will say it

    def throttle(self, factor: float) -> None:
        """Run every stage here, and every later one, ``factor`` times slower than the
        device computes by itself: its own throttle (``--slowdown``, an emulated
        device's speed) times ``factor``, so that a slow fault on an emulated Pi slows
        the Pi, not a full-speed core."""
        slowdown = self.settings.slowdown * factor
        log.info("compute now %.2fx slower (was %.2fx)", slowdown, self.slowdown)
        self.slowdown = slowdown
        for rt in list(self._runtimes):
            rt.slowdown = slowdown

    def cancel_all(self) -> None:
        """Cancel every stage here (the daemon stops)."""
        for rt in list(self._runtimes):
            rt.cancel()

    def join(self, timeout: float) -> None:
        """Wait for the job threads, ``timeout`` each."""
        for thread in list(self._threads.values()):
            thread.join(timeout=timeout)

    # -- events ----------------------------------------------------------------------

    def _event(self, event: Event) -> None:
        if isinstance(event, StepReport):
            self.step = event.step
        self._report(event)

    def _failed(self, a: StageAssignment, error: str) -> None:
        """Report that stage ``a`` failed, with ``error`` (one line)."""
        self._event(
            StageFailed(
                job=a.job,
                stage=a.stage,
                member=a.member,
                device=self.settings.device_id,
                error=error,
            )
        )

    # -- assignment ------------------------------------------------------------------

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

    def assign(self, a: StageAssignment) -> None:
        """Build ``a``'s stage (restored, when it says so), keep it and report ``ready``."""
        runtimes = list(self._runtimes)
        if runtimes and all(rt.a.stage in self._finished for rt in runtimes):
            # Their last steps ran and ``done`` may be out already: the next job can come
            # before the job threads have let the stages go. A bounded wait, not a refusal.
            for rt in runtimes:
                thread = self._threads.get(rt.a.stage)
                if thread is not None:
                    thread.join(timeout=10.0)
        joins = self._joins(a)
        busy = self.first
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
                on=self.settings,
                report=self._event,
                slowdown=self.slowdown,
                replicate=replicate,
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
                device=self.settings.device_id,
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
            self.step = None
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
                    raise AssignmentCancelled(
                        f"job {a.job} was cancelled while its state was awaited"
                    )
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
                device=self.settings.device_id,
                finished=rt.finished,
            )
        )
        bind(log, job=a.job, stage=a.stage).info(
            "holding the state (finished step %d)", rt.finished
        )

    def hand_over(self, cmd: HandOver) -> None:
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
            self._wake()

        self.transport.subscribe(topic, arrived)
        self._watching = topic

    def _unwatch_neighbour(self) -> None:
        if self._watching is not None:
            self.transport.unsubscribe(self._watching)
            self._watching = None

    def keep_replicas(self) -> None:
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

    # -- running ---------------------------------------------------------------------

    def start(self, job: str) -> None:
        """Start each of ``job``'s stages here in its own job thread (once)."""
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
                path = self.settings.data_dir / a.job / f"stage{a.stage}.safetensors"
                write_atomic(path, weights)
                if a.member == 0:  # a group's members hold the same weights: one copy goes
                    self.transport.publish(job_weights(a.job, a.stage), weights, 1)
                self._event(
                    StageDone(
                        job=a.job,
                        stage=a.stage,
                        member=a.member,
                        device=self.settings.device_id,
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
