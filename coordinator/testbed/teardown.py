"""What works from a testbed's state directory alone: :func:`status` and :func:`down`.

``down`` ends the testbed's processes (agents first, so they can say ``offline``;
also any process carrying the testbed's token or sitting in its cgroups that
never reached the state file), lifts CPU quotas so throttled agents shut down
promptly, removes cgroups (children first), namespaces and veths, then the
files ``up`` wrote (the broker's accounts, TLS files and private copies, the agents'
credentials among them) and the state file; ``logs/`` stays for a post-mortem.

Tested in tests/unit/coordinator/testbed/test_testbed_access.py (what ``down`` removes of
the broker's files) and, after real ``up`` runs, tests/e2e/test_testbed.py.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any

from coordinator.testbed import access, limits, netns, procs
from coordinator.testbed.state import (
    ProcRecord,
    State,
    find_marked,
    locked,
    proc_alive,
    proc_start,
    stop_processes,
)
from edge.errors import UserError

__all__ = ["MADE", "down", "status", "teardown"]

MADE = (
    "proxy.ready",
    "profiles",
    "agents",
    "coordinator",
    access.BROKER_DIR,
    access.CREDENTIALS_DIR,
)
"""What ``up`` writes in the state directory and ``down`` removes (``logs/`` stays)."""


def status(state_dir: Path) -> dict[str, Any]:
    """The testbed in ``state_dir``: ``{"up": False}`` when there is none, else its state,
    whether each process is alive, and each agent's status as the broker has it."""
    state = State.load(state_dir.expanduser().resolve())
    if state is None:
        return {"up": False, "state_dir": str(state_dir)}
    processes = [
        {"name": p.name, "pid": p.pid, "alive": proc_alive(p.pid, p.start)} for p in state.processes
    ]
    broker_alive = any(p["alive"] for p in processes if p["name"] == "broker")
    ids = [d["id"] for d in state.devices]
    agents = dict.fromkeys(ids, "unknown")
    if broker_alive:
        with contextlib.suppress(UserError):  # its accounts are gone: nothing is known
            agents = procs.agent_states(access.coordinator_login(state), ids)
    return {
        "up": state.phase == "up" and all(p["alive"] for p in processes),
        "phase": state.phase,
        "state_dir": str(state.dir),
        "id": state.id,
        "method": state.method,
        "method_reason": state.method_reason,
        "method_line": state.method_line,
        "broker_url": state.broker_url,
        "coordinator_url": state.coordinator_url,
        "core_gflops": state.core_gflops,
        "processes": processes,
        "devices": [{**d, "state": agents.get(d["id"], "unknown")} for d in state.devices],
    }


_ORDER = {"agent": 0, "coordinator": 1, "proxy": 2, "broker": 3}


def teardown(state: State, grace_s: float = 5.0) -> list[str]:
    """Remove everything ``state`` lists, then the state itself; what was removed, one per line."""
    state.phase = "stopping"
    state.save()
    removed: list[str] = []
    cgroups = [Path(c) for c in state.cgroups]
    known = {(p.pid, p.start) for p in state.processes}
    # Started but not recorded (a crash right after fork), or still in our cgroups: ours too.
    extra = [p for p in find_marked(state.token) if (p.pid, p.start) not in known]
    for c in cgroups:
        for pid in limits.cgroup_tasks(c):
            start = proc_start(pid)
            if start is not None and (pid, start) not in known | {(e.pid, e.start) for e in extra}:
                extra.append(ProcRecord("in-cgroup", pid, start))
    for c in cgroups:  # a throttled agent would take its time to shut down
        limits.lift_cpu_quota(c)
    ordered = sorted(state.processes, key=lambda p: _ORDER.get(p.name.split(":")[0], 0))
    for group in (
        [p for p in ordered if p.name.startswith("agent:")] + extra,
        [p for p in ordered if not p.name.startswith("agent:")],
    ):
        for p in stop_processes(group, grace_s):
            removed.append(f"process {p.name} (pid {p.pid})")
    for c in reversed(cgroups):
        if limits.remove_cgroup(c):
            removed.append(f"cgroup {c}")
    for ns in state.namespaces:
        if netns.delete_namespace(ns):
            removed.append(f"namespace {ns}")
    for veth in state.veths:
        if netns.delete_link(veth):
            removed.append(f"veth {veth}")
    # Only directories procs made (by their name): never what an edited state file names.
    private = [Path(d) for d in state.private_dirs if Path(d).name.startswith(procs.PRIVATE_PREFIX)]
    for path in [*(state.dir / name for name in MADE), *private]:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    state.remove()
    removed.append(f"state {state.path}")
    return removed


def down(state_dir: Path, grace_s: float = 5.0) -> list[str]:
    """Remove the testbed in ``state_dir`` (from its state file alone); what was removed.

    Idempotent: with no testbed there, it removes nothing and returns ``[]``.
    """
    state_dir = state_dir.expanduser().resolve()
    with locked(state_dir):
        state = State.load(state_dir)
        return [] if state is None else teardown(state, grace_s)
