"""``edgetrain demo --exit --json``: the whole product on embedded defaults.

Three emulated Pi 4s hold a third of the data each, labels too, and a laptop helps;
the job is on that local data, planned by the planner alone. The test asserts the
plan's shape (a U: the holders are the first stage and the last, the laptop runs the
middle), that no labels cross, the accuracy, that the run measured both the plan and
the holders alone, the bytes it reports beside federated averaging's formula, and
what the links cost (their share of the step, and the job on other rates);
the speedup and the prediction's error are figures, which ``bench/cost_model.py``
and the README report. What crosses the wire, frame by frame: test_demo_wire.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.markers import NO_MOSQUITTO
from support.mosquitto import find_mosquitto

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.broker
# Serial: the ladder's choices rest on the units the agents time on this host; beside
# another worker's load their timing slowed and the split still paid at 1 Mbit/s.
@pytest.mark.serial
@pytest.mark.skipif(find_mosquitto() is None, reason=NO_MOSQUITTO)
def test_demo_trains_digits_to_90_percent_through_the_api() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "edgetrain.cli", "demo", "--exit", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["labels_local"] is True
    assert out["accuracy"] >= 0.90
    assert out["samples_per_s"] > 0 and out["holders_alone_samples_per_s"] > 0
    assert out["speedup_vs_holders_alone"] == (
        out["samples_per_s"] / out["holders_alone_samples_per_s"]
    )
    assert out["predicted_samples_per_s"] == out["plan"]["throughput_sps"] > 0
    assert out["measured_over_predicted"] == out["samples_per_s"] / out["predicted_samples_per_s"]
    assert out["plan"]["feasible"] is True
    stages = out["plan"]["stages"]
    holders = stages[0]["devices"]
    assert len(holders) == 3 and len(stages) >= 3, stages  # the laptop takes work
    assert out["plan"]["u_shaped"] is True and stages[-1]["devices"] == holders
    assert stages[0]["layers"][0] == 0 and stages[-1]["layers"][1] == 4
    crossing = out["plan"]["egress"][0]
    assert crossing["from"] == holders and crossing["what"].startswith("activations after unit")
    assert not any(row["what"] == "labels" for row in out["plan"]["egress"])
    samples = 200 * 48  # the demo's steps and batch
    assert out["bytes_per_sample"] > 0
    assert out["bytes_to_finish"] == pytest.approx(out["bytes_per_sample"] * samples, rel=1e-12)
    fedavg = out["fedavg"]
    assert (fedavg["clients"], fedavg["samples_per_round"]) == (3, 1437)
    assert out["fedavg_bytes_per_sample"] == 2 * fedavg["model_bytes"] * 3 / 1437
    # What the links cost: a share of the step, predicted and measured, and the job on
    # the coordinator's ladder of rates, with the rate where the split stops paying.
    assert 0 < out["link_share_predicted"] < 1 and 0 < out["link_share_measured"] < 1
    ladder = out["link_ladder"]
    assert [rung["mbps"] for rung in ladder] == [1000, 300, 100, 30, 10, 3, 1]
    assert ladder[0]["split"] is True and ladder[-1]["split"] is False
    # The bisected rate lies where the ladder first stops splitting, from the top (the
    # model's rungs between need not be monotone: a split and the holders alone can be
    # predicted close there).
    below = out["split_stops_paying_below_mbps"]
    first = next(i for i, rung in enumerate(ladder) if not rung["split"])
    assert ladder[first]["mbps"] < below <= ladder[first - 1]["mbps"]
    # The order the issue asks for: plan, accuracy, both rates, speedup, error, dashboard.
    text = done.stderr
    marks = ["what crosses", "test accuracy", "on the holders", "speedup", "measured/predicted"]
    marks += ["on the wire:", "on the links", "the same job on other links", "stops paying"]
    at = [text.index(mark) for mark in marks]
    assert at == sorted(at) and text.index("dashboard: http://") > at[-1]
    assert "coordinator: http://127.0.0.1:" in done.stderr
    assert "API token" in done.stderr
