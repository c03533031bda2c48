"""bench/planner.py's pure parts: what it records of each plan and the tables it prints."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
from support.bench import load_bench

from coordinator.planner.build import build_problem, parse_fleet


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_bench("planner")


def test_a_plan_of_one_device_is_recorded_as_the_single_baseline(bench: ModuleType) -> None:
    # A laptop beside a Raspberry Pi trains a small MLP fastest alone.
    problem = build_problem("mlp", parse_fleet("rpi4-4gb,laptop"), batch_size=16, microbatches=2)
    row = bench.evaluate(problem)
    assert row["stages"] == 1 and row["same_plan_as"][:1] == ["single"]
    base = row["baselines"]
    assert base["single"]["stages"] == 1 and base["even"]["stages"] == 2
    assert "even" not in row["same_plan_as"]
    # Version 2 on the same devices: never slower than version 1's plan.
    assert row["v2_sps"] >= row["edgetrain_sps"] * (1 - 1e-12) and row["v2_groups"]


def _row(
    edgetrain: tuple[float, int],
    same: list[str],
    v2: tuple[float, list[int], float | None] = (0.0, [], None),
    **base: tuple[float, int, bool],
) -> Any:
    baselines = {
        name: {"sps": sps, "step_s": 64 / sps, "stages": n, "feasible": ok}
        for name, (sps, n, ok) in base.items()
    }
    sps, stages = edgetrain
    figures = {"devices": 4, "units": 9, "exact": True, "method": "exact", "plan_wall_s": 0.04}
    return figures | {
        "edgetrain_sps": sps,
        "edgetrain_step_s": 64 / sps,
        "stages": stages,
        "same_plan_as": same,
        "lower_bound_step_s": 0.01,
        "baselines": baselines,
        "v2_sps": v2[0] or None,
        "v2_groups": v2[1],
        "v2_wall_s": 0.5,
        "data_parallel_sps": v2[2],
    }


def test_tables_give_every_plan_its_stages_and_mark_a_shared_plan(bench: ModuleType) -> None:
    four = {"even": (57.6, 4, True), "pipedream": (30.2, 4, True), "ftpipehd": (578.4, 4, True)}
    large = _row((320.0, 3), [], (400.0, [2, 1], None), single=(12.0, 1, False), **four)
    out = {
        "scenarios": {
            "edge-mix": _row(
                (1642.8, 1), ["single"], (1642.8, [1], 1642.8), single=(1642.8, 1, True), **four
            ),
            "split": _row((99.5, 4), [], (150.0, [2, 2], None), single=(53.9, 1, False), **four),
        },
        "large": [{**large, "seed": 0}],
    }
    lines = bench.format_tables(out).splitlines()
    assert lines[0].endswith("[stages of the plan]")
    assert lines[2] == (
        "edge-mix | 4 | 9 | 1,642.8 [1] (= single) | 1,642.8 [1] | 57.6 [4] | 30.2 [4] | "
        "578.4 [4] | 0.04 | yes | 1,642.8 [1] | 1.00x | 1,642.8"
    )
    assert lines[3].startswith("split | 4 | 9 | 99.5 [4] | (53.9 [1]) infeasible | 57.6 [4]")
    assert lines[3].endswith("| 150.0 [2+2] | 1.51x | -")
    assert "| stages |" in lines[6]
    assert lines[7] == "0 | 0.04 | exact | 0.2000 | 3 | 0.0100 | 0.1107 [4] | 0.50 | 1.25x"
