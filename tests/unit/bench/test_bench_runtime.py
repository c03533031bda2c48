"""bench/runtime.py's pure parts: the plan it runs and the table it prints."""

from __future__ import annotations

from types import ModuleType

import pytest
from support.bench import load_bench


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_bench("runtime")


def test_the_plan_is_the_whole_model_on_one_device(bench: ModuleType) -> None:
    plan = bench.one_stage_plan("cnn-digits")
    assert [(st.device, st.start, st.end) for st in plan.stages] == [("local", 0, 4)]


def test_the_table_gives_each_row_its_stages(bench: ModuleType) -> None:
    row = {"model": "mlp", "batch_size": 64, "steps": 150, "stages": 1}
    row |= {"plain_sps": 2000.0, "edgetrain_sps": 1960.0, "ratio": 0.98}
    lines = bench.format_table([row], threads=2, rounds=3).splitlines()
    assert lines[0].startswith("one-stage edgetrain vs plain PyTorch loop (2 threads, median of 3")
    assert lines[1].split()[:4] == ["model", "batch", "steps", "stages"]
    assert lines[2].split() == ["mlp", "64", "150", "1", "2000.0", "1960.0", "0.980"]
