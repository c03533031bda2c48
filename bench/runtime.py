"""Runtime overhead: one-stage edgetrain against a plain PyTorch training loop.

Both train the same zoo model from the same seed on the same dataset with the
same optimizer and batch size, for the same number of steps, in this process;
edgetrain runs its real stage runtime (schedule executor, loss scaling, step
reports) through :func:`coordinator.engine.runners.run_inprocess` with one stage and
one microbatch, the plain loop is a ``DataLoader`` and the textbook four lines.
Rounds alternate between the two and the median of each is reported, so both
see the same machine. Target: edgetrain at least 0.95x the plain loop.

Run: ``.venv/bin/python bench/runtime.py [--json] [--rounds N]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler

from coordinator.engine.runners import run_inprocess
from coordinator.engine.spec import JobSpec
from coordinator.planner.score import Plan
from edge.models.datasets import build_dataset
from edge.models.zoo import get_model
from edge.runtime.stage import loss_fn

CASES = [  # model, batch size, steps
    ("mlp", 64, 150),
    ("cnn-digits", 64, 100),
    ("gpt-mini", 16, 20),
    ("resnet18", 16, 6),
]


def plain_loop(model: str, batch: int, steps: int, seed: int = 0) -> float:
    """Samples per second of the textbook loop (timed from the first batch to the last step)."""
    spec = get_model(model, seed=seed)
    net = spec.build().train()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    data = build_dataset(spec.dataset, "train", **spec.dataset_options)
    gen = torch.Generator().manual_seed(seed)
    loader = DataLoader(
        data, batch_size=batch, sampler=RandomSampler(data, generator=gen), drop_last=True
    )
    done = 0
    started = time.perf_counter()
    while done < steps:
        for x, y in loader:
            loss = loss_fn(net(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            done += 1
            if done == steps:
                break
    return steps * batch / (time.perf_counter() - started)


def one_stage_plan(model: str) -> Plan:
    """The whole model on one device: the plan edgetrain runs here."""
    return Plan.of(("local", 0, get_model(model).num_units))


def edgetrain_one_stage(model: str, batch: int, steps: int, seed: int = 0) -> float:
    spec = JobSpec.model_validate(
        {
            "model": model,
            "steps": steps,
            "batch_size": batch,
            "microbatches": 1,
            "seed": seed,
            "optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
        }
    )
    return run_inprocess(spec, one_stage_plan(model)).samples_per_s


def format_table(rows: list[dict[str, Any]], threads: int, rounds: int) -> str:
    """The rows as ``main`` prints them."""
    lines = [
        f"one-stage edgetrain vs plain PyTorch loop ({threads} threads, "
        f"median of {rounds} alternating rounds)",
        f"{'model':>12} {'batch':>5} {'steps':>5} {'stages':>6} {'plain sps':>10} "
        f"{'edgetrain':>10} {'ratio':>6}",
    ]
    for r in rows:
        lines.append(
            f"{r['model']:>12} {r['batch_size']:>5} {r['steps']:>5} {r['stages']:>6} "
            f"{r['plain_sps']:>10.1f} {r['edgetrain_sps']:>10.1f} {r['ratio']:>6.3f}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for model, batch, steps in CASES:
        plain, ours = [], []
        for _ in range(args.rounds):
            plain.append(plain_loop(model, batch, steps))
            ours.append(edgetrain_one_stage(model, batch, steps))
        p, o = statistics.median(plain), statistics.median(ours)
        rows.append(
            {
                "model": model,
                "batch_size": batch,
                "steps": steps,
                "stages": len(one_stage_plan(model).stages),
                "plain_sps": p,
                "edgetrain_sps": o,
                "ratio": o / p,
                "plain_rounds": plain,
                "edgetrain_rounds": ours,
            }
        )
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=2))
        return 0
    print(format_table(rows, torch.get_num_threads(), args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
