"""Faults checked against the plan: one naming a stage the plan lacks would never fire."""

from __future__ import annotations

import pytest

from coordinator.engine.faults import check_fault_stages, parse_fault
from edge.errors import UserError


def test_a_fault_on_a_stage_the_plan_lacks_is_one_line_naming_both() -> None:
    with pytest.raises(UserError) as one:
        check_fault_stages([parse_fault("kill:1@6")], 1)
    assert one.value.message == "--fault kill:1@6: the plan has 1 stage (stage 0), no stage 1"
    assert one.value.exit_code == 2
    faults = [parse_fault(f) for f in ("slow:0@2:2", "join:laptop@3", "slow:3@4:1.5")]
    with pytest.raises(UserError) as three:
        check_fault_stages(faults, 3, "fault")
    why = "fault slow:3@4:1.5: the plan has 3 stages (stages 0-2), no stage 3"
    assert three.value.message == why


def test_faults_on_the_plans_stages_and_joins_pass() -> None:
    faults = [parse_fault(f) for f in ("kill:2@1", "slow:0@2:2", "join:laptop@3")]
    check_fault_stages(faults, 3)
    check_fault_stages([parse_fault("join:laptop@3")], 1)  # a join names no stage
    check_fault_stages([], 1)
