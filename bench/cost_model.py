"""Does the planner predict what it measures? Predicted vs measured step time per zoo model.

For every zoo model, a short job on the local testbed: ``--agents`` real
``edgetrain agent`` processes on this machine (each measures its own profile,
fixed costs included), a broker, and the job engine, as ``edgetrain train
--transport mqtt`` runs them. The prediction is the job's
(:func:`coordinator.planner.predict.predict`); the measured step time is the
median gap between the ends of consecutive steps, after ``--warmup`` steps. With
``--demo`` it also runs ``edgetrain demo --exit --json`` and reports its job's
measured/predicted samples/s. The target is a ratio within 0.8-1.2 everywhere.

    .venv/bin/python bench/cost_model.py [--models cnn-digits,mlp] [--demo] [--json]

Results go to ``bench/results/cost_model.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout: its packages, not an install's
    sys.path.insert(0, str(ROOT))

from coordinator.engine.spec import JobSpec  # noqa: E402
from coordinator.local.options import LocalTraining  # noqa: E402
from coordinator.local.train import train_on_local_fleet  # noqa: E402
from edge.models.zoo import list_models  # noqa: E402
from edgetrain.cli.signals import exit_on_sigterm  # noqa: E402

TARGET = (0.8, 1.2)
STEPS = {"vgg11": 8, "resnet18": 6, "mobilenetv2": 8, "gpt-mini": 10}
"""Steps per model (the small ones run 150, a second or two: their median step shrugs off
a burst of load): each run stays short on a shared machine."""


def measured_step_s(reports: list[Any], warmup: int) -> float:
    """Median gap between the ends of consecutive steps (the last report of each)."""
    ends: dict[int, float] = {}
    for r in reports:
        ends[r.step] = max(ends.get(r.step, 0.0), r.ts)
    times = [ends[k] for k in sorted(ends) if k >= warmup]
    return statistics.median(b - a for a, b in itertools.pairwise(times))


def run_model(model: str, agents: int, warmup: int) -> dict[str, Any]:
    spec = JobSpec(model=model, steps=STEPS.get(model, 150), batch_size=32, microbatches=4, seed=0)
    started = time.perf_counter()
    run = train_on_local_fleet(LocalTraining(spec=spec, devices=agents, threads=1, rebalance=False))
    assert run.prediction is not None, "the agents announced no fixed costs"
    measured = measured_step_s(run.result.reports, warmup)
    predicted = run.prediction.step_time_s
    return {
        "model": model,
        "stages": [[s.device, s.start, s.end] for s in run.score.plan.stages],
        "predicted_step_s": predicted,
        "spec_step_s": run.score.step_time_s,
        "measured_step_s": measured,
        "ratio": measured / predicted,
        "spec_ratio": measured / run.score.step_time_s,
        "wall_s": time.perf_counter() - started,
    }


def run_demo(steps: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "edgetrain.cli", "demo", "--exit", "--json", "--steps", str(steps)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return {
        "model": "demo (cnn-digits, rpi5-8gb,jetson-nano,laptop emulated)",
        "measured_sps": got["samples_per_s"],
        "predicted_sps": got["predicted_samples_per_s"],
        "ratio": got["measured_over_predicted"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(list_models()))
    ap.add_argument("--agents", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--demo", action="store_true", help="Also run edgetrain demo.")
    ap.add_argument("--demo-steps", type=int, default=100)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [run_model(m, args.agents, args.warmup) for m in args.models.split(",") if m]
    demo = run_demo(args.demo_steps) if args.demo else None
    result = {
        "agents": args.agents,
        "target": TARGET,
        "models": rows,
        "demo": demo,
        "load_average": os.getloadavg(),  # this machine is shared: how busy it was
        "cpus": os.cpu_count(),
    }
    out = ROOT / "bench" / "results" / "cost_model.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result))
        return
    print(f"{'model':<12} {'stages':>6} {'pred ms':>9} {'spec ms':>9} {'meas ms':>9} {'ratio':>6}")
    for r in rows:
        print(
            f"{r['model']:<12} {len(r['stages']):>6} {r['predicted_step_s'] * 1e3:>9.2f} "
            f"{r['spec_step_s'] * 1e3:>9.2f} {r['measured_step_s'] * 1e3:>9.2f} "
            f"{r['ratio']:>6.2f}"
        )
    if demo is not None:
        print(
            f"demo: measured {demo['measured_sps']:.0f} samples/s, predicted "
            f"{demo['predicted_sps']:.0f}, ratio {demo['ratio']:.2f}"
        )


if __name__ == "__main__":
    exit_on_sigterm()  # a stopped run stops the broker and agents it started
    main()
