"""bench/anatomy.py: the fleet's step in parts for each bench row, its table, JSON and chart.

A row carries a plan's predicted anatomy and a measured one; the summary sums each
over the members into fractions of the fleet's device-seconds, names the measured
largest loss, and says how far the worst member's parts stray from the measured step.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from support.bench import load_bench

from coordinator.planner.anatomy import PARTS, Anatomy, MemberAnatomy


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_bench("anatomy")


def _anatomy(step: float, *members: dict[str, float]) -> dict[str, Any]:
    rows = [
        MemberAnatomy(stage=i, device=f"d{i}", **dict.fromkeys(PARTS, 0.0) | m)
        for i, m in enumerate(members)
    ]
    return Anatomy(step_time_s=step, members=rows).to_json()


def _row(measured: dict[str, Any] | None) -> dict[str, Any]:
    predicted = _anatomy(1.0, {"compute": 0.8, "bubble": 0.2}, {"compute": 0.6, "link": 0.4})
    return {
        "model": "vgg11",
        "fleet": "rpi4-4gb:4",
        "strategy": "v2",
        "shape": "1+1",
        "anatomy": predicted,
        "measured_anatomy": measured,
    }


MEASURED = _anatomy(
    2.0,
    {"compute": 1.0, "imbalance": 0.9, "fixed": 0.1},
    {"compute": 0.5, "link": 1.4, "fixed": 0.2},  # 2.1 s: 5% over the step
)


def test_the_summary_sums_the_members_into_the_fleets_parts(bench: ModuleType) -> None:
    (got,) = bench.summary([_row(MEASURED), _row(None)])  # a row without one is left out
    assert got["measured"] == pytest.approx(
        {
            "compute": 1.5 / 4.1,
            "fixed": 0.3 / 4.1,
            "bubble": 0.0,
            "imbalance": 0.9 / 4.1,
            "link": 1.4 / 4.1,
            "group_sum": 0.0,
        }
    )
    assert got["predicted"] == pytest.approx(
        {
            "compute": 0.7,
            "fixed": 0.0,
            "bubble": 0.1,
            "imbalance": 0.0,
            "link": 0.2,
            "group_sum": 0.0,
        }
    )
    assert got["largest_loss"] == "link"
    assert got["measured_over_predicted"] == pytest.approx(2.0)
    assert got["adds_up"] == pytest.approx(0.05)
    line = bench.table([got]).splitlines()[2]
    assert line.startswith("| vgg11 | rpi4-4gb:4 | v2 | 1+1 | 37% (70%) | 7% (0%) | 0% (10%) ")
    assert line.endswith("| link | 2.00 | 5.0% |")


def test_it_writes_the_json_and_the_chart_and_renders_a_results_file(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "hybrid.json"
    source.write_text(json.dumps([_row(MEASURED)]))
    out, png = tmp_path / "anatomy.json", tmp_path / "anatomy.png"
    assert bench.main(["--from", str(source), "--results", str(out), "--chart", str(png)]) == 0
    assert json.loads(out.read_text()) == bench.summary([_row(MEASURED)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| link | 2.00 | 5.0% |" in capsys.readouterr().out
    source.write_text(json.dumps([_row(None)]))
    assert bench.main(["--from", str(source), "--results", str(out), "--chart", str(png)]) == 1
    assert "no row carries both anatomies" in capsys.readouterr().out


def test_spec_mode_splits_each_cells_plan_by_the_spec_score(bench: ModuleType) -> None:
    """vgg11 on four catalogue Pis: the version 2 plan is the group of four, whose only loss
    by the spec's score is its sum of gradients; 2 fast + 4 slow: a pipeline, whose largest
    loss is its bubble."""
    pis, mixed = bench.spec_anatomies(64, 4, fleets=("rpi4", "2fast4slow"), models=("vgg11",))
    assert (pis["fleet"], pis["shape"], pis["largest_loss"]) == ("rpi4-4gb:4", "4", "group_sum")
    assert pis["parts"]["compute"] + pis["parts"]["group_sum"] == pytest.approx(1.0)
    assert pis["predicted_of_ideal"] == pytest.approx(pis["parts"]["compute"])  # equal Pis
    assert len(mixed["shape"].split("+")) > 1 and mixed["largest_loss"] == "bubble"
    assert sum(mixed["parts"].values()) == pytest.approx(1.0)
    assert "| rpi4-4gb:4 | vgg11 | 4 | 0.81 |" in bench.spec_table([pis])
