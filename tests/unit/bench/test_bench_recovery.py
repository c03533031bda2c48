"""bench/recovery.py's pure parts: its plans, its weight comparison, its summary and table."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from support.bench import load_bench


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_bench("recovery")


def test_even_plans_cover_every_unit_once(bench: ModuleType) -> None:
    plan = bench.even_plan(["a", "b", "c"], 6)
    assert [(st.device, st.start, st.end) for st in plan.stages] == [
        ("a", 0, 2),
        ("b", 2, 4),
        ("c", 4, 6),
    ]
    assert [st.device for st in bench.even_plan(["a", "b", "c"], 2).stages] == ["a", "b"]
    two = bench.even_plan(["x", "y"], 5)
    assert two.stages[0].start == 0 and two.stages[-1].end == 5
    assert two.stages[0].end == two.stages[1].start


def test_max_rel_diff_is_relative_to_each_reference_tensor(bench: ModuleType) -> None:
    ref = {"a": torch.tensor([10.0, -20.0]), "b": torch.tensor([0.5])}
    got = {"a": torch.tensor([10.0, -19.0]), "b": torch.tensor([0.5])}
    assert bench.max_rel_diff(got, ref) == pytest.approx(1 / 20)
    assert bench.max_rel_diff(ref, ref) == 0.0
    assert bench.max_rel_diff({"a": ref["a"]}, ref) == float("inf")


def _run(
    bench: ModuleType, resume_s: float, wall_s: float, stages: tuple[int, ...] = (3, 2)
) -> object:
    times = {"resume_s": resume_s, "kill_to_resume_s": resume_s + 0.1, "wall_s": wall_s}
    return bench.Run(**times, resumed_at=8, max_rel_diff=1e-7, parts={}, stages=list(stages))


def test_summary_takes_medians_and_the_ratio_and_the_table_shows_them(bench: ModuleType) -> None:
    recovery = [_run(bench, s, 10.0 + s) for s in (0.5, 0.7, 0.6)]
    restart = [_run(bench, s, 20.0 + s) for s in (9.0, 6.0, 6.6)]
    row = bench.summarize("gpt-mini", recovery, restart)
    assert row["recovery_s"] == 0.6 and row["restart_s"] == 6.6
    assert row["ratio"] == pytest.approx(11.0)
    assert row["recovery_wall_s"] == 10.6 and row["restart_wall_s"] == 26.6
    assert len(row["recovery_runs"]) == 3 and row["restart_runs"][0]["resume_s"] == 9.0
    assert row["stages"] == [[3, 2]]  # 3 agents, then the 2 that survive, in every run
    table = bench.format_table([row]).splitlines()
    assert "restart/recovery" in table[0] and "stages" in table[0] and len(table) == 3
    assert table[2].split() == ["gpt-mini", "3->2", "0.60", "6.60", "11.0x", "10.60", "26.60"]


def test_runs_with_other_plans_show_each_sequence_of_stages(bench: ModuleType) -> None:
    row = bench.summarize("mlp", [_run(bench, 0.5, 10.0)], [_run(bench, 6.0, 20.0, (3, 1))])
    assert row["stages"] == [[3, 2], [3, 1]]
    assert bench.format_table([row]).splitlines()[2].split()[1:4] == ["3->2", "/", "3->1"]
