"""Where each bench row's step goes: the anatomy of ``bench/hybrid.py``'s plans.

Each row of ``bench/hybrid.py`` carries its plan's predicted anatomy (the internal
model's terms split by :func:`coordinator.planner.anatomy.anatomy`) and the anatomy
measured from its run's step reports (:class:`coordinator.planner.anatomy.AnatomyMeter`
over the steady steps). This script sums each over the plan's members: the fleet's
device-seconds a step, as fractions per part (compute, fixed, bubble, imbalance, link,
group sum), measured next to predicted, with

- ``adds_up``: the worst member's parts against the measured step (stage 0's), as
  ``max |total / step - 1|``: how far a member's period strays from the step;
- ``measured/predicted``: the measured step over the predicted one;
- ``largest loss``: the part besides compute the fleet loses most device-seconds to,
  measured: the part a faster plan must take back first.

It writes ``bench/results/anatomy.json`` and a chart (a pair of stacked bars a row,
predicted above measured), and prints the table. ``bench/hybrid.py`` calls it after
its runs; alone it renders a results file again:

    .venv/bin/python bench/anatomy.py [--from bench/results/hybrid.json]
        [--results bench/results/anatomy.json] [--chart bench/results/anatomy.png]

``--spec`` runs nothing and reads no results: for each of ``bench/hybrid.py``'s fleets
and models (its catalogue devices, its batch) it plans the version 2 job as the bench
does and prints the anatomy the spec's score gives that plan, with the fraction of the
ideal bound it predicts. No fixed costs and no measured unit times: what the plan's
shape alone costs (bubble, imbalance, links, group sums), in seconds, to compare the
parts by before a run says what else there is.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's packages

from bench.siblings import sibling
from coordinator.planner.anatomy import PARTS

RESULTS = Path(__file__).resolve().parent / "results"
COLOURS = {
    "compute": "#4cc38a",
    "fixed": "#8a6fd1",
    "bubble": "#9e9e9e",
    "imbalance": "#ef6b6b",
    "link": "#5b9cf5",
    "group_sum": "#e0a04a",
}


def fractions(anatomy: dict[str, Any]) -> dict[str, float]:
    """Each part's share of the members' device-seconds (an anatomy's JSON)."""
    totals = {p: sum(m[p] for m in anatomy["members"]) for p in PARTS}
    whole = sum(totals.values())
    return {p: (t / whole if whole > 0 else 0.0) for p, t in totals.items()}


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One item per hybrid row that has both anatomies (see the module docstring)."""
    out = []
    for r in rows:
        predicted, measured = r.get("anatomy"), r.get("measured_anatomy")
        if not predicted or not measured:
            continue
        step = measured["step_time_s"]
        totals = [sum(m[p] for p in PARTS) for m in measured["members"]]
        shares = fractions(measured)
        out.append(
            {
                "model": r["model"],
                "fleet": r["fleet"],
                "strategy": r["strategy"],
                "shape": r["shape"],
                "measured_step_s": step,
                "predicted_step_s": predicted["step_time_s"],
                "measured_over_predicted": step / predicted["step_time_s"],
                "measured": shares,
                "predicted": fractions(predicted),
                "largest_loss": max(PARTS[1:], key=lambda p: shares[p]),
                "adds_up": max(abs(t / step - 1) for t in totals) if step > 0 else 0.0,
                "steps": measured.get("steps", 0),
            }
        )
    return out


def table(items: list[dict[str, Any]]) -> str:
    """The summary as a Markdown table: each part measured (predicted), in % of the fleet's
    device-seconds, then the checks."""
    head = " | ".join(p.replace("_", " ") for p in PARTS)
    lines = [
        f"| model | fleet | plan | devices per stage | {head} | largest loss "
        "| measured/predicted step | adds up to the step within |",
        "|---" * (len(PARTS) + 7) + "|",
    ]
    for it in items:
        cells = " | ".join(f"{it['measured'][p]:.0%} ({it['predicted'][p]:.0%})" for p in PARTS)
        lines.append(
            f"| {it['model']} | {it['fleet']} | {it['strategy']} | {it['shape']} | {cells} "
            f"| {it['largest_loss'].replace('_', ' ')} | {it['measured_over_predicted']:.2f} "
            f"| {it['adds_up']:.1%} |"
        )
    return "\n".join(lines)


def chart(items: list[dict[str, Any]], path: Path) -> None:
    """A pair of horizontal stacked bars a row: predicted (light) above measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.55 * len(items) + 1.6))
    labels = []
    for i, it in enumerate(items):
        y = len(items) - 1 - i
        for offset, side, alpha in ((0.2, "predicted", 0.45), (-0.2, "measured", 1.0)):
            left = 0.0
            for part in PARTS:
                width = it[side][part]
                ax.barh(
                    y + offset,
                    width,
                    0.36,
                    left=left,
                    color=COLOURS[part],
                    alpha=alpha,
                    label=part.replace("_", " ") if i == 0 and side == "measured" else None,
                )
                left += width
        labels.append((y, f"{it['model']}, {it['fleet']}, {it['strategy']} [{it['shape']}]"))
    ax.set_yticks([y for y, _ in labels], [text for _, text in labels])
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of the fleet's device-seconds a step (upper, light: predicted)")
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(PARTS), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(rows: list[dict[str, Any]], results: Path, chart_path: Path) -> list[dict[str, Any]]:
    """Summarise ``rows`` (hybrid rows as JSON), write the results and the chart; the items."""
    items = summary(rows)
    results.write_text(json.dumps(items, indent=2) + "\n")
    if items:
        chart(items, chart_path)
    return items


def spec_anatomies(
    batch_size: int,
    microbatches: int,
    fleets: tuple[str, ...] | None = None,
    models: tuple[str, ...] = ("vgg11", "resnet18", "gpt-mini"),
) -> list[dict[str, Any]]:
    """``--spec``: each bench cell's version 2 plan (``bench/hybrid.py``'s fleets, or
    ``fleets``), as the spec's score splits its step."""
    from coordinator.engine.engine import group_limits
    from coordinator.engine.spec import JobSpec
    from coordinator.planner.anatomy import StepTerms, anatomy
    from coordinator.planner.build import build_problem
    from coordinator.planner.score import for_plan, score_plan

    hybrid = sibling("hybrid")
    out = []
    for key in fleets or hybrid.FLEETS:
        devices = hybrid.fleet_devices(key)
        for model in models:
            problem = build_problem(
                model, devices, batch_size=batch_size, microbatches=microbatches, version=2
            )
            job = JobSpec(model=model, steps=1, batch_size=batch_size, microbatches=microbatches)
            plan = hybrid.plans(problem, group_limits(job))["v2"]
            planned = for_plan(problem, plan)
            score = score_plan(planned, plan)
            parts = anatomy(plan, StepTerms.of_score(planned, score))
            out.append(
                {
                    "model": model,
                    "fleet": hybrid.fleet_name(key),
                    "shape": "+".join(str(len(st.devices)) for st in plan.stages),
                    "predicted_of_ideal": score.throughput_sps / hybrid.ideal_sps(problem),
                    "parts": parts.fractions(),
                    "largest_loss": parts.largest_loss(),
                }
            )
    return out


def spec_table(items: list[dict[str, Any]]) -> str:
    """``--spec``'s items as a Markdown table (parts in % of the plan's device-seconds)."""
    head = " | ".join(p.replace("_", " ") for p in PARTS)
    lines = [
        f"| fleet | model | devices per stage | predicted of ideal | {head} | largest loss |",
        "|---" * (len(PARTS) + 5) + "|",
    ]
    for it in items:
        cells = " | ".join(f"{it['parts'][p]:.0%}" for p in PARTS)
        lines.append(
            f"| {it['fleet']} | {it['model']} | {it['shape']} | {it['predicted_of_ideal']:.2f} "
            f"| {cells} | {it['largest_loss'].replace('_', ' ')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--from", dest="source", type=Path, default=RESULTS / "hybrid.json")
    parser.add_argument("--results", type=Path, default=RESULTS / "anatomy.json")
    parser.add_argument("--chart", type=Path, default=RESULTS / "anatomy.png")
    parser.add_argument("--spec", action="store_true", help="each cell's plan by the spec's score")
    parser.add_argument("--batch-size", type=int, default=64, help="with --spec")
    parser.add_argument("--microbatches", type=int, default=4, help="with --spec")
    args = parser.parse_args(argv)
    if args.spec:
        print(spec_table(spec_anatomies(args.batch_size, args.microbatches)))
        return 0
    try:
        rows = json.loads(args.source.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        parser.error(f"--from {args.source}: cannot read it: {exc}")
    items = write(rows, args.results, args.chart)
    if not items:
        print(f"{args.source}: no row carries both anatomies (rows from before them)")
        return 1
    print(f"results: {args.results}; chart: {args.chart}")
    print(table(items))
    return 0


if __name__ == "__main__":
    sys.exit(main())
