"""bench/local_data.py's pure parts: its fleets and their scale, each holder's local data,
every strategy's plan of a local-data job (on profiles as holders announce them), and
its table, JSON and chart."""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from support.bench import load_bench

from coordinator.engine.assignments import microbatch_choices_of
from coordinator.testbed.sizing import emulate
from edge.config import DiLoCo
from edge.models.local_data import announce, register
from edge.models.user_code import CodeAllowance


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_bench("local_data")


def test_fleets_scale_and_local_data(bench: ModuleType) -> None:
    fleet = bench.fleet_devices(4)
    assert [d.id for d in fleet] == [f"holder{i}" for i in range(1, 5)] + ["helper1", "helper2"]
    assert [d.gflops for d in fleet] == [7.2] * 4 + [210.0] * 2
    # The largest fleet gets the cores asked for, every smaller one the same speeds.
    scale = bench.fleet_scale(8, 1.2)
    assert sum(d.cpus for d in emulate(bench.fleet_devices(8), scale)) == pytest.approx(1.2)
    assert emulate(fleet, scale)[0].cpus == emulate(bench.fleet_devices(8), scale)[0].cpus
    assert bench.local_data(2, ["cnn-digits", "vgg11"]) == {
        "holder1": ["digits=digits:shard=1/2", "synthetic-images=synthetic-images:shard=1/2"],
        "holder2": ["digits=digits:shard=2/2", "synthetic-images=synthetic-images:shard=2/2"],
    }


def test_every_strategy_of_a_local_data_job(bench: ModuleType) -> None:
    """Two holders of digits and a helper: the plan keeps the first units on the holders'
    group (shares fixed by their data) and hands the rest to the helper; the holders alone
    are one group of both over every unit; one holder runs every unit alone."""
    args = bench.parse_args(["--quick"])
    spec = bench.job_spec("cnn-digits", args)
    data = bench.local_data(2, ["cnn-digits"])
    devices = [
        announce(d, register(data[d.id], CodeAllowance(()))) if d.id in data else d
        for d in bench.fleet_devices(2, helpers=1)
    ]
    got = bench.candidates(spec, devices)
    assert list(got) == list(bench.STRATEGIES)
    n = 4  # cnn-digits' units
    plan, alone, one = got["plan"], got["holders alone"], got["one holder"]
    helper = got["one helper"]  # lent the data: the job's data central, for this run only
    assert helper.spec.data is None and plan.spec.data is not None
    assert [(st.devices, st.start, st.end) for st in helper.plan.stages] == [(("helper1",), 0, n)]
    assert plan.plan.stages[0].devices == ("holder1", "holder2")
    assert plan.plan.stages[-1].end == n and "helper1" in plan.plan.stages[-1].devices
    assert plan.shares[0] == pytest.approx([0.5, 0.5], abs=0.01)
    assert [(st.devices, st.start, st.end) for st in alone.plan.stages] == [
        (("holder1", "holder2"), 0, n)
    ]
    assert [(st.devices, st.start, st.end) for st in one.plan.stages] == [(("holder1",), 0, n)]
    assert all(c.predicted_sps > 0 for c in got.values())
    # Each runs at the number of microbatches the planner chose for its own plan.
    assert all(c.spec.microbatches in microbatch_choices_of(spec) for c in got.values())
    # The holders alone as federated averaging: the same plan, labelled non-exact, its
    # sum once in AVERAGE_EVERY steps.
    fed = got["holders averaged"]
    assert fed.plan == alone.plan and fed.shares == alone.shares
    assert fed.spec.diloco == DiLoCo(every=bench.AVERAGE_EVERY, outer_lr=1.0, outer_momentum=0.0)
    assert fed.spec.training.startswith("non-exact") and alone.spec.training == "exact"
    assert (
        fed.predicted_anatomy["members"][0]["group_sum"]
        < (alone.predicted_anatomy["members"][0]["group_sum"])
    )


def _row(bench: ModuleType, strategy: str, helpers: int, measured: float, predicted: float) -> Any:
    if strategy == "plan":
        stages = [
            {"layers": [0, 1], "devices": ["holder1", "holder2"], "shares": [0.5, 0.5]},
            {"layers": [1, 4], "devices": ["helper1"], "device": "helper1", "shares": [1.0]},
        ]
    elif strategy.startswith("holders"):
        stages = [{"layers": [0, 4], "devices": ["holder1", "holder2"], "shares": [0.5, 0.5]}]
    else:
        stages = [{"layers": [0, 4], "devices": ["holder1"], "device": "holder1"}]
    sent = {"plan": 2048.0, "holders alone": 4096.0}.get(strategy, 0.0)
    training = "non-exact: DiLoCo" if strategy == "holders averaged" else "exact"
    return bench.Row(
        "cnn-digits",
        2,
        helpers,
        strategy,
        stages,
        predicted,
        measured,
        sent,
        3,
        "scalar",
        training=training,
    )


def test_table_json_and_chart(bench: ModuleType, tmp_path: Path) -> None:
    rows = bench.with_capacity(
        [
            _row(bench, "holders alone", 0, 10.0, 12.5),
            _row(bench, "one holder", 0, 5.0, 5.0),
            _row(bench, "plan", 1, 30.0, 40.0),
            _row(bench, "plan", 2, 9.0, 20.0),
            _row(bench, "one helper", 0, 40.0, 50.0),
            _row(bench, "holders averaged", 0, 12.0, 12.0),
        ]
    )
    # [Note: a fleet's capacity]: what the devices a row may use train alone, summed.
    assert [r.capacity_sps for r in rows] == [10.0, 5.0, 50.0, 90.0, 40.0, 10.0]
    assert [r.fraction for r in rows] == [1.0, 1.0, 0.6, 0.1, 1.0, 1.2]
    assert rows[2].layout == "holders 0-0 → helper1 1-3" and rows[1].layout == "holder1 0-3"
    assert [r.label for r in rows] == [
        "holders alone",
        "one holder",
        "plan, 1 helper",
        "plan, 2 helpers",
        "one helper",
        "holders averaged (non-exact)",
    ]
    text = bench.table(rows)
    assert (
        "| cnn-digits | 2 | 1 | holders 0-0 → helper1 1-3 | 30.0 (40.0) | 10.0 (12.5) | "
        "5.0 (5.0) | 0.75, 0.80, 1.00 | 3.00x | 6.00x | 2.0, 4.0 | 0.60, 1.00 |"
    ) in text
    assert "| cnn-digits | 2 | 2 |" in text and "| 0.90x | 1.80x |" in text
    assert "no faster than the holders alone on: cnn-digits, 2 holders + 2" in text
    every = bench.rows_table(rows)
    assert (
        "| cnn-digits | 2 | one helper | exact | scalar | - | 40.0 | 50.0 | 0.80 | 40.0 | 1.00 |"
        in every
    )
    assert (
        "| cnn-digits | 2 | plan, 2 helpers | exact | scalar | - | 9.0 | 20.0 | 0.45 | 90.0 "
        "| 0.10 |" in every
    )
    assert (
        "holders over one holder, measured: cnn-digits 2 holders: alone 2.00x, averaged 2.40x"
        in text
    )
    out = bench.to_json(rows)
    assert out[2]["ratio"] == 0.75 and out[2]["label"] == "plan, 1 helper"
    assert out[2]["capacity_sps"] == 50.0 and out[2]["fraction"] == 0.6
    assert bench.to_json(bench.from_json(out)) == out
    bench.chart(rows, tmp_path / "chart.png")
    assert (tmp_path / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_quick_mode_is_one_small_fleet(bench: ModuleType) -> None:
    args = bench.parse_args(["--quick"])
    assert (args.holder_counts, args.helper_counts, args.models) == ([2], [1], "cnn-digits")
    assert args.warmup + args.max_steps == 2
    assert args.results == Path(tempfile.gettempdir()) / "local_data-quick.json"
    full = bench.parse_args([])
    assert (full.holder_counts, full.helper_counts) == ([2, 4, 8], [1, 2])
    assert full.models == "cnn-digits,vgg11" and full.results.parent.name == "results"
    with pytest.raises(SystemExit):
        bench.parse_args(["--helpers", "3"])
