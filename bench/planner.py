"""Planner benchmark: edgetrain's plan against the baselines on realistic fleets.

Prints, per scenario, the predicted samples/s of edgetrain's plan and of every
baseline (all scored with the spec formula; infeasible ones marked), each with
its number of stages, the planner's wall time and whether the search was exact;
then planning time on random 64-device x 200-unit instances, with a lower bound
on the step time and the best baseline. Where edgetrain's plan is a baseline's
(a single device, when no split pays) its cell says so. ``--json`` prints the
same as one JSON object.

The columns ``groups (v2)`` and ``v2 / v1`` are planner version 2 on the same
devices (``shared/spec/planning-v2.md``: a stage may run on a group of devices,
data-parallel, with a ring all-reduce per step), with its plan's group sizes,
and ``data-parallel`` the best single group; all predictions of the spec score,
like the rest.

The lower bound on the step time is :func:`coordinator.planner.bounds.lower_bound`
(its docstring has the derivation).

Run: ``.venv/bin/python bench/planner.py [--json] [--large-seeds N]``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from coordinator.planner.baselines import run_baselines
from coordinator.planner.bounds import lower_bound
from coordinator.planner.build import build_problem, parse_fleet
from coordinator.planner.group_search import data_parallel_only, plan_groups
from coordinator.planner.score import score_plan
from coordinator.planner.solve import plan_problem
from edge.problem import PlanningProblem, UnitSpec
from edge.profiling.catalog import all_resolved, load_catalogue


@dataclass
class Scenario:
    name: str
    model: str
    fleet: str
    batch_size: int
    microbatches: int
    pin_first: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    note: str = ""


SCENARIOS = [
    Scenario(
        "edge-mix",
        "vgg11",
        "rpi4-4gb,jetson-nano,jetson-orin-nano,laptop",
        64,
        8,
        note="the README example",
    ),
    Scenario(
        "hetero-12x",
        "resnet18",
        "rpi3b-plus:2,rpi4-4gb:2,rpi5-8gb,phone-sd8g3",
        32,
        8,
        note="fastest device 11.8x the slowest (40 vs 3.4 GFLOP/s)",
    ),
    Scenario(
        "tight-memory",
        "gpt-mini",
        "rpi4-2gb:4,rpi3b-plus:2",
        16,
        4,
        options={"d_model": 768, "n_layer": 12, "n_head": 12},
        note="85M parameters: fits on no single device",
    ),
    Scenario(
        "edge-to-gpu",
        "resnet18",
        "phone-sd8g3,jetson-nano,h100-sxm",
        64,
        8,
        pin_first="phone-sd8g3-12gb",
        note="the phone holds the data; 400 Mb/s Wi-Fi uplink",
    ),
    Scenario(
        "pi-cluster-15",
        "mobilenetv2",
        "rpi4-4gb:6,rpi5-8gb:4,jetson-nano:2,phone-sd8g3:2,laptop",
        64,
        16,
        note="15 devices: beyond the exact search, heuristic",
    ),
    Scenario(
        "gpt-mixed", "gpt-mini", "rpi5-8gb:2,jetson-nano,nuc,laptop", 32, 8, options={"n_layer": 8}
    ),
    Scenario(
        "pi-4",
        "vgg11",
        "rpi4-4gb:4",
        64,
        8,
        note="four equal Pis: where data parallelism pays (issue 16's 1.47x)",
    ),
]


def evaluate(problem: PlanningProblem) -> dict[str, Any]:
    started = time.perf_counter()
    result = plan_problem(problem)
    wall = time.perf_counter() - started
    row: dict[str, Any] = {
        "devices": len(problem.devices),
        "units": len(problem.layers),
        "exact": result.exact,
        "method": result.method,
        "plan_wall_s": wall,
        "edgetrain_sps": result.score.throughput_sps if result.score else None,
        "edgetrain_step_s": result.score.step_time_s if result.score else None,
        "stages": len(result.score.plan.stages) if result.score else 0,
        "same_plan_as": [],  # the baselines whose plan is edgetrain's, stage for stage
        "lower_bound_step_s": lower_bound(problem),
        "baselines": {},
    }
    for name, sc in run_baselines(problem).items():
        row["baselines"][name] = {
            "sps": sc.throughput_sps,
            "step_s": sc.step_time_s,
            "feasible": sc.feasible,
            "stages": len(sc.plan.stages),
        }
        if result.score is not None and sc.plan.stages == result.score.plan.stages:
            row["same_plan_as"].append(name)
    v2 = problem.as_version(2)
    started = time.perf_counter()
    grouped = plan_groups(v2)
    row["v2_wall_s"] = time.perf_counter() - started
    row["v2_sps"] = grouped.score.throughput_sps if grouped.score else None
    row["v2_groups"] = (
        [len(st.devices) for st in grouped.score.plan.stages] if grouped.score else []
    )
    row["v2_method"] = grouped.method
    dp = data_parallel_only(v2)
    row["data_parallel_sps"] = score_plan(v2, dp).throughput_sps if dp is not None else None
    return row


def random_large(seed: int, devices: int = 64, units: int = 200) -> PlanningProblem:
    """A random instance: units with skewed costs, devices drawn from the catalogue."""
    rng = random.Random(seed)
    catalogue = [r for r in all_resolved(load_catalogue()) if r.profile.kind != "gpu-server"]
    layers = []
    for i in range(units):
        flops = rng.lognormvariate(17, 1.2)
        layers.append(
            UnitSpec(
                name=f"u{i}",
                fwd_flops=flops,
                param_bytes=rng.lognormvariate(13, 1.5),
                out_bytes=rng.lognormvariate(11, 1.0),
                act_bytes=rng.lognormvariate(11.5, 1.0),
            )
        )
    fleet = [rng.choice(catalogue).to_device_spec(f"dev{j:02d}") for j in range(devices)]
    return PlanningProblem(
        version=1,
        batch_size=64,
        microbatches=16,
        layers=layers,
        devices=fleet,
        pin_first=fleet[0].id,
    )


def _fmt(sps: float | None, stages: int, feasible: bool = True) -> str:
    if sps is None:
        return "-"
    text = f"{sps:,.1f} [{stages}]"
    return text if feasible else f"({text}) infeasible"


BASELINE_NAMES = ["single", "even", "pipedream", "ftpipehd"]


def format_tables(out: dict[str, Any]) -> str:
    """The scenarios' table and the large instances' table, as ``main`` prints them."""
    header = ["scenario", "dev", "units", "edgetrain", *BASELINE_NAMES, "plan s", "exact"]
    header += ["groups (v2)", "v2 / v1", "data-parallel"]
    lines = [
        "predicted samples/s (spec score; higher is better) [stages of the plan]",
        " | ".join(header),
    ]
    for name, row in out["scenarios"].items():
        base = row["baselines"]
        ours = _fmt(row["edgetrain_sps"], row["stages"])
        if row["same_plan_as"]:
            ours += f" (= {', '.join(row['same_plan_as'])})"
        cells = [name, str(row["devices"]), str(row["units"]), ours]
        cells += [
            _fmt(base[n]["sps"], base[n]["stages"], base[n]["feasible"]) for n in BASELINE_NAMES
        ]
        cells += [f"{row['plan_wall_s']:.2f}", "yes" if row["exact"] else "no"]
        cells += _v2_cells(row)
        lines.append(" | ".join(cells))
    lines += [
        "",
        "random 64 devices x 200 units (pin_first set, M=16)",
        "seed | plan s | method | edgetrain step s | stages | lower bound s | best baseline step s"
        " | v2 plan s | v2 / v1",
    ]
    for row in out["large"]:
        feasible = [b for b in row["baselines"].values() if b["feasible"]]
        best = min(feasible, key=lambda b: b["step_s"], default=None)
        lines.append(
            f"{row['seed']} | {row['plan_wall_s']:.2f} | {row['method']} | "
            f"{row['edgetrain_step_s']:.4f} | {row['stages']} | {row['lower_bound_step_s']:.4f} | "
            + (f"{best['step_s']:.4f} [{best['stages']}]" if best else "none feasible")
            + f" | {row['v2_wall_s']:.2f} | {_ratio(row)}"
        )
    return "\n".join(lines)


def _ratio(row: dict[str, Any]) -> str:
    ours, v2 = row["edgetrain_sps"], row["v2_sps"]
    return f"{v2 / ours:.2f}x" if ours and v2 else "-"


def _v2_cells(row: dict[str, Any]) -> list[str]:
    """The version 2 plan (its group sizes), its gain over version 1, the best group."""
    groups = "+".join(map(str, row["v2_groups"]))
    v2 = f"{row['v2_sps']:,.1f} [{groups}]" if row["v2_sps"] else "-"
    dp = row["data_parallel_sps"]
    return [v2, _ratio(row), f"{dp:,.1f}" if dp else "-"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--large-seeds", type=int, default=3, help="64x200 instances to time")
    args = parser.parse_args()
    out: dict[str, Any] = {"scenarios": {}, "large": []}
    for sc in SCENARIOS:
        problem = build_problem(
            sc.model,
            parse_fleet(sc.fleet),
            batch_size=sc.batch_size,
            microbatches=sc.microbatches,
            pin_first=sc.pin_first,
            model_options=sc.options,
        )
        row = evaluate(problem)
        row.update(model=sc.model, fleet=sc.fleet, note=sc.note)
        out["scenarios"][sc.name] = row
    for seed in range(args.large_seeds):
        row = evaluate(random_large(seed))
        row["seed"] = seed
        out["large"].append(row)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(format_tables(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
