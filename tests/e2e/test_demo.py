"""``edgetrain demo --exit --json``: the whole product on embedded defaults.

The demo's job is planned by the planner alone (no ``stages``); on the default
fleet its best plan is one stage on a group of two devices, data-parallel
(``edgetrain.cli.demo.MODEL_OPTIONS`` says why), which the test asserts.
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
    assert out["accuracy"] >= 0.90
    assert out["samples_per_s"] > 0 and out["single_device_samples_per_s"] > 0
    # The job's prediction and how the measurement compares (bench/cost_model.py judges it).
    assert out["predicted_samples_per_s"] == out["plan"]["throughput_sps"] > 0
    assert out["measured_over_predicted"] == out["samples_per_s"] / out["predicted_samples_per_s"]
    assert out["plan"]["feasible"] is True
    stages = out["plan"]["stages"]
    assert [st["layers"] for st in stages] == [[0, 4]], stages
    assert len(set(stages[0]["devices"])) == 2 and len(stages[0]["shares"]) == 2, stages
    assert "coordinator: http://127.0.0.1:" in done.stderr
    assert "API token" in done.stderr
