"""bench/diloco.py's pure parts: its fleet, a task's target, the held-out metric, the
steps to a target on the independent loop, the table (DiLoCo against exact), JSON and
arguments."""

from __future__ import annotations

import dataclasses
import math
from types import ModuleType

import pytest
from support.bench import load_bench
from support.reference import train_reference


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_bench("diloco")


def test_the_fleet_is_four_pis_on_slow_links(bench: ModuleType) -> None:
    pis = bench.fleet_devices()
    assert len({d.id for d in pis}) == 4
    assert {(d.gflops, d.bandwidth_mbps) for d in pis} == {(7.2, 10.0)}


def test_a_target_is_reached_from_its_side(bench: ModuleType) -> None:
    digits, text = bench.TASKS["digits"], bench.TASKS["text"]
    assert digits.reached(0.97) and digits.reached(0.99) and not digits.reached(0.969)
    assert text.reached(2.4) and text.reached(2.0) and not text.reached(2.41)


def test_untrained_weights_score_as_chance(bench: ModuleType) -> None:
    from edge.models.zoo import get_model

    for name, near in (("digits", 0.1), ("text", math.log(128))):
        task = bench.TASKS[name]
        weights = get_model(task.model, **task.model_options).build().state_dict()
        assert bench.evaluate(task, weights) == pytest.approx(near, rel=0.5)


def test_the_steps_to_a_target_are_the_first_kept_step_that_reaches_it(
    bench: ModuleType,
) -> None:
    task = dataclasses.replace(bench.TASKS["digits"], target=0.8)
    run = train_reference(
        task.model,
        steps=48,
        batch_size=task.batch_size,
        optimizer=task.optimizer,
        model_options=task.model_options,
        snapshot_every=8,
    )
    assert sorted(run.snapshots) == [8, 16, 24, 32, 40, 48]
    assert all(run.snapshots[48][k].equal(v) for k, v in run.weights.items())
    points, first = bench.curve(task, run)
    assert [p[0] for p in points] == [8, 16, 24, 32, 40, 48]
    reached = [int(step) for step, value in points if value >= 0.8]
    assert reached, "48 steps of cnn-digits should pass 0.8"
    assert first == reached[0] and points[0][1] < 0.8


def _row(bench: ModuleType, mode: str, steps: int | None, wall: float | None) -> object:
    return bench.Row(
        "digits",
        mode,
        "cnn-digits",
        "accuracy",
        0.97,
        "1[0:4]",
        "m",
        1,
        "1f1b",
        0.1,
        steps,
        [[8.0, 0.5]],
        wall,
        0.98,
        every=8,
        outer_lr=1.0,
    )


def test_the_table_sets_diloco_against_exact(bench: ModuleType) -> None:
    rows = [_row(bench, "exact", 100, 20.0), _row(bench, "diloco", 120, 10.0)]
    text = bench.table(rows)
    assert "| digits | 1.20 | 0.50 |" in text
    assert "diloco (every 8, non-exact)" in text
    again = bench.from_json(bench.to_json(rows))
    assert again == rows and bench.to_json(rows)[1]["step_s"] == pytest.approx(10 / 120)
    missed = bench.table([_row(bench, "exact", 100, 20.0), _row(bench, "diloco", None, None)])
    assert "| digits | - | - |" in missed


def test_arguments(bench: ModuleType) -> None:
    args = bench.parse_args([])
    assert args.tasks == "digits,text" and args.every == 8
    with pytest.raises(SystemExit):
        bench.parse_args(["--tasks", "digits,nope"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--every", "0"])
