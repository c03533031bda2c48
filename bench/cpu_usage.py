"""Where a testbed's CPU goes during a run: each agent's and the broker's, sampled.

:class:`CpuSampler` reads, every ``interval_s`` in a thread of its own, the CPU
seconds of every process of each agent (the pids in its cpu cgroup under the kernel
and scalar methods, else its recorded process; ``utime + stime`` of
``/proc/PID/stat``, all its threads) and of the broker, and each agent's cgroup
``cpu.stat`` (``throttled_time``: how long its quota held it off the CPU). After a
run, :meth:`CpuSampler.between` gives each one's CPU seconds and throttled seconds
within a window of time (a run's steady steps), interpolated between samples.

A run's steps are short beside a stage's start (imports, data), so only the steady
window is read: what a device spends per step, computing or moving frames, against
what its share of a core allows (``cpu_s / window / share``: 1 is a device its quota
holds at the limit the whole time).
"""

from __future__ import annotations

import bisect
import contextlib
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from coordinator.testbed.state import State

__all__ = ["CpuSampler", "Usage"]

_TICK = os.sysconf("SC_CLK_TCK")


def _process_cpu_s(pid: int) -> float:
    """CPU seconds (user and system, every thread) of ``pid``; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime: fields 14 and 15


def _throttled_s(cgroup: Path) -> float:
    """Seconds the cgroup's CPU quota held its tasks off the CPU (v1 ``throttled_time``
    in ns, v2 ``throttled_usec``); 0 without one."""
    with contextlib.suppress(OSError):
        for line in (cgroup / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "throttled_time":
                return int(value) / 1e9
            if key == "throttled_usec":
                return int(value) / 1e6
    return 0.0


@dataclass
class Usage:
    """One process group's CPU within a window."""

    cpu_s: float
    throttled_s: float


@dataclass
class _Series:
    times: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    throttled: list[float] = field(default_factory=list)

    def at(self, t: float, values: list[float]) -> float:
        """``values`` interpolated at time ``t``."""
        i = bisect.bisect_left(self.times, t)
        if i <= 0:
            return values[0]
        if i >= len(self.times):
            return values[-1]
        t0, t1 = self.times[i - 1], self.times[i]
        w = (t - t0) / (t1 - t0) if t1 > t0 else 1.0
        return values[i - 1] + w * (values[i] - values[i - 1])


class CpuSampler:
    """Samples the CPU of the testbed in ``state_dir``'s agents and broker (see the module
    docstring) while it is entered."""

    def __init__(self, state_dir: Path, interval_s: float = 0.25) -> None:
        state = State.load(state_dir)
        if state is None:
            raise RuntimeError(f"no testbed in {state_dir}")
        self.interval_s = interval_s
        self._groups: dict[str, tuple[Path | None, list[int]]] = {}
        for row in state.devices:
            cgroups = [Path(c) for c in row.get("cgroups", [])]
            cpu = next((c for c in cgroups if (c / "cpu.stat").exists()), None)
            pids = [p.pid for p in state.processes if p.name == f"agent:{row['id']}"]
            self._groups[row["id"]] = (cpu, pids)
        self._groups["broker"] = (None, [p.pid for p in state.processes if p.name == "broker"])
        self._series = {name: _Series() for name in self._groups}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def _pids(self, name: str) -> list[int]:
        cgroup, pids = self._groups[name]
        if cgroup is None:
            return pids
        with contextlib.suppress(OSError):
            return [int(p) for p in (cgroup / "cgroup.procs").read_text().split()]
        return pids

    def sample(self) -> None:
        now = time.time()
        for name, (cgroup, _) in self._groups.items():
            series = self._series[name]
            series.times.append(now)
            series.cpu.append(sum(_process_cpu_s(pid) for pid in self._pids(name)))
            series.throttled.append(_throttled_s(cgroup) if cgroup is not None else 0.0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def between(self, start: float, end: float) -> dict[str, Usage]:
        """Each agent's (by device id) and the broker's CPU within ``[start, end]``."""
        out = {}
        for name, series in self._series.items():
            if len(series.times) < 2:
                continue
            cpu = series.at(end, series.cpu) - series.at(start, series.cpu)
            throttled = series.at(end, series.throttled) - series.at(start, series.throttled)
            out[name] = Usage(cpu, throttled)
        return out

    def __enter__(self) -> CpuSampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sample()
