"""Runners: where a job's stages run, and how they are driven.

- :func:`run_inprocess`: every stage in a thread of this process over the
  in-process transport (tests, single-machine runs, the 1-device reference);
- :func:`run_on_agents`: every stage on an agent daemon, driven over MQTT by
  commands on the devices' ``cmd`` topics (:mod:`edge.agent` is the other side):
  assign every stage, wait until all are built and subscribed (``ready``), then
  ``start`` them all, so no frame is sent before its receiver listens.
  Stages on server-tier agents (``servers``, see :func:`server_tier`) also
  join one torch.distributed group, whose rendezvous store this process
  hosts, and frames between two of them travel over c10d
  (:mod:`edge.transport.dist`): a hybrid pipeline of edge devices and servers.

Both take a :class:`~coordinator.engine.spec.JobSpec` and a plan and return a
:class:`~coordinator.engine.monitor.JobResult`. A stage of the plan on a group of
devices runs one assignment per member ([Note: groups on the wire] in
:mod:`edge.wire.groups`), splitting microbatches by the ``shares`` given (equal
ones by default); the members must end with the same weights, and the result
has them once.

Tested in tests/unit/edge/runtime/test_reference_parity.py (:func:`run_inprocess`
against a plain PyTorch loop), tests/e2e/test_pipeline_parity.py (:func:`run_on_agents`
on real agents) and tests/e2e/test_hybrid.py (a server tier over c10d).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import safetensors.torch
import torch

from coordinator.engine.assignments import make_assignments
from coordinator.engine.handover import Handover
from coordinator.engine.monitor import JobAborted, JobFailed, JobMonitor, JobResult
from coordinator.engine.options import RunOptions
from coordinator.engine.spec import JobSpec, new_job_id
from coordinator.planner.score import Plan
from edge.models.local_data import LocalData
from edge.problem import DeviceSpec
from edge.runtime.stage import StageDevice, StageRuntime
from edge.transport.inprocess import InProcessTransport
from edge.transport.mqtt import MqttTransport
from edge.wire.messages import (
    CancelJob,
    DistGroup,
    MessageError,
    StageAssignment,
    StageDone,
    StageFailed,
    StageHeld,
    StartJob,
    StepReport,
    parse_event,
)
from edge.wire.topics import TOPIC_ROOT, device_cmd, job_events_all, job_restore, parse_events_topic

__all__ = ["Attempt", "run_inprocess", "run_on_agents", "server_tier"]

log = logging.getLogger(__name__)


def run_inprocess(
    spec: JobSpec,
    plan: Plan,
    *,
    job: str | None = None,
    on_step: Callable[[StepReport], None] | None = None,
    timeout_s: float = 3600.0,
    shares: Sequence[Sequence[float]] | None = None,
    local: Mapping[str, LocalData] | None = None,
    slowdowns: Mapping[str, float] | None = None,
) -> JobResult:
    """Run every stage of ``plan`` (every member of a group) in a thread of this process;
    on local data (``spec.data``), stage 0's devices read it from what ``local`` says
    each holds; ``slowdowns`` throttles devices (a device that much slower)."""
    job = job or new_job_id()
    assignments = make_assignments(job, spec, plan, shares=shares)
    sizes = [len(st.devices) for st in plan.stages]
    monitor = JobMonitor(job, len(plan.stages), on_step, group_sizes=sizes)
    transport = InProcessTransport()
    runtimes = []
    try:
        for a in assignments:
            device = plan.stages[a.stage].devices[a.member]
            on = StageDevice(device_id=device, local_data=(local or {}).get(device))
            slowdown = (slowdowns or {}).get(device, 1.0)
            runtimes.append(
                StageRuntime(a, transport, on=on, report=monitor.on_event, slowdown=slowdown)
            )
    except BaseException:
        transport.close()
        raise

    def work(rt: StageRuntime) -> None:
        try:
            rt.run()
        except Exception as exc:  # a stage's failure becomes the job's, with its reason
            monitor.on_event(
                StageFailed(
                    job=job,
                    stage=rt.a.stage,
                    member=rt.a.member,
                    device=rt.device,
                    error=f"{type(exc).__name__}: {exc}",
                )
            )
            for other in runtimes:
                other.cancel()
            return
        if not rt.cancelled:
            monitor.on_event(
                StageDone(
                    job=job,
                    stage=rt.a.stage,
                    member=rt.a.member,
                    device=rt.device,
                    steps=spec.steps,
                )
            )

    # One stage (the single-device reference) runs in the caller's thread: no pipeline,
    # and torch's intra-op thread pool stays the caller's own.
    threads = [threading.Thread(target=work, args=(rt,), daemon=True) for rt in runtimes]
    started = time.perf_counter()
    if len(runtimes) == 1:
        work(runtimes[0])
        threads = []
    for t in threads:
        t.start()
    try:
        monitor.wait_done(timeout_s)
    finally:
        for rt in runtimes:
            if (rt.a.stage, rt.a.member) not in monitor.done:
                rt.cancel()
        for t in threads:
            t.join(timeout=10)
        transport.close()
    wall = time.perf_counter() - started
    weights: dict[str, torch.Tensor] = {}
    for rt in runtimes:
        state = {k: v.detach().clone() for k, v in rt.segment.state_dict().items()}
        if rt.a.member == 0:
            weights.update(state)
        elif any(not torch.equal(v, weights[k]) for k, v in state.items()):
            raise JobFailed(
                f"job {job}: member {rt.a.member} of stage {rt.a.stage} ended with other "
                "weights than member 0"
            )
    return monitor.result(spec, plan, wall, weights)


@dataclass(frozen=True)
class Attempt:
    """What a resilient run tells one attempt of a job (:mod:`coordinator.engine.resilient`):
    start at ``first_step`` with the state in ``restore`` (one blob per stage, published
    retained on its restore topic before the assignments), have the stages publish their
    state every ``replicate_every`` steps, and stop with
    :class:`~coordinator.engine.monitor.JobAborted` as soon as ``abort()`` gives a reason.
    With ``handover``, an abort it wants (a group member died) stops the stages holding
    their state and collects the state of a step every stage reached before the run's
    grants end ([Note: a group member dies] in :mod:`coordinator.engine.handover`)."""

    first_step: int = 0
    replicate_every: int = 0
    restore: Mapping[int, bytes] | None = None
    abort: Callable[[], str | None] | None = None
    handover: Handover | None = None


def run_on_agents(
    spec: JobSpec,
    plan: Plan,
    control: MqttTransport,
    *,
    job: str | None = None,
    on_step: Callable[[StepReport], None] | None = None,
    shares: Sequence[Sequence[float]] | None = None,
    options: RunOptions = RunOptions(),
    attempt: Attempt = Attempt(),
) -> JobResult:
    """Run ``plan`` on the agents named by its stages, through the connected ``control``,
    as ``options`` say (:class:`~coordinator.engine.options.RunOptions`).

    With ``options.access`` (a broker whose accounts the coordinator manages), each device
    is granted its stage's topics before its assignment is sent, and loses them when the
    run ends, however it ends: the broker's ACL follows the plan of every attempt.

    An ``attempt`` of a resilient run starts where it says, replicates and stops when it
    says (:class:`Attempt`). However the run ends, the stages are told to stop unless they
    finished, and the retained restore blobs are cleared.

    ``options.servers`` maps server-tier devices to their torch device; when two or more
    stages run on them, those stages form a torch.distributed group with a store hosted
    here, listening on ``options.store_host`` only, where agents reach it (each joins only
    a store on an address it accepts: :func:`edge.server.groups.accepts_store_host`).
    """
    restore, handover, servers = attempt.restore, attempt.handover, options.servers
    job = job or new_job_id()
    assignments = make_assignments(
        job,
        spec,
        plan,
        first_step=attempt.first_step,
        replicate_every=attempt.replicate_every,
        restore=bool(restore),
        shares=shares,
        handover=handover is not None,
    )
    if plan.grouped and servers:
        raise ValueError("stage groups run over MQTT: a plan with groups takes no servers")
    assignments, store = _server_group(assignments, plan, servers, options.store_host)
    devices = [st.device for st in plan.stages]
    holders = [plan.stages[a.stage].devices[a.member] for a in assignments]
    monitor = JobMonitor(
        job,
        len(plan.stages),
        on_step,
        attempt.abort,
        devices=[st.devices for st in plan.stages],
        group_sizes=[len(st.devices) for st in plan.stages],
    )
    weights: dict[int, bytes] = {}
    got_weights = threading.Condition()

    def on_event(topic: str, payload: bytes) -> None:
        sender = parse_events_topic(topic)
        try:
            event = parse_event(payload)
        except MessageError as exc:
            monitor.reject("malformed", f"an event from {sender}: {exc}")
            return
        if isinstance(event, StageHeld):  # only a hold asks for it
            if handover is not None:
                handover.on_held(event, sender[1] if sender else None)
            return
        monitor.on_event(event, sender[1] if sender else None)

    def on_weights(topic: str, payload: bytes) -> None:
        # The broker's ACL lets only the device of stage s publish weights/s; here the
        # stage must exist and its first weights count (a repeat is QoS 1's duplicate).
        stage = topic.rsplit("/", 1)[1]
        if not stage.isdigit() or int(stage) >= len(devices):
            monitor.reject("no-such-stage", f"weights for stage {stage}")
            return
        with got_weights:
            if int(stage) in weights:
                return
            weights[int(stage)] = payload
            got_weights.notify_all()

    events_topic, weights_topic = job_events_all(job), f"{TOPIC_ROOT}/jobs/{job}/weights/+"
    control.subscribe(events_topic, on_event)
    control.subscribe(weights_topic, on_weights)
    try:
        if options.access is not None:
            options.access.grant(job, list(zip(holders, assignments, strict=True)))
        for stage, blob in (restore or {}).items():
            control.publish(job_restore(job, stage), blob, 1, retain=True)
        for device, a in zip(holders, assignments, strict=True):
            control.publish(device_cmd(device), a.model_dump_json(), 1)
        monitor.wait_ready(options.ready_timeout_s)
        started = time.perf_counter()
        for device in holders:
            control.publish(device_cmd(device), StartJob(job=job).model_dump_json(), 1)
        monitor.wait_done(options.timeout_s)
        wall = time.perf_counter() - started
        with got_weights:
            got_weights.wait_for(lambda: len(weights) == len(devices), timeout=60)
        merged: dict[str, torch.Tensor] = {}
        for stage in sorted(weights):
            merged.update(safetensors.torch.load(weights[stage]))
        if len(weights) != len(devices):
            missing = sorted(set(range(len(devices))) - set(weights))
            raise JobFailed(f"job {job}: the weights of stages {missing} never arrived")
        monitor.check_same_weights()
        return monitor.result(spec, plan, wall, merged)
    except BaseException as exc:
        if monitor.finished:
            raise
        hold = handover is not None and isinstance(exc, JobAborted) and handover.wanted()
        cancel = CancelJob(job=job, reason="coordinator gave up", hold=hold).model_dump_json()
        for device in holders:
            control.publish(device_cmd(device), cancel, 1)
        if hold and handover is not None:
            handover.collect(control)
        raise
    finally:
        del store  # the rendezvous store lives as long as the job
        control.unsubscribe(events_topic)
        control.unsubscribe(weights_topic)
        for stage in restore or {}:
            with contextlib.suppress(ConnectionError):
                control.publish(job_restore(job, stage), b"", 1, retain=True)  # clears it
        if options.access is not None:
            options.access.release(job)


def server_tier(profiles: Mapping[str, DeviceSpec]) -> dict[str, str]:
    """The devices that announced themselves as servers, with their torch device."""
    out = {}
    for device, spec in profiles.items():
        details = spec.details or {}
        if details.get("server"):
            out[device] = str(details.get("torch_device") or "cpu")
    return out


def _server_group(
    assignments: list[StageAssignment], plan: Plan, servers: Mapping[str, str], host: str
) -> tuple[list[StageAssignment], Any]:
    """Put the stages on ``servers`` into one torch.distributed group, if two or more are.

    Returns the assignments and the rendezvous store (hosted by this process on a
    free port of ``host``, :func:`_store_on`) that the group's ranks connect to, or
    ``None`` for no group.
    """
    stages = [a.stage for a in assignments if plan.stages[a.stage].device in servers]
    if len(stages) < 2:
        return assignments, None
    store = _store_on(host)
    cuda = all(servers[plan.stages[s].device].startswith("cuda") for s in stages)
    group = DistGroup(
        store_host=host,
        store_port=store.port,
        world_size=len(stages),
        ranks={s: i for i, s in enumerate(stages)},
        backend="nccl" if cuda else "gloo",
    )
    log.info(
        "stages %s form a torch.distributed group (%s) with the store on port %d",
        stages,
        group.backend,
        store.port,
    )
    out = [
        a.model_copy(update={"dist": group}) if a.stage in group.ranks else a for a in assignments
    ]
    return out, store


def _store_on(host: str) -> Any:
    """A rendezvous store (``TCPStore`` master) listening on a free port of ``host`` only.

    ``TCPStore`` itself listens on every interface whatever host it is given; so
    it gets a socket bound here to ``host`` (the address the group's ranks are
    told, 127.0.0.1 by default), which it then owns and closes. An address this
    machine does not have is a :class:`~coordinator.engine.monitor.JobFailed`.
    """
    import socket

    import torch.distributed as dist

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise JobFailed(f"cannot host the rendezvous store on {host}: {exc}") from None
    try:
        sock.bind(address)
        sock.listen(128)
        port = sock.getsockname()[1]
        store = dist.TCPStore(
            host,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=120),
            master_listen_fd=sock.fileno(),
        )
    except OSError as exc:
        sock.close()
        raise JobFailed(f"cannot host the rendezvous store on {host}: {exc.strerror}") from None
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store closes it
    return store
