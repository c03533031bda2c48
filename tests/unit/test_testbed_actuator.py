"""The testbed's fault actuator kills only the processes its state records, as they started."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.waiting import until

from coordinator.engine.faults import parse_fault
from coordinator.testbed import procs
from coordinator.testbed.actuator import TestbedActuator
from coordinator.testbed.state import State, proc_alive
from edge.errors import UserError
from edge.transport.mqtt import MqttSettings, MqttTransport


@pytest.fixture
def state(tmp_path: Path) -> State:
    bed = State(dir=tmp_path, id="ab12", token="t0k3n", phase="up", method="software")
    bed.save()
    return bed


@pytest.fixture
def spawn(state: State) -> Iterator[Callable[[str], None]]:
    """Start a stand-in agent (``sleep``) recorded in the state as ``name``."""
    started: list[subprocess.Popen[bytes]] = []
    yield lambda name: started.append(procs.spawn(state, name, ["sleep", "60"]))
    for proc in started:
        proc.kill()
        proc.wait(5)


def _actuator(state: State) -> TestbedActuator:
    # Never connected: kill and join do not use MQTT (only slow does).
    return TestbedActuator(state.dir, MqttTransport(MqttSettings(url="mqtt://127.0.0.1:1")))


def test_kill_sigkills_the_recorded_agent_and_nothing_else(
    state: State, spawn: Callable[[str], None]
) -> None:
    spawn("agent:a")
    spawn("agent:b")
    a, b = State.load(state.dir).processes  # type: ignore[union-attr]
    done = _actuator(state).kill("a")
    assert done == f"SIGKILL to the agent of a (pid {a.pid})"
    assert until(lambda: not proc_alive(a.pid, a.start), 5)
    assert proc_alive(b.pid, b.start)
    with pytest.raises(UserError, match=r"the agent of a \(pid \d+\) is not running"):
        _actuator(state).kill("a")
    with pytest.raises(UserError, match="c is not an agent of the testbed"):
        _actuator(state).kill("c")


def test_a_reused_pid_is_never_signalled(state: State, spawn: Callable[[str], None]) -> None:
    spawn("agent:a")
    loaded = State.load(state.dir)
    assert loaded is not None
    loaded.processes[0].start += 1  # as if the pid now named another process
    loaded.save()
    with pytest.raises(UserError, match="is not running"):
        _actuator(state).kill("a")
    record = State.load(state.dir).processes[0]  # type: ignore[union-attr]
    assert proc_alive(record.pid, record.start - 1)


def test_refusals_name_the_reason(state: State) -> None:
    actuator = _actuator(state)
    assert actuator.refusal(parse_fault("kill:1@2")) is None
    assert actuator.refusal(parse_fault("join:rpi4@2")) is None
    state.method = "kernel"
    state.save()
    why = actuator.refusal(parse_fault("join:rpi4@2"))
    assert why is not None and "software-method" in why
    state.remove()
    why = actuator.refusal(parse_fault("kill:1@2"))
    assert why == f"kill faults: no running testbed in {state.dir.resolve()}"
    assert actuator.refusal(parse_fault("slow:0@2:2")) is None  # no testbed needed
