"""A fleet of agent processes on this machine, for ``edgetrain train`` and tests.

:class:`LocalFleet` starts ``n`` real ``edgetrain agent`` processes against a
broker, waits until each has announced itself (status ``online`` and a
profile, both retained, newer than the fleet's start), and ends them by their
own pids (SIGTERM, then SIGKILL after a grace period) when the block ends,
also when the block fails. The agents run the zoo plus the user code under
``allow_code``.

It is the :class:`~coordinator.engine.engine.Fleet` and the
:class:`~coordinator.engine.faults.FaultActuator` of a job that
``edgetrain train`` drives over it: its available devices are those whose
agent announced a profile and still runs; it kills an agent with SIGKILL,
slows one with a ``Throttle`` command and starts a new one to join.

On a broker the fleet's owner started securely (an
:class:`~coordinator.local.owned.OwnedBroker` with accounts), or given ``enroll``
(a coordinator's API, say), each agent is enrolled and started with its own
credentials file; on any other broker, with ``--insecure``.

Tested in tests/e2e/test_agent.py (agents started, signalled and stopped by their pids),
tests/e2e/test_fault_tolerance.py (its kills as a job's faults) and
tests/e2e/test_train_cli.py (``edgetrain train`` over it).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from coordinator.engine.faults import Fault
from coordinator.engine.watch import DeviceFeed
from coordinator.local.owned import OwnedBroker
from edge.errors import UserError
from edge.files import PRIVATE, write_atomic
from edge.problem import DeviceSpec
from edge.transport.credentials import Credentials
from edge.transport.mqtt import MqttTransport
from edge.transport.settings import MqttSettings
from edge.wire.messages import DeviceStatus, Throttle
from edge.wire.topics import device_cmd

__all__ = ["AgentRoles", "LocalFleet"]


@dataclass(frozen=True)
class AgentRoles:
    """What each agent of a :class:`LocalFleet` is, beyond a copy of this machine (every
    list one entry per agent, in order)."""

    profiles: Sequence[str | None] | None = None
    """The catalogue device each announces (``None``: its own measured profile)."""
    slowdowns: Sequence[float] | None = None
    """How many times slower than this machine each runs. Given, each agent emulates its
    profile (``--emulate``): it announces the speed it gets here, so that predictions
    match what it measures."""
    servers: int = 0
    """The last this many agents are server tier (``edgetrain agent --server``)."""
    server_device: str = "cpu"
    """What the server-tier agents compute on (``edgetrain agent --device``: ``cuda`` puts
    each on this machine's GPU, all on the first unless ``cuda:N`` says otherwise)."""
    programs: Sequence[Sequence[str]] | None = None
    """The command that runs each one's ``edgetrain`` (another install's, say); this
    interpreter's ``-m edgetrain.cli`` where it is empty or not given."""
    data: Sequence[Sequence[str]] | None = None
    """The local datasets each of the first agents holds (``--data NAME=SPEC`` items)."""
    links: Sequence[float | None] | None = None
    """The rate each shapes its link to, Mbit/s each way (``--link-mbps``), which it
    announces; ``None``: its profile's (an emulated device's), or this machine's."""


class LocalFleet:
    """``n`` agent processes named ``{prefix}{i}`` (see the module docstring), each as its
    ``roles`` say, with ``threads`` torch threads (default: cores / n) and the user code
    under ``allow_code``."""

    def __init__(
        self,
        n: int,
        broker: str | OwnedBroker | None,
        *,
        roles: AgentRoles = AgentRoles(),
        threads: int | None = None,
        allow_code: Sequence[str] = (),
        enroll: Callable[[str], Credentials] | None = None,
        measure_seconds: float = 0.3,
        work_dir: Path | None = None,
    ) -> None:
        self.n = n
        self.owned = broker if isinstance(broker, OwnedBroker) else None
        if enroll is None and self.owned is not None and self.owned.accounts is not None:
            enroll = self.owned.accounts.enroll
        if broker is None and enroll is None:
            raise ValueError("a fleet needs a broker URL, or enroll to get credentials from")
        self.enroll = enroll
        """Gives each agent its credentials (``None``: agents log in with ``--insecure``)."""
        self.broker_url = broker.url if isinstance(broker, OwnedBroker) else (broker or "")
        """The broker; with only ``enroll``, the one the first credentials name."""
        self.settings = (
            self.owned.settings() if self.owned is not None else MqttSettings(url=self.broker_url)
        )
        """How the fleet's own connections log in (the coordinator's account, if any)."""
        self.prefix = f"local-{secrets.token_hex(2)}-"
        self.ids = [f"{self.prefix}{i}" for i in range(n)]
        self.threads = threads or max(1, (os.cpu_count() or 1) // n)
        # Per agent: the catalogue profile it announces and how much slower it runs.
        self.profiles: list[str | None] = list(roles.profiles or [None] * n)
        self.slowdowns = list(roles.slowdowns or [1.0] * n)
        self.emulate = roles.slowdowns is not None
        """Given ``slowdowns``, each agent emulates its profile (:class:`AgentRoles`)."""
        if len(self.profiles) != n or len(self.slowdowns) != n:
            raise ValueError("profiles and slowdowns need one entry per agent")
        servers = roles.servers
        self.servers = set(self.ids[n - servers :]) if servers else set()
        """The server-tier agents."""
        self.server_device = roles.server_device
        self.programs = {
            device: list(program)
            for device, program in zip(self.ids, roles.programs or [[]] * n, strict=True)
            if program
        }
        """Per agent, the command that runs ``edgetrain``, where it is not this install's."""
        self.data = {
            device: list(items) for device, items in zip(self.ids, roles.data or [], strict=False)
        }
        """Per agent, the local datasets it holds (``--data NAME=SPEC`` items)."""
        self.links = dict(zip(self.ids, roles.links or [], strict=False))
        """Per agent, the rate its link is shaped to (``--link-mbps``), where given."""
        self.allow_code = list(allow_code)
        """Module prefixes of user code the agents may run (``--allow-code``): the job's own."""
        self.measure_seconds = measure_seconds
        self._tmp = (
            tempfile.TemporaryDirectory(prefix="edgetrain-fleet-") if work_dir is None else None
        )
        self.work_dir = work_dir or Path(self._tmp.name)  # type: ignore[union-attr]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.started_at = 0.0
        self.announced: dict[str, DeviceSpec] = {}
        """The profile each agent announced, once :meth:`wait_online` saw it."""
        self.control: MqttTransport | None = None
        """The connection :meth:`wait_online` last used; ``slow`` faults are sent on it."""

    def log_path(self, device: str) -> Path:
        return self.work_dir / f"{device}.log"

    def start(self) -> LocalFleet:
        self.started_at = time.time()
        for device, profile, slowdown in zip(self.ids, self.profiles, self.slowdowns, strict=True):
            self._spawn(device, profile, slowdown)
        return self

    def add(self, profile: str | None = None, slowdown: float = 1.0) -> str:
        """Start one more agent (a device joining); its id. :meth:`wait_online` waits for it."""
        device = f"{self.prefix}{len(self.ids)}"
        self.ids.append(device)
        self.profiles.append(profile)
        self.slowdowns.append(slowdown)
        self._spawn(device, profile, slowdown)
        return device

    def _spawn(self, device: str, profile: str | None, slowdown: float) -> None:
        program = self.programs.get(device, [sys.executable, "-m", "edgetrain.cli"])
        if self.enroll is not None:
            creds = self.enroll(device)
            path = self.work_dir / f"{device}.credentials.json"
            write_atomic(path, creds.to_json(), mode=PRIVATE)
            self.broker_url = self.broker_url or creds.broker
            login = ["--credentials", str(path)]
        else:
            login = ["--broker", self.broker_url, "--insecure"]
        cmd = [
            *program,
            "agent",
            *login,
            "--device-id",
            device,
            "--data-dir",
            str(self.work_dir / device),
            "--threads",
            str(self.threads),
            "--measure-seconds",
            str(self.measure_seconds),
            "--heartbeat-s",
            "0.5",
            "--slowdown",
            str(slowdown),
        ]
        if device not in self.programs:  # this install's agents measure one at a time
            cmd += ["--measure-lock", str(self.work_dir / "measure.lock")]
        for prefix in self.allow_code:
            cmd += ["--allow-code", prefix]
        for item in self.data.get(device, []):
            cmd += ["--data", item]
        if self.links.get(device) is not None:
            cmd += ["--link-mbps", str(self.links[device])]
        if profile:
            cmd += ["--emulate" if self.emulate else "--profile", profile]
        if device in self.servers:
            cmd += ["--server", "--device", self.server_device]
        log = self.log_path(device).open("wb")
        self.procs[device] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        log.close()

    def wait_online(
        self, control: MqttTransport, timeout: float = 60.0, devices: list[str] | None = None
    ) -> dict[str, DeviceSpec]:
        """Each agent's announced profile, once all (or ``devices``) are online; raises
        if one is not."""
        ids = list(self.ids if devices is None else devices)
        self.control = control
        profiles: dict[str, DeviceSpec] = {}
        online: set[str] = set()
        cond = threading.Condition()

        def on_status(device: str, status: DeviceStatus) -> None:
            fresh = status.ts >= self.started_at - 1  # not a retained leftover of an old run
            if device in self.procs and status.state != "offline" and fresh:
                with cond:
                    online.add(device)
                    cond.notify_all()

        def on_profile(device: str, spec: DeviceSpec) -> None:
            if device in self.procs:
                with cond:
                    profiles[device] = spec
                    cond.notify_all()

        deadline = time.monotonic() + timeout
        with DeviceFeed(control, on_status=on_status, on_profile=on_profile), cond:
            while not (online >= set(ids) and set(profiles) >= set(ids)):
                dead = [d for d in ids if self.procs[d].poll() is not None]
                if dead:
                    raise RuntimeError(f"agent {dead[0]} exited: {self.tail(dead[0])}")
                if time.monotonic() > deadline:
                    missing = sorted(set(ids) - online)
                    raise RuntimeError(f"agents {missing} not online within {timeout:.0f} s")
                cond.wait(0.2)
        self.announced.update(profiles)
        return {d: profiles[d] for d in ids}

    def available(self, allowed: list[str] | None = None) -> list[DeviceSpec]:
        """Announced profiles of the agents still running (in ``allowed`` when given)."""
        return [
            self.announced[d]
            for d in self.ids
            if d in self.announced
            and self.procs[d].poll() is None
            and (allowed is None or d in allowed)
        ]

    # -- faults (the FaultActuator protocol) ----------------------------------------------

    def refusal(self, fault: Fault) -> str | None:
        if fault.kind == "slow" and self.control is None:
            return "slow faults need the fleet's connection: call wait_online first"
        return None

    def slow(self, device: str, factor: float) -> str:
        if self.control is None:
            raise UserError(self.refusal(Fault(kind="slow", stage=0, step=0, factor=factor)) or "")
        throttle = Throttle(slowdown=factor).model_dump_json()
        self.control.publish(device_cmd(device), throttle, 1)
        return f"{device} computes {factor:g}x slower"

    def join(self, profile: str) -> str:
        """Start an agent with the catalogue ``profile`` and wait until it is online, on a
        connection of its own (a job's device watch may hold the status filter of
        :attr:`control`'s)."""
        device = self.add(profile)
        watcher = MqttTransport(self.settings)
        try:
            watcher.connect(timeout=15)
            self.wait_online(watcher, timeout=60, devices=[device])
        finally:
            watcher.close()
        return device

    def tail(self, device: str, lines: int = 5) -> str:
        path = self.log_path(device)
        text = path.read_text(errors="replace") if path.exists() else ""
        return " | ".join(text.strip().splitlines()[-lines:])

    def kill(self, device: str, sig: int = signal.SIGKILL) -> str:
        """Send ``sig`` to one agent (fault injection and tests); what was done."""
        self.procs[device].send_signal(sig)
        return f"sent {signal.Signals(sig).name} to {device}'s agent"

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM every agent, wait, SIGKILL those still running; idempotent."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalFleet:
        return self.start()

    def __exit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self.stop()
