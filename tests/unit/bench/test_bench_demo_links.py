"""bench/demo_links.py's pure parts: a split plan carried to another fleet's devices,
and the rate where the measured split fell behind the holders alone, in its table."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
from support.bench import load_bench

from coordinator.planner.score import Plan, Stage


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_bench("demo_links")


def _row(bench: ModuleType, mbps: float, strategy: str, sps: float, **extra: Any) -> Any:
    fields = {
        "mbps": mbps,
        "strategy": strategy,
        "planner": True,
        "codecs": [],
        "stages": [],
        "predicted_sps": sps,
        "measured_sps": sps,
        "bytes_per_sample": 1e3,
        "link_share_predicted": 0.5,
        "link_share_measured": 0.4,
        "steps": 4,
    }
    return bench.Row(**{**fields, **extra})


def test_a_split_runs_on_another_fleets_devices_in_the_same_places(bench: ModuleType) -> None:
    holders = ["a0", "a1"]
    stages = (Stage.group(holders, 0, 1), Stage.group(["a2"], 1, 3), Stage.group(holders, 3, 4))
    plan = Plan(stages, codecs=("fp32", "fp32"), u_shaped=True)
    moved = bench._renamed(plan, ["a0", "a1", "a2"], ["b0", "b1", "b2"])
    assert [st.devices for st in moved.stages] == [("b0", "b1"), ("b2",), ("b0", "b1")]
    assert moved.u_shaped and moved.codecs == plan.codecs
    assert [(st.start, st.end) for st in moved.stages] == [(0, 1), (1, 3), (3, 4)]


def test_the_measured_crossover_is_the_slowest_rate_the_split_still_led(
    bench: ModuleType,
) -> None:
    rows = [
        _row(bench, 100, "holders alone", 50),
        _row(bench, 100, "split fp32", 90),
        _row(bench, 10, "holders alone", 20),
        _row(bench, 10, "split fp32", 25),
        _row(bench, 3, "holders alone", 8),
        _row(bench, 3, "split fp32", 6),
    ]
    assert bench.measured_crossover(rows) == 10
    assert bench.measured_crossover(rows[:4]) == 0.0  # it led at every rate run
    behind = [rows[0], _row(bench, 100, "split fp32", 40)]
    assert bench.measured_crossover(behind) is None
    text = bench.table(rows, 30.0)
    assert "| 10 | split fp32 | yes | - | 25 | 25 | 1.00 | 1.0 | 50% | 40% |" in text
    assert text.endswith(
        "the planner stops splitting the fp32 job below 30 Mbit/s (bisected); measured, "
        "the split led the holders alone down to 10 Mbit/s"
    )
