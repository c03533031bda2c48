"""bench/hybrid.py's pure parts: its fleets, the catalogue scale, every strategy's plan
(on vgg11 over four catalogue Pis, where the version 2 plan is the group of four,
unless the measured unit times predict that its members' small rows lose), the
ideal bound, its table (a row that shares another's run says so), JSON and chart, and
its arguments."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from support.bench import load_bench

from coordinator.engine.engine import group_limits
from coordinator.engine.spec import JobSpec
from coordinator.planner.build import build_problem
from coordinator.planner.predict import UnitSeconds, predict
from coordinator.planner.score import Plan, score_plan
from coordinator.planner.simulator import fastest_schedule


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_bench("hybrid")


def test_fleets(bench: ModuleType) -> None:
    pis = bench.fleet_devices("rpi4")
    assert [d.gflops for d in pis] == [7.2] * 4 and len({d.id for d in pis}) == 4
    mixed = bench.fleet_devices("2fast4slow")
    fast = bench.hetero.FASTEST_GFLOPS
    assert [d.gflops for d in mixed] == [fast] * 2 + [fast / 10] * 4
    assert len({d.id for d in mixed}) == 6
    for span in (3, 10, 30):
        assert bench.fleet_devices(f"{span}x") == bench.hetero.fleet_devices(float(span))
    assert bench.catalogue_scale(72.0) == pytest.approx(0.1)  # 7.2 GFLOP/s of a 72 core
    with pytest.raises(SystemExit, match="unknown fleet 'nope'"):
        bench.fleet_devices("nope")


def test_every_strategy_on_four_pis(bench: ModuleType) -> None:
    """vgg11 on four equal slow devices: the version 2 plan is the group of all four
    (data parallel), which the score puts at 1.3x or more of version 1's pipeline."""
    devices = bench.fleet_devices("rpi4")
    problem = build_problem("vgg11", devices, batch_size=32, microbatches=4, version=2)
    limits = group_limits(JobSpec(model="vgg11", steps=1, batch_size=32, microbatches=4))
    assert limits is not None
    got = bench.plans(problem, limits)
    assert list(got) == list(bench.STRATEGIES)
    shapes = {k: [len(st.devices) for st in plan.stages] for k, plan in got.items()}
    assert shapes["single"] == [1] and shapes["data-parallel"] == [4] and shapes["v2"] == [4]
    assert all(n == 1 for n in shapes["v1"] + shapes["even"])
    v1, v2 = (score_plan(problem, got[k]).throughput_sps for k in ("v1", "v2"))
    assert v2 >= 1.3 * v1
    flops = sum(u.train_flops for u in problem.layers)
    assert bench.ideal_sps(problem) == pytest.approx(4 * 7.2e9 / flops)
    assert score_plan(problem, got["v2"]).throughput_sps < bench.ideal_sps(problem)


def test_the_v2_row_is_the_plan_the_prediction_picks(bench: ModuleType) -> None:
    """With unit seconds worth the FLOPs, the group of four stays; when none of a unit's
    time shrinks with the rows (each member takes the whole microbatch's time), the
    prediction says the group loses and the v2 row is a pipeline of one-device stages."""
    devices = bench.fleet_devices("rpi4")
    problem = build_problem("vgg11", devices, batch_size=32, microbatches=4, version=2)
    limits = group_limits(JobSpec(model="vgg11", steps=1, batch_size=32, microbatches=4))
    assert limits is not None
    seconds = tuple(u.train_flops * 8 / 7.2e9 for u in problem.layers)  # 8 rows, one Pi
    worth = UnitSeconds(seconds, 7.2)
    assert [len(st.devices) for st in bench.plans(problem, limits, worth)["v2"].stages] == [4]
    flat = UnitSeconds(seconds, 7.2, fixed=seconds)
    got = bench.plans(problem, limits, flat)
    assert not got["v2"].grouped and got["data-parallel"].grouped
    guess = {k: predict(problem, got[k], flat).step_time_s for k in ("v2", "data-parallel")}
    assert guess["v2"] < guess["data-parallel"]


def _row(bench: ModuleType, strategy: str, measured: float, predicted: float, shape: str) -> Any:
    stages = [{"devices": [f"d{i}"] * int(n), "layers": [0, 9]} for i, n in enumerate(shape)]
    times = [[0.5] * len(shape), [0.4] * len(shape), [0.0] * len(shape), [0.0] * len(shape)]
    fleet, ideal = "rpi4-4gb:4", 40.0
    return bench.Row(
        "vgg11",
        fleet,
        strategy,
        stages,
        predicted,
        measured,
        ideal,
        5,
        "kernel",
        *times,
        batch="64x4",
    )


def test_table_json_and_chart(bench: ModuleType, tmp_path: Path) -> None:
    rows = [
        _row(bench, "single", 5.0, 8.0, "1"),
        _row(bench, "v1", 10.0, 16.0, "1111"),
        _row(bench, "data-parallel", 20.0, 25.0, "4"),
        _row(bench, "v2", 20.0, 25.0, "4"),
    ]
    text = bench.table(rows)
    assert (
        "| vgg11 | rpi4-4gb:4 | 64x4 | host | v1 | 1+1+1+1 | 1f1b | 10.0 | 16.0 | 0.62 | 40.0 "
        "| 25% | 40% |" in text
    )
    assert (
        "| vgg11 | rpi4-4gb:4 | 64x4 | host | v2 | 4 | 1f1b | 20.0 | 25.0 | 0.80 | 40.0 | 50% "
        "| 62% |" in text
    )
    assert "- vgg11, rpi4-4gb:4: v2 (4) = 2.00x v1 measured, 1.56x predicted" in text
    out = bench.to_json(rows)
    assert out[1]["ratio"] == 0.625 and out[1]["fraction"] == 0.25 and out[1]["shape"] == "1+1+1+1"
    assert bench.to_json(bench.from_json(out)) == out
    bench.chart(rows, tmp_path / "chart.png")
    assert (tmp_path / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_quick_mode_is_one_fleet_one_model_few_steps(bench: ModuleType) -> None:
    args = bench.parse_args(["--quick"])
    assert (args.fleets, args.models) == ("rpi4", "vgg11")
    assert args.warmup + args.max_steps == 2 and args.batch_size == 16
    assert args.results == Path(tempfile.gettempdir()) / "hybrid-quick.json"
    assert args.anatomy == Path(tempfile.gettempdir()) / "anatomy-quick.json"
    full = bench.parse_args([])
    assert full.results.parent.name == "results" and full.fleets.split(",") == list(bench.FLEETS)
    assert (full.anatomy.name, full.anatomy_chart.name) == ("anatomy.json", "anatomy.png")


def test_a_plan_run_once_shows_in_both_rows(bench: ModuleType) -> None:
    """v2's plan is v1's stage for stage: one run, whose row v2 shares (``same_as``)."""
    v1 = _row(bench, "v1", 10.0, 16.0, "1111")
    v2 = dataclasses.replace(v1, strategy="v2", same_as="v1")
    text = bench.table([v1, v2])
    row = "| vgg11 | rpi4-4gb:4 | 64x4 | host | v2 (= v1) | 1+1+1+1 | 1f1b | 10.0 | 16.0 | 0.62 |"
    assert row in text
    assert "- vgg11, rpi4-4gb:4: v2 (1+1+1+1) (v1's plan: one run) = 1.00x v1 measured" in text
    out = bench.to_json([v1, v2])
    assert out[0]["same_as"] is None and out[1]["same_as"] == "v1"
    assert bench.to_json(bench.from_json(out)) == out


def test_predict_shapes_are_batch_by_microbatches(bench: ModuleType) -> None:
    args = bench.parse_args(["--predict-shapes", "32x4,128x16,64xauto"])
    assert args.predict_shapes == [(32, 4), (128, 16), (64, "auto")]
    assert args.results.name == "hybrid-shapes.json"
    for bad in ("128", "30x4", "axb", "64xAuto", "0xauto"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--predict-shapes", bad])


def test_repeated_passes_give_each_strategy_its_median_pass(bench: ModuleType) -> None:
    """``--repeat 3``: each row is its strategy's median pass by measured samples/s, with
    every pass's figures; the table gives v2/v1 pass by pass."""
    measured = {"v1": (10.0, 12.0, 8.0), "v2": (15.0, 13.0, 16.0)}
    passes = [
        [_row(bench, s, measured[s][n], 20.0 + n, "1111" if s == "v1" else "4") for s in measured]
        for n in range(3)
    ]
    v1, v2 = bench.median_rows(passes)
    assert (v1.measured_sps, v1.predicted_sps) == (10.0, 20.0)  # pass 1 of 8, 10, 12
    assert (v2.measured_sps, v2.predicted_sps) == (15.0, 20.0)  # pass 1 of 13, 15, 16
    assert v2.repeats == [[15.0, 20.0], [13.0, 21.0], [16.0, 22.0]]
    text = bench.table([v1, v2])
    assert (
        "v2 (4) = 1.50x v1 measured (passes: 1.50x, 1.08x, 2.00x), "
        "1.00x predicted (passes: 1.00x, 1.00x, 1.00x)"
    ) in text
    assert bench.to_json(bench.from_json(bench.to_json([v1, v2]))) == bench.to_json([v1, v2])
    assert bench.median_rows(passes[:1]) == passes[0]  # one pass: its rows as they are
    assert bench.median_rows(passes[:2])[0].measured_sps == 10.0  # the lower middle of two
    with pytest.raises(SystemExit):
        bench.parse_args(["--repeat", "0"])


def test_a_run_is_priced_by_the_mean_of_the_timings_before_and_after_it(
    bench: ModuleType,
) -> None:
    before = {"a": UnitSeconds((1.0, 3.0), 5.0, (0.2, 0.4)), "b": UnitSeconds((2.0,), 5.0)}
    after = {"a": UnitSeconds((2.0, 1.0), 6.0, (0.4, 0.0)), "c": UnitSeconds((4.0,), 5.0)}
    got = bench.mean_own(before, after)
    assert got["a"].seconds == (1.5, 2.0) and got["a"].gflops == 6.0
    assert got["a"].fixed == pytest.approx((0.3, 0.2), rel=1e-12)
    assert got["b"] == before["b"] and got["c"] == after["c"]  # timed once: that timing
    assert bench.parse_args([]).unit_times == "devices"


def test_each_plan_runs_the_schedule_a_job_would(bench: ModuleType) -> None:
    """``--schedule auto`` takes what a job's ``"auto"`` takes; a named one is that one."""
    devices = bench.parse_fleet("rpi4-4gb:3")
    problem = build_problem("mlp", devices, batch_size=64, microbatches=4)
    plan = Plan.of(*((d.id, s, s + 1) for s, d in enumerate(devices)))
    assert bench._schedule("auto", problem, plan) == fastest_schedule(problem, plan)[0] == "zb-h1"
    assert bench._schedule("gpipe", problem, plan) == "gpipe"
    assert bench.parse_args([]).schedule == "auto"


def test_auto_microbatches_are_the_engines(bench: ModuleType) -> None:
    """``--microbatches auto``: v2 is the plan and number of microbatches the engine gives
    a job of ``"auto"`` over the same devices, and every fixed plan runs at a number
    the batch splits into, its prediction there no slower than at the calibrated one."""
    from coordinator.engine.assignments import microbatch_choices_of
    from coordinator.engine.engine import plan_over
    from coordinator.planner.partition import scored

    devices = bench.fleet_devices("3x")
    spec = JobSpec(model="resnet18", steps=1, batch_size=64, microbatches=4)
    problem = build_problem("resnet18", devices, batch_size=64, microbatches=4, version=2)
    limits = group_limits(spec)
    chosen = {s: bench.Shaped(p, 4) for s, p in bench.plans(problem, limits).items()}
    choices = microbatch_choices_of(spec)
    got = bench.auto_microbatches(problem, limits, None, chosen, choices)
    assert set(got) == set(chosen)
    job = plan_over(spec.model_copy(update={"microbatches": "auto"}), devices)
    assert got["v2"].plan.stages == job.plan.stages
    assert got["v2"].microbatches == job.problem.microbatches
    assert any(s.microbatches != 4 for s in got.values()), "auto moved no strategy"
    for strategy in ("single", "even", "data-parallel"):
        shaped = got[strategy]
        assert shaped.plan == chosen[strategy].plan and shaped.microbatches in choices
        at = problem.model_copy(update={"microbatches": shaped.microbatches})
        assert (
            scored(at, shaped.plan, None)[1].step_time_s
            <= scored(problem, shaped.plan, None)[1].step_time_s
        )
