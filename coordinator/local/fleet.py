"""A fleet of agent processes on this machine, for ``edgetrain train`` and tests.

:class:`LocalFleet` starts ``n`` real ``edgetrain agent`` processes against a
broker, waits until each has announced itself (status ``online`` and a
profile, both retained, newer than the fleet's start), and ends them by their
own pids (SIGTERM, then SIGKILL after a grace period) when the block ends,
also when the block fails.
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
from pathlib import Path
from types import TracebackType

from edge.problem import DeviceSpec
from edge.transport.mqtt import MqttTransport
from edge.wire.messages import DeviceStatus, MessageError
from edge.wire.topics import TOPIC_ROOT

__all__ = ["LocalFleet"]


class LocalFleet:
    """``n`` agent processes named ``{prefix}{i}`` (see the module docstring)."""

    def __init__(
        self,
        n: int,
        broker_url: str,
        *,
        threads: int | None = None,
        profile: str | None = None,
        measure_seconds: float = 0.3,
        work_dir: Path | None = None,
        profiles: list[str] | None = None,
        slowdowns: list[float] | None = None,
        servers: int = 0,
        programs: list[list[str]] | None = None,
    ) -> None:
        self.n = n
        self.broker_url = broker_url
        self.prefix = f"local-{secrets.token_hex(2)}-"
        self.ids = [f"{self.prefix}{i}" for i in range(n)]
        self.threads = threads or max(1, (os.cpu_count() or 1) // n)
        # Per agent: the catalogue profile it announces and how much slower it runs.
        self.profiles: list[str | None] = list(profiles) if profiles else [profile] * n
        self.slowdowns = slowdowns or [1.0] * n
        if len(self.profiles) != n or len(self.slowdowns) != n:
            raise ValueError("profiles and slowdowns need one entry per agent")
        self.servers = set(self.ids[n - servers :]) if servers else set()
        """The last ``servers`` agents are server tier (``edgetrain agent --server``)."""
        self.programs = {
            device: program
            for device, program in zip(self.ids, programs or [[]] * n, strict=True)
            if program
        }
        """Per agent, the command that runs ``edgetrain`` (another install's, say); this
        interpreter's ``-m edgetrain.cli`` where it is empty or not given."""
        self.measure_seconds = measure_seconds
        self._tmp = (
            tempfile.TemporaryDirectory(prefix="edgetrain-fleet-") if work_dir is None else None
        )
        self.work_dir = work_dir or Path(self._tmp.name)  # type: ignore[union-attr]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.started_at = 0.0

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
        cmd = [
            *program,
            "agent",
            "--broker",
            self.broker_url,
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
        if profile:
            cmd += ["--profile", profile]
        if device in self.servers:
            cmd += ["--server"]
        log = self.log_path(device).open("wb")
        self.procs[device] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        log.close()

    def wait_online(self, control: MqttTransport, timeout: float = 60.0) -> dict[str, DeviceSpec]:
        """Each agent's announced profile, once all are online; raises if one is not."""
        profiles: dict[str, DeviceSpec] = {}
        online: set[str] = set()
        cond = threading.Condition()

        def on_status(_topic: str, payload: bytes) -> None:
            try:
                status = DeviceStatus.model_validate_json(payload)
            except (ValueError, MessageError):
                return
            fresh = status.ts >= self.started_at - 1  # not a retained leftover of an old run
            if status.device in self.procs and status.state != "offline" and fresh:
                with cond:
                    online.add(status.device)
                    cond.notify_all()

        def on_profile(topic: str, payload: bytes) -> None:
            device = topic.split("/")[-2]
            if device in self.procs:
                try:
                    spec = DeviceSpec.model_validate_json(payload)
                except ValueError:
                    return
                with cond:
                    profiles[device] = spec
                    cond.notify_all()

        status_topic = f"{TOPIC_ROOT}/devices/+/status"
        profile_topic = f"{TOPIC_ROOT}/devices/+/profile"
        control.subscribe(profile_topic, on_profile)
        control.subscribe(status_topic, on_status)
        deadline = time.monotonic() + timeout
        try:
            with cond:
                while not (online >= set(self.ids) and set(profiles) >= set(self.ids)):
                    dead = [d for d, p in self.procs.items() if p.poll() is not None]
                    if dead:
                        raise RuntimeError(f"agent {dead[0]} exited: {self.tail(dead[0])}")
                    if time.monotonic() > deadline:
                        missing = sorted(set(self.ids) - online)
                        raise RuntimeError(f"agents {missing} not online within {timeout:.0f} s")
                    cond.wait(0.2)
        finally:
            control.unsubscribe(status_topic)
            control.unsubscribe(profile_topic)
        return {d: profiles[d] for d in self.ids}

    def tail(self, device: str, lines: int = 5) -> str:
        path = self.log_path(device)
        text = path.read_text(errors="replace") if path.exists() else ""
        return " | ".join(text.strip().splitlines()[-lines:])

    def kill(self, device: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to one agent (fault injection and tests)."""
        self.procs[device].send_signal(sig)

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
