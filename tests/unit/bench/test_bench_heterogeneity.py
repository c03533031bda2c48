"""bench/heterogeneity.py's pure parts: the fleets it builds, its table, JSON and chart,
and the marks on plans that two strategies share (a single device)."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from support.bench import load_bench
from support.paths import ROOT

RESULTS = ROOT / "bench" / "results" / "heterogeneity.json"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_bench("heterogeneity")


@pytest.mark.parametrize("span", [3.0, 10.0, 30.0])
def test_fleets_span_exactly_and_geometrically(bench: ModuleType, span: float) -> None:
    devices = bench.fleet_devices(span)
    speeds = [d.gflops for d in devices]
    assert len(devices) == 4 and speeds == sorted(speeds, reverse=True)
    assert speeds[0] / speeds[-1] == pytest.approx(span)
    assert speeds[0] / speeds[1] == pytest.approx(speeds[1] / speeds[2])


def _row(
    bench: ModuleType, strategy: str, measured: float, predicted: float, cuts: str = "dev0:0:9"
) -> object:
    stages = []
    for cut in cuts.split(","):
        device, start, end = cut.split(":")
        stages.append({"device": device, "layers": [int(start), int(end)]})
    compute = [0.2] * len(stages)
    sps = {"predicted_sps": predicted, "simulated_sps": predicted, "measured_sps": measured}
    times = {"compute_s": compute, "predicted_compute_s": compute}
    return bench.Row("vgg11", "10x", strategy, stages, **sps, steps=5, method="kernel", **times)


TWO = "dev0:0:5,dev1:5:9"


def test_table_gives_stages_ratios_and_comparisons(bench: ModuleType) -> None:
    rows = [
        _row(bench, "single", 100.0, 100.0),
        _row(bench, "even", 40.0, 50.0, "dev0:0:3,dev1:3:5,dev2:5:7,dev3:7:9"),
        _row(bench, "edgetrain", 120.0, 100.0, TWO),
    ]
    text = bench.table(rows)
    assert "| vgg11 | 10x | single | 1 | dev0[0:9] | 100.0 | 100.0 | 1.00 |" in text
    assert "| vgg11 | 10x | even | 4 | dev0[0:3] dev1[3:5] dev2[5:7] dev3[7:9] | 40.0 |" in text
    assert "| vgg11 | 10x | edgetrain | 2 | dev0[0:5] dev1[5:9] | 120.0 | 100.0 | 1.20 |" in text
    assert "- vgg11, 10x: edgetrain (2 stages) measured = 1.20x single, 3.00x even" in text
    assert "same plan" not in text


def test_a_single_device_plan_is_marked_wherever_it_is_reported(
    bench: ModuleType, tmp_path: Path
) -> None:
    rows = [
        _row(bench, "single", 100.0, 100.0),
        _row(bench, "ftpipehd", 50.0, 60.0, TWO),
        _row(bench, "edgetrain", 97.0, 100.0),  # edgetrain's plan is the single device
    ]
    text = bench.table(rows)
    assert "| vgg11 | 10x | edgetrain (= single) | 1 | dev0[0:9] | 97.0 |" in text
    assert "| vgg11 | 10x | single (= edgetrain) | 1 | dev0[0:9] | 100.0 |" in text
    assert (
        "- vgg11, 10x: edgetrain (1 stage: dev0 alone) measured = "
        "0.97x single (the same plan, run twice), 1.94x ftpipehd"
    ) in text
    out = bench.to_json(rows)
    marks = [(r["strategy"], r["n_stages"], r["same_plan_as"]) for r in out]
    assert marks == [
        ("single", 1, ["edgetrain"]),
        ("ftpipehd", 2, []),
        ("edgetrain", 1, ["single"]),
    ]
    # The same device but other units, or another fleet, is another plan.
    other = _row(bench, "edgetrain", 97.0, 100.0, "dev0:0:8")
    assert bench.same_plan_as([rows[0], other], other) == []
    # A codec on a link does not make a plan another one.
    coded = _row(bench, "edgetrain", 97.0, 100.0, TWO)
    coded.stages[0]["codec_out"] = "fp16"
    assert bench.same_plan_as([rows[1], coded], coded) == ["ftpipehd"]
    bench.chart(rows, tmp_path / "chart.png")  # the hatched bar and its legend entry draw


def test_json_rows_render_again(bench: ModuleType) -> None:
    rows = [_row(bench, "single", 100.0, 100.0), _row(bench, "edgetrain", 97.0, 100.0)]
    out = bench.to_json(rows)
    assert bench.to_json(bench.from_json(out)) == out
    old = [{k: v for k, v in r.items() if k not in ("n_stages", "same_plan_as")} for r in out]
    assert bench.to_json(bench.from_json(old)) == out  # a file written before the marks


def test_the_saved_results_carry_their_marks(bench: ModuleType) -> None:
    saved = json.loads(RESULTS.read_text())
    assert bench.to_json(bench.from_json(saved)) == saved
    edgetrain = [r for r in saved if r["strategy"] == "edgetrain"]
    marked = [(r["model"], r["fleet"]) for r in edgetrain if r["same_plan_as"] == ["single"]]
    assert marked == [
        ("gpt-mini", "30x"),
        ("vgg11", "10x, cut link"),
        ("gpt-mini", "10x, cut link"),
    ]


def test_chart_is_written(bench: ModuleType, tmp_path: Path) -> None:
    rows = [_row(bench, s, 10.0 * (i + 1), 12.0 * (i + 1)) for i, s in enumerate(bench.STRATEGIES)]
    out = tmp_path / "chart.png"
    bench.chart(rows, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
