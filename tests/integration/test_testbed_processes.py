"""The testbed's processes, real ones: the fault actuator kills only the processes its
state records, as they started, and marked processes are found and stopped.

What the actuator refuses, and the state file, are tests/unit/coordinator/testbed's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.testbed import saved_state, unconnected_actuator
from support.waiting import until

from coordinator.testbed import procs
from coordinator.testbed.state import ENV_TOKEN, State, find_marked, proc_alive, stop_processes
from edge.errors import UserError


@pytest.fixture
def state(tmp_path: Path) -> State:
    return saved_state(tmp_path)


@pytest.fixture
def spawn(state: State) -> Iterator[Callable[[str], None]]:
    """Start a stand-in agent (``sleep``) recorded in the state as ``name``."""
    started: list[subprocess.Popen[bytes]] = []
    yield lambda name: started.append(procs.spawn(state, name, ["sleep", "60"]))
    for proc in started:
        proc.kill()
        proc.wait(5)


def test_kill_sigkills_the_recorded_agent_and_nothing_else(
    state: State, spawn: Callable[[str], None]
) -> None:
    spawn("agent:a")
    spawn("agent:b")
    a, b = State.load(state.dir).processes  # type: ignore[union-attr]
    done = unconnected_actuator(state).kill("a")
    assert done == f"SIGKILL to the agent of a (pid {a.pid})"
    assert until(lambda: not proc_alive(a.pid, a.start), 5)
    assert proc_alive(b.pid, b.start)
    with pytest.raises(UserError, match=r"the agent of a \(pid \d+\) is not running"):
        unconnected_actuator(state).kill("a")
    with pytest.raises(UserError, match="c is not an agent of the testbed"):
        unconnected_actuator(state).kill("c")


def test_a_reused_pid_is_never_signalled(state: State, spawn: Callable[[str], None]) -> None:
    spawn("agent:a")
    loaded = State.load(state.dir)
    assert loaded is not None
    loaded.processes[0].start += 1  # as if the pid now named another process
    loaded.save()
    with pytest.raises(UserError, match="is not running"):
        unconnected_actuator(state).kill("a")
    record = State.load(state.dir).processes[0]  # type: ignore[union-attr]
    assert proc_alive(record.pid, record.start - 1)


def test_the_coordinator_never_starts_without_its_api_token(state: State) -> None:
    assert state.api_token is None  # an open API: anyone here could enrol (issue 31)
    with pytest.raises(ValueError, match="needs its API token"):
        procs.start_coordinator(state, state.broker_url, None)
    assert State.load(state.dir).processes == []  # type: ignore[union-attr]


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
