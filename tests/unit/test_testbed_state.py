"""The testbed's state file and process identity: round trip, pid reuse, marked processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.waiting import until

from coordinator.testbed.state import (
    ENV_TOKEN,
    STATE_FILE,
    State,
    find_marked,
    proc_alive,
    proc_start,
    stop_processes,
)
from edge.errors import UserError


def test_state_round_trips_through_its_file(tmp_path: Path) -> None:
    state = State(
        dir=tmp_path,
        id="ab12",
        token="t0k3n",
        method="kernel",
        method_reason="root",
        broker_url="mqtt://127.0.0.1:1",
    )
    state.intend("cgroups", "/sys/fs/cgroup/cpu/edgetrain-testbed-ab12")
    state.intend("cgroups", "/sys/fs/cgroup/cpu/edgetrain-testbed-ab12")  # listed once
    state.intend("namespaces", "et-ab12-0")
    state.add_process("broker", os.getpid())
    loaded = State.load(tmp_path)
    assert loaded == state
    assert loaded is not None and loaded.cgroups == ["/sys/fs/cgroup/cpu/edgetrain-testbed-ab12"]
    assert loaded.processes[0].start == proc_start(os.getpid())
    assert not list(tmp_path.glob("*.tmp"))  # written atomically, nothing half-written left


def test_missing_and_bad_state(tmp_path: Path) -> None:
    assert State.load(tmp_path) is None
    (tmp_path / STATE_FILE).write_text("{not json")
    with pytest.raises(UserError, match="unreadable testbed state"):
        State.load(tmp_path)
    (tmp_path / STATE_FILE).write_text('{"version": 99}')
    with pytest.raises(UserError, match="unknown state version"):
        State.load(tmp_path)


def test_a_reused_pid_is_not_ours() -> None:
    start = proc_start(os.getpid())
    assert start is not None
    assert proc_alive(os.getpid(), start)
    assert not proc_alive(os.getpid(), start + 1)  # same pid, another process
    assert proc_start(2**22 + 7) is None  # beyond pid_max: no such process


def test_marked_processes_are_found_and_stopped() -> None:
    token = f"unit-{os.getpid()}"
    env = {**os.environ, ENV_TOKEN: token}
    # Ignores SIGTERM: stop_processes must fall back to SIGKILL.
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        assert until(lambda: find_marked(token), 5)
        found = find_marked(token)
        assert [p.pid for p in found] == [proc.pid]
        stopped = stop_processes(found, grace_s=0.5)
        assert [p.pid for p in stopped] == [proc.pid]
        # Reaped by stop_processes (it was our child), after SIGKILL: it ignored SIGTERM.
        assert not proc_alive(found[0].pid, found[0].start)
        assert find_marked(token) == []
    finally:
        proc.kill()
        proc.wait(5)
