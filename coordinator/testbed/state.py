"""The testbed's state directory: what ``up`` made, so that ``down`` can remove it.

The state is one JSON file, ``testbed.json``, rewritten atomically (a temporary
file, fsync, rename) **before** each resource is made (the intent: a cgroup,
namespace or veth is listed before it exists) and again after (a process's pid
once it runs). ``down`` works from this file alone: after a clean ``up``, after
an ``up`` that crashed half-way, after SIGKILLs. Removing something that does
not exist is not an error, so ``down`` is idempotent.

A process is identified by its pid **and** its start time (field 22 of
``/proc/<pid>/stat``, clock ticks since boot), so a pid that the kernel reused
for someone else's process is never signalled. Every process the testbed starts
also carries ``EDGETRAIN_TESTBED_TOKEN=<token>`` in its environment: a process
that started but whose pid never reached the file (a crash between ``fork`` and
the write) is still found, by that token, in ``/proc/<pid>/environ``.

The file also holds the testbed coordinator's API token (:attr:`State.api_token`,
another secret than the process token): the file is its owner's only (mode 0600)
and ``down`` removes it with the rest.

One testbed per state directory: ``up`` refuses while a ``testbed.json`` exists
there, and ``up`` and ``down`` hold an ``flock`` on ``lock`` while they work.

Tested in tests/unit/coordinator/testbed/test_testbed_state.py (round trip, pid reuse)
and tests/integration/test_testbed_processes.py (real processes found and stopped).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edge.errors import UserError
from edge.files import PRIVATE, write_atomic

__all__ = [
    "ENV_DIR",
    "ENV_TOKEN",
    "STATE_FILE",
    "ProcRecord",
    "State",
    "default_state_dir",
    "find_marked",
    "locked",
    "proc_alive",
    "proc_start",
    "stop_processes",
]

ENV_DIR = "EDGETRAIN_TESTBED_DIR"
"""Environment variable naming the default state directory."""
ENV_TOKEN = "EDGETRAIN_TESTBED_TOKEN"
"""Environment variable every process of a testbed carries (its token)."""
STATE_FILE = "testbed.json"
VERSION = 1


def default_state_dir() -> Path:
    """``$EDGETRAIN_TESTBED_DIR``, else ``~/.edgetrain/testbed``."""
    env = os.environ.get(ENV_DIR)
    return Path(env) if env else Path.home() / ".edgetrain" / "testbed"


@dataclass
class ProcRecord:
    """A process the testbed started."""

    name: str
    """``broker``, ``coordinator``, ``proxy`` or ``agent:<device id>``."""
    pid: int
    start: int
    """Its start time in clock ticks since boot (``/proc/<pid>/stat`` field 22)."""


@dataclass
class State:
    """Everything one testbed made (see the module docstring); saved by :meth:`save`."""

    dir: Path
    id: str
    """Short hex id: names of cgroups, namespaces and veths contain it."""
    token: str
    """The value of :data:`ENV_TOKEN` in every process of this testbed."""
    phase: str = "starting"
    """``starting`` until every agent is online, then ``up``; ``stopping`` during ``down``."""
    created_at: float = field(default_factory=time.time)
    method: str = ""
    method_reason: str = ""
    method_line: str = ""
    """What ``up`` printed after ``limits:``."""
    broker_url: str = ""
    coordinator_url: str | None = None
    api_token: str | None = None
    """The coordinator's API token (its ``EDGETRAIN_API_TOKEN``): what a client of its
    write routes sends as ``Authorization: Bearer``; ``None`` without a coordinator."""
    core_gflops: float = 0.0
    core_fixed_costs: dict[str, float] = field(default_factory=dict)
    """This machine's fixed costs (:mod:`edge.profiling.fixed_costs`) on one free core;
    a device limited to a share of a core announces them scaled up by it."""
    cpus_per_gflops: float = 0.0
    """Cores an emulated device gets per GFLOP/s of the device it emulates (the scale
    over the fastest device's speed): what a device that joins later gets."""
    processes: list[ProcRecord] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)
    """Cgroup directories, parents before children (removed in reverse)."""
    namespaces: list[str] = field(default_factory=list)
    veths: list[str] = field(default_factory=list)
    """Host-side veth names (deleting one removes its peer)."""
    devices: list[dict[str, Any]] = field(default_factory=list)
    """One row per agent: what ``status`` prints (id, emulates, cpus, limits, namespace)."""
    private_dirs: list[str] = field(default_factory=list)
    """Directories outside this one that hold private copies for a process that cannot
    read it (the broker's TLS and plugin files, for Mosquitto's own user)."""

    @property
    def path(self) -> Path:
        return self.dir / STATE_FILE

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["dir"] = str(self.dir)
        out["version"] = VERSION
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any], state_dir: Path) -> State:
        if data.get("version") != VERSION:
            raise UserError(
                f"{state_dir / STATE_FILE}: unknown state version {data.get('version')}"
            )
        data = {k: v for k, v in data.items() if k not in ("version", "dir")}
        data["processes"] = [ProcRecord(**p) for p in data.get("processes", [])]
        return cls(dir=state_dir, **data)

    @classmethod
    def load(cls, state_dir: Path) -> State | None:
        """The state in ``state_dir``; ``None`` when no testbed was made there."""
        path = state_dir / STATE_FILE
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise UserError(f"{path}: unreadable testbed state: {exc}") from None
        return cls.from_json(data, state_dir)

    def save(self) -> None:
        """Write the file atomically: a reader sees the old state or the new, never half."""
        # Private: it holds the token that marks the testbed's processes and the API token.
        write_atomic(self.path, json.dumps(self.to_json(), indent=1), mode=PRIVATE)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)

    def add_process(self, name: str, pid: int) -> ProcRecord:
        """Record a process that was just started (its start time read now) and save."""
        record = ProcRecord(name, pid, proc_start(pid) or 0)
        self.processes.append(record)
        self.save()
        return record

    def intend(self, kind: str, name: str) -> None:
        """Record a cgroup, namespace or veth before making it (``kind``: the list's name)."""
        items: list[str] = getattr(self, kind)
        if name not in items:
            items.append(name)
        self.save()


@contextlib.contextmanager
def locked(state_dir: Path, timeout_s: float = 30.0) -> Iterator[None]:
    """Hold ``state_dir/lock`` exclusively for the block (another ``up``/``down`` waits)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    with (state_dir / "lock").open("a") as f:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise UserError(f"{state_dir}: another testbed command holds it") from None
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    return text[text.rfind(")") + 2 :].split()


def proc_start(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot; ``None`` when there is no such process."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None  # field 22 of stat


def proc_alive(pid: int, start: int) -> bool:
    """Whether ``pid`` is still the process that started at ``start`` and has not exited."""
    fields = _stat_fields(pid)
    if not fields or len(fields) <= 19:
        return False
    return int(fields[19]) == start and fields[0] not in ("Z", "X")


def find_marked(token: str) -> list[ProcRecord]:
    """Live processes whose environment holds ``ENV_TOKEN=token``."""
    needle = f"{ENV_TOKEN}={token}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            env = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if needle in env.split(b"\0"):
            start = proc_start(pid)
            if start is not None and proc_alive(pid, start):
                found.append(ProcRecord("marked", pid, start))
    return found


def _reap(pid: int) -> None:
    """Collect ``pid``'s exit status if it is our child (else it is someone else's to reap)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def stop_processes(records: list[ProcRecord], grace_s: float = 5.0) -> list[ProcRecord]:
    """SIGTERM each live record, wait up to ``grace_s``, SIGKILL the rest; the ones signalled."""
    live = [r for r in records if r.start and proc_alive(r.pid, r.start)]
    for r in live:
        with contextlib.suppress(ProcessLookupError):
            os.kill(r.pid, signal.SIGTERM)
    pending = _wait_gone(live, grace_s)
    for r in pending:
        with contextlib.suppress(ProcessLookupError):
            os.kill(r.pid, signal.SIGKILL)
    _wait_gone(pending, 5.0)
    return live


def _wait_gone(records: list[ProcRecord], seconds: float) -> list[ProcRecord]:
    """Reap and wait up to ``seconds`` for ``records``' processes to end; those still alive."""
    deadline, pending = time.monotonic() + seconds, list(records)
    while pending and time.monotonic() < deadline:
        for r in pending:
            _reap(r.pid)
        pending = [r for r in pending if proc_alive(r.pid, r.start)]
        if pending:
            time.sleep(0.05)
    return pending
