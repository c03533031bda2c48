"""The testbed's state file and process identity: round trip, pid reuse.

tests/integration/test_testbed_processes.py finds, stops and kills real processes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from coordinator.testbed.state import STATE_FILE, State, proc_alive, proc_start
from edge.errors import UserError


def test_state_round_trips_through_its_file(tmp_path: Path) -> None:
    state = State(
        dir=tmp_path,
        id="ab12",
        token="t0k3n",
        method="kernel",
        method_reason="root",
        broker_url="mqtt://127.0.0.1:1",
        api_token="an-api-token-of-32-characters-xx",
    )
    state.intend("cgroups", "/sys/fs/cgroup/cpu/edgetrain-testbed-ab12")
    state.intend("cgroups", "/sys/fs/cgroup/cpu/edgetrain-testbed-ab12")  # listed once
    state.intend("namespaces", "et-ab12-0")
    state.add_process("broker", os.getpid())
    loaded = State.load(tmp_path)
    assert loaded == state
    assert loaded is not None and loaded.cgroups == ["/sys/fs/cgroup/cpu/edgetrain-testbed-ab12"]
    assert loaded.processes[0].start == proc_start(os.getpid())
    assert [p.name for p in tmp_path.iterdir()] == [STATE_FILE]  # no temporary left
    assert (tmp_path / STATE_FILE).stat().st_mode & 0o777 == 0o600  # it holds the tokens


def test_a_state_from_before_api_tokens_still_loads(tmp_path: Path) -> None:
    """``down`` must work on a testbed brought up before ``api_token`` was recorded."""
    old = State(dir=tmp_path, id="ab12", token="t0k3n").to_json()
    del old["api_token"]
    (tmp_path / STATE_FILE).write_text(json.dumps(old))
    loaded = State.load(tmp_path)
    assert loaded is not None and loaded.api_token is None


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
