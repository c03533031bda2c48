"""bench/gpu.py on the CPU at its smallest: the stage split, the report's shape, MFU's arithmetic.

No timing is asserted; only that every figure is derived as the bench says.
"""

from __future__ import annotations

from types import ModuleType

import pytest
from support.bench import load_bench

from edge.profiling.matmul import tflops_rate

TINY = {"vocab_size": 32, "block_size": 8, "d_model": 16, "n_head": 2, "n_layer": 3}


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_bench("gpu")


def test_stages_split_blocks_evenly_with_embed_first_and_head_last(bench: ModuleType) -> None:
    # units: 0 embed, 1..24 blocks, 25 head
    assert bench.stage_ranges(24, 4) == [(0, 7), (7, 13), (13, 19), (19, 26)]
    assert bench.stage_ranges(3, 2) == [(0, 3), (3, 5)]  # the extra block goes first
    assert bench.stage_ranges(3, 1) == [(0, 5)]
    with pytest.raises(ValueError, match="stages"):
        bench.stage_ranges(3, 4)


def test_one_profiled_block_stands_for_every_block(bench: ModuleType) -> None:
    import torch

    from edge.models.unit_costs import profile_model
    from edge.models.zoo import get_model

    flops = bench.unit_train_flops(TINY, torch.device("cpu"))
    full = profile_model(get_model("gpt-mini", **TINY), 1, timing=False)
    assert flops == [(u.fwd_flops, u.bwd_flops) for u in full.units]


def test_the_smallest_run_reports_every_stage_and_mfu_exactly(bench: ModuleType) -> None:
    config = bench.BenchConfig(
        device="cpu",
        options=dict(TINY),
        stages=2,
        microbatches=(1, 2),
        warmup=1,
        rounds=1,
        round_s=0.001,
        peak_seconds=0.01,
    )
    result = bench.run_bench(config)
    assert result["device"] == "cpu" and result["cpu_figures"] is True
    assert result["precision"] == "fp32" and result["peak_tflops"] > 0
    stages = result["stages"]
    assert [st["units"] for st in stages] == [[0, 3], [3, 5]]
    assert [(st["first_unit"], st["last_unit"], st["blocks"]) for st in stages] == [
        ("embed", "block1", 2),
        ("block2", "head", 1),
    ]
    assert result["model"]["params"] == sum(st["params"] for st in stages)
    rows = result["rows"]
    assert [(r["stage"], r["microbatch"]) for r in rows] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    for r in rows:
        st = stages[r["stage"]]
        assert st["flops_per_sample"] == st["fwd_flops_per_sample"] + st["bwd_flops_per_sample"]
        assert r["tokens"] == r["microbatch"] * TINY["block_size"]
        assert r["samples_per_s"] == r["microbatch"] / r["seconds"]
        assert r["tokens_per_s"] == r["tokens"] / r["seconds"]
        assert r["achieved_tflops"] == tflops_rate(
            st["flops_per_sample"] * r["microbatch"], r["seconds"]
        )
        assert r["mfu"] == r["achieved_tflops"] / result["peak_tflops"]
        assert r["peak_memory_bytes"] is None and r["iterations"] >= 1
    big = result["largest_stage"]
    assert big["stage"] == max(stages, key=lambda st: st["flops_per_sample"])["stage"]
    assert big["mfu"] == max(r["mfu"] for r in rows if r["stage"] == big["stage"])
    assert big["meets_target"] is None  # the target is an H200's, not a CPU's
    table = bench.format_table(result)
    assert "CPU figures" in table and "largest stage" in table
    assert "2 stages, each alone on cpu" in table.splitlines()[0]  # the split it times
