"""A planning problem from a model and a fleet (coordinator.planner.build).

tests/integration/test_plan_cli.py runs ``edgetrain plan`` on such problems.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.planner.build import build_problem, parse_fleet
from edge.errors import UserError


def test_fleet_parsing_counts_files_and_errors(tmp_path: Path) -> None:
    me = {"id": "me", "gflops": 50, "memory_bytes": 1e9, "bandwidth_mbps": 100, "latency_ms": 1}
    path = tmp_path / "me.json"
    path.write_text(json.dumps(me))
    fleet = parse_fleet(f"rpi4-4gb:2,{path},jetson-nano")
    assert [d.id for d in fleet] == ["rpi4-4gb-1", "rpi4-4gb-2", "me", "jetson-nano"]
    with pytest.raises(UserError, match="count"):
        parse_fleet("rpi4-4gb:0")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**me, "gflops": -1}))
    with pytest.raises(UserError, match="gflops"):
        parse_fleet(str(bad))


def test_fleet_carries_predicted_watts_only_when_asked(tmp_path: Path) -> None:
    me = {"id": "me", "gflops": 50, "memory_bytes": 1e9, "bandwidth_mbps": 100, "latency_ms": 1}
    path = tmp_path / "me.json"
    path.write_text(json.dumps(me))
    plain = parse_fleet(f"rpi4-4gb:2,{path}")
    assert [(d.watts_busy, d.watts_idle) for d in plain] == [(None, None)] * 3
    powered = parse_fleet(f"rpi4-4gb:2,{path}", power=True)
    # Catalogue devices get their profile's figures; a device file keeps what it gives.
    assert [(d.id, d.watts_busy, d.watts_idle) for d in powered] == [
        ("rpi4-4gb-1", 6.4, 2.7),
        ("rpi4-4gb-2", 6.4, 2.7),
        ("me", None, None),
    ]


def test_built_problem_pins_and_refuses_an_unknown_pin() -> None:
    fleet = parse_fleet("rpi4-4gb,jetson-nano")
    problem = build_problem("mlp", fleet, batch_size=8, microbatches=2, pin_first="rpi4-4gb")
    assert problem.pin_first == "rpi4-4gb"
    with pytest.raises(UserError, match="pin_first"):
        build_problem("mlp", fleet, batch_size=8, microbatches=2, pin_first="nope")
