"""The agent daemon: one per device, it connects, registers, and runs stages it is given.

Lifecycle:

1. Connect to the broker with a last-will that marks the device ``offline``
   (retained), then publish the device's profile and ``online`` (both
   retained, the profile first), and again after every reconnect (noticed at the next heartbeat),
   so a coordinator that starts later, or a broker that restarted, still
   learns about the device. The profile lists the datasets the device holds
   (``local_data``), by size and shape only ([Note: local data] in
   :mod:`edge.models.local_data`); what else it says is
   :mod:`edge.profiling.announcement`'s.
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
   own limits, and answers on its ``units`` topic (:mod:`edge.runtime.time_units`);
   never while it has a stage.
   One exception to one stage at a time: a job whose labels stay home gives each
   holder two stages, 0 and the last ([Note: labels stay home] in
   :mod:`edge.runtime.stage`), which run side by side.
4. SIGTERM (or :meth:`Agent.stop`) cancels the running stage, publishes
   ``offline`` and disconnects.

The stages themselves (running, restoring, replicating, holding and handing over,
watching the neighbour's replica) are :class:`edge.runtime.keeper.StageKeeper`'s; the
agent hands it each command.

Commands arrive on paho's network thread and are handed to a worker thread,
which builds stages (building waits for subscriptions, which needs the
network thread free).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import queue
import re
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from edge import __version__
from edge.errors import UserError
from edge.logs import bind
from edge.models.local_data import announce
from edge.problem import DeviceSpec
from edge.profiling.device import cgroup_limits
from edge.profiling.fixed_costs import (
    cpu_quota_of,
    measure_transport_byte_s,
    time_publish,
    with_publish_cost,
    with_transport_byte_cost,
)
from edge.runtime.allocator import tune_malloc
from edge.runtime.keeper import AssignmentCancelled, Event, StageKeeper, StageSettings
from edge.runtime.time_units import answer_time_units
from edge.transport.credentials import device_client_id, read_credentials
from edge.transport.mqtt import MqttTransport
from edge.transport.settings import MqttSettings, parse_broker_url
from edge.wire.messages import (
    CancelJob,
    DeviceStatus,
    HandOver,
    Heartbeat,
    MessageError,
    StageAssignment,
    StageFailed,
    StartJob,
    StepReport,
    Throttle,
    TimeUnits,
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
    valid_device_id,
)

__all__ = ["Agent", "AgentOptions", "agent_login", "check_device_id", "check_store_host"]

log = logging.getLogger("edgetrain.agent")

_KEEP = "keep-replicas"  # work item: store the neighbour replicas that arrived


def check_device_id(device_id: str) -> str:
    """``device_id`` if it can name a device on the wire; else a one-line error."""
    if not valid_device_id(device_id):
        raise UserError(
            f"--device-id: {device_id!r} is not 1-64 of A-Z a-z 0-9 _ . - "
            "(starting with a letter or digit)"
        )
    return device_id


_HOST_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")


def check_store_host(host: str) -> str:
    """``host`` if it is an IP address or a host name (a ``--store-host``); else a
    one-line error."""
    try:
        ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        if not _HOST_NAME.match(host):
            raise UserError(f"--store-host: {host!r} is not an IP address or a host name") from None
    return host


@dataclass(frozen=True, kw_only=True)
class AgentOptions(StageSettings):
    """The daemon's settings: those of its stages, and its own. A device id or a store
    host that is not one is refused with one line."""

    heartbeat_s: float = 1.0
    """How often it says it is alive."""
    version: str = __version__
    """The software version its status names (this package's)."""

    def __post_init__(self) -> None:
        check_device_id(self.device_id)
        for host in self.store_hosts:
            check_store_host(host)


def agent_login(
    device_id: str,
    broker: str | None = None,
    *,
    credentials: Path | None = None,
    username: str | None = None,
    password: str | None = None,
    tls_ca: Path | None = None,
    insecure: bool = False,
) -> tuple[MqttSettings, str]:
    """How agent ``device_id`` logs in to ``broker``, and the device id it runs as: the
    one its ``credentials`` (as ``edgetrain fleet enroll`` writes them) name, else
    ``device_id``. Refuses (one line) conflicting options, a login without credentials
    unless ``insecure``, and a device id that cannot be one."""
    if credentials is not None:
        if username or password or tls_ca:
            raise UserError("--credentials: give it alone, not with --username/--password/--tls-ca")
        creds = read_credentials(credentials)
        if broker is not None and broker != creds.broker:
            raise UserError(f"--broker {broker}: the credentials are for {creds.broker}")
        return creds.settings(), check_device_id(creds.device_id)
    if broker is None:
        raise UserError("--broker or --credentials: say which broker to connect to")
    parse_broker_url(broker)
    if username is None and not insecure:
        raise UserError(
            f"no credentials for {broker}: anyone who can publish on it could drive this "
            "agent; give --credentials FILE (edgetrain fleet enroll), or --insecure to accept that"
        )
    extra: dict[str, Any] = {"username": username, "password": password, "tls_ca": tls_ca}
    settings = MqttSettings(url=broker, **{k: v for k, v in extra.items() if v is not None})
    return settings, check_device_id(device_id)


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


class Agent:
    """One device's daemon (see the module docstring)."""

    def __init__(
        self, settings: MqttSettings, options: AgentOptions, profile: Callable[[], DeviceSpec]
    ) -> None:
        """Logs in with ``settings`` as ``options.device_id``, announcing what ``profile``
        returns (called once, as :meth:`run` starts)."""
        self.options = options
        self.device_id = options.device_id
        self._profile_fn = profile
        self._profile: DeviceSpec | None = None
        self._publish_timed = False
        self._stop = threading.Event()
        self._commands: queue.Queue[_Work] = queue.Queue()
        self.bad_commands = 0
        options.data_dir.mkdir(parents=True, exist_ok=True)
        self.transport = MqttTransport(
            settings.model_copy(
                update={"client_id": settings.client_id or device_client_id(self.device_id)}
            )
        )
        self.stages = StageKeeper(
            self.transport,
            options,
            report=self._event,
            announce=self._announce,
            wake=lambda: self._commands.put(_KEEP),
        )
        offline = DeviceStatus(device=self.device_id, state="offline", version=options.version)
        self.transport.will_set(device_status(self.device_id), offline.model_dump_json(), 1, True)

    # -- connection ------------------------------------------------------------------

    def _status(self, state: Literal["online", "offline", "busy"]) -> DeviceStatus:
        rt = self.stages.first
        return DeviceStatus(
            device=self.device_id,
            state=state,
            version=self.options.version,
            job=rt.a.job if rt else None,
            stage=rt.a.stage if rt else None,
        )

    def _announce(self) -> None:
        """On every (re)connect: profile, then status, both retained. The first time, it
        first times a few small QoS 1 publishes on its probe topic (part of the fixed cost
        of every frame and report), then the CPU each byte of a tensor costs through this
        connection (:mod:`edge.profiling.fixed_costs`)."""
        state: Literal["online", "busy"] = "busy" if self.stages.first is not None else "online"
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
        if self.transport.settings.username is None:
            log.warning(
                "--insecure: no broker credentials, so anyone who can publish on %s could "
                "drive this agent",
                self.transport.url,
            )
        local_data = self.options.local_data
        self._profile = announce(self._profile_fn(), local_data)
        for name, held in local_data.items():
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
        allowed = self.options.allow_code.describe()
        log.info("agent online on %s; it runs %s", self.transport.url, allowed)
        if self.transport.link is not None:
            log.info("emulating a link of %s for stage frames", self.transport.link.describe())
        worker = threading.Thread(target=self._work, name="agent-worker", daemon=True)
        worker.start()
        announced = self.transport.reconnects
        while not self._stop.wait(self.options.heartbeat_s):
            if self.transport.reconnects != announced and self.transport.connected:
                # A broker that restarted lost our retained status and profile.
                announced = self.transport.reconnects
                with contextlib.suppress(ConnectionError):
                    self._announce()
            rt = self.stages.first
            beat = Heartbeat(
                device=self.device_id,
                job=rt.a.job if rt else None,
                stage=rt.a.stage if rt else None,
                step=self.stages.step,
            )
            # While the broker is away publishing fails; paho reconnects, _announce runs again.
            with contextlib.suppress(ConnectionError):
                self.transport.publish(device_heartbeat(self.device_id), beat.model_dump_json(), 0)
        self._shutdown(worker)
        return 0

    def serve(self, threads: int | None = None) -> int:
        """Run as this process's daemon, from its main thread: tune the allocator
        (:func:`edge.runtime.allocator.tune_malloc`), compute with ``threads`` torch
        threads (default: torch's), stop on SIGTERM or SIGINT, and :meth:`run`."""
        tune_malloc()
        if threads is not None:
            torch.set_num_threads(threads)
        signal.signal(signal.SIGTERM, lambda *_: self.stop())
        signal.signal(signal.SIGINT, lambda *_: self.stop())
        return self.run()

    def stop(self) -> None:
        self._stop.set()

    def _shutdown(self, worker: threading.Thread) -> None:
        self.stages.cancel_all()
        self._commands.put(None)
        worker.join(timeout=5)
        self.stages.join(timeout=5)
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
            self.stages.note_cancelled(cmd.job)
        self._commands.put(cmd)

    def _work(self) -> None:
        while True:
            cmd = self._commands.get()
            if cmd is None:
                return
            try:
                self._obey(cmd)
            except AssignmentCancelled as exc:
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

    def _obey(self, cmd: _Work) -> None:
        """Carry out one work item (on the worker thread)."""
        if cmd == _KEEP:
            self.stages.keep_replicas()
        elif isinstance(cmd, _Refused):
            raise UserError(cmd.reason)
        elif isinstance(cmd, StageAssignment) and self.stages.was_cancelled(cmd.job):
            log.info("skipped an assignment of a cancelled job", extra={"job": cmd.job})
        elif isinstance(cmd, StageAssignment):
            self.stages.assign(cmd)
        elif isinstance(cmd, StartJob):
            self.stages.start(cmd.job)
        elif isinstance(cmd, Throttle):
            self.stages.throttle(cmd.slowdown)
        elif isinstance(cmd, HandOver):
            self.stages.hand_over(cmd)
        elif isinstance(cmd, TimeUnits):
            self._time_units(cmd)
        elif isinstance(cmd, CancelJob):
            self.stages.cancel(cmd)

    def _time_units(self, cmd: TimeUnits) -> None:
        """Answer ``cmd`` on this device's ``units`` topic (:mod:`edge.runtime.time_units`),
        on the worker (a job's assignment waits behind it), at the device's throttle."""
        busy = self.stages.first
        answer = answer_time_units(
            cmd,
            device=self.device_id,
            allow_code=self.options.allow_code,
            slowdown=self.stages.slowdown,
            busy_job=busy.a.job if busy is not None else None,
        )
        with contextlib.suppress(ConnectionError):
            self.transport.publish(device_units(self.device_id), answer.model_dump_json(), 1)

    def _event(self, event: Event) -> None:
        """Publish ``event`` on its job's ``events`` topic (a step is logged too)."""
        if isinstance(event, StepReport):
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
