"""The testbed's fault actuator: which faults it refuses, and why.

tests/integration/test_testbed_processes.py has it kill real processes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.testbed import saved_state, unconnected_actuator

from coordinator.engine.faults import parse_fault
from coordinator.testbed.state import State


@pytest.fixture
def state(tmp_path: Path) -> State:
    return saved_state(tmp_path)


def test_refusals_name_the_reason(state: State) -> None:
    actuator = unconnected_actuator(state)
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
