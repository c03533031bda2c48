"""bench/heterogeneity.py's pure parts: the fleets it builds, its table and its chart."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "heterogeneity.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_heterogeneity", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("span", [3.0, 10.0, 30.0])
def test_fleets_span_exactly_and_geometrically(bench: ModuleType, span: float) -> None:
    devices = bench.fleet_devices(span)
    speeds = [d.gflops for d in devices]
    assert len(devices) == 4 and speeds == sorted(speeds, reverse=True)
    assert speeds[0] / speeds[-1] == pytest.approx(span)
    assert speeds[0] / speeds[1] == pytest.approx(speeds[1] / speeds[2])


def _row(bench: ModuleType, strategy: str, measured: float, predicted: float) -> object:
    stages = [{"device": "dev0", "layers": [0, 9]}]
    return bench.Row("vgg11", "10x", strategy, stages, predicted, predicted, measured, 5,
                     "kernel", [0.2], [0.2])  # fmt: skip


def test_table_gives_ratios_and_comparisons(bench: ModuleType) -> None:
    rows = [_row(bench, "even", 40.0, 50.0), _row(bench, "edgetrain", 120.0, 100.0)]
    text = bench.table(rows)
    assert "| vgg11 | 10x | even | dev0[0:9] | 40.0 | 50.0 | 0.80 |" in text
    assert "| vgg11 | 10x | edgetrain | dev0[0:9] | 120.0 | 100.0 | 1.20 |" in text
    assert "- vgg11, 10x: edgetrain measured = 3.00x even" in text


def test_chart_is_written(bench: ModuleType, tmp_path: Path) -> None:
    rows = [_row(bench, s, 10.0 * (i + 1), 12.0 * (i + 1)) for i, s in enumerate(bench.STRATEGIES)]
    out = tmp_path / "chart.png"
    bench.chart(rows, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
