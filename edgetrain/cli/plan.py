"""``edgetrain plan``: plan a problem file, or a zoo model on a fleet from the catalogue."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from edge.errors import UserError
from edge.files import write_atomic
from edge.problem import Objective, PlanningProblem, load_problem

if TYPE_CHECKING:
    from rich.console import Console

    from coordinator.planner.anatomy import Anatomy
    from coordinator.planner.score import PlanScore
    from coordinator.planner.solve import SearchResult

__all__ = ["plan_command"]

INFEASIBLE_EXIT = 3


def plan_command(
    problem_file: Path | None = typer.Option(
        None,
        "--problem",
        help="A planning problem (JSON, shared/spec/planning.md or planning-v2.md).",
    ),
    model: str | None = typer.Option(None, "--model", help="Zoo model to plan instead."),
    devices: str | None = typer.Option(
        None,
        "--devices",
        help="Fleet for --model: catalogue names with optional :count, or JSON device files, "
        "comma-separated (e.g. rpi4-4gb:2,jetson-nano,laptop).",
    ),
    batch_size: int = typer.Option(32, "--batch-size", "-b", min=1, help="Samples per step."),
    microbatches: int = typer.Option(4, "--microbatches", "-m", min=1, help="Microbatches."),
    pin_first: str | None = typer.Option(
        None, "--pin-first", help="Device that must run stage 0 (it holds the data)."
    ),
    option: list[str] = typer.Option([], "--option", "-o", help="Model option key=value."),
    optimizer_state_factor: float = typer.Option(
        4.0, "--optimizer-state-factor", help="Bytes held per parameter byte (k)."
    ),
    time_budget: float = typer.Option(8.0, "--time-budget", help="Search seconds, large fleets."),
    groups: bool = typer.Option(
        True,
        "--groups/--no-groups",
        help="With --model: let a stage run on a group of devices (a version 2 problem).",
    ),
    objective: str | None = typer.Option(
        None,
        "--objective",
        help="time or energy (a version 2 problem; energy from datasheet power figures).",
    ),
    deadline: float | None = typer.Option(
        None, "--deadline", help="Most seconds a step may take (a version 2 problem)."
    ),
    emit_problem: Path | None = typer.Option(
        None, "--emit-problem", help="Write the planning problem to this file."
    ),
    timeline: Path | None = typer.Option(
        None, "--timeline", help="Write the simulated 1F1B step as a Chrome trace (JSON)."
    ),
    explain: bool = typer.Option(
        False, "--explain", help="Also say where each member's step goes (its anatomy)."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the spec's JSON plan object."),
) -> None:
    """Split a model across devices so that a training step takes the least time.

    Either --problem FILE, or --model with --devices (the problem is built from
    the model's unit costs and the device catalogue). Exit status 2 for bad
    input, 3 when no plan fits the devices' memory. --explain splits each member's
    step into compute, fixed costs, pipeline bubble, imbalance, link and group sum
    (with --json, as "anatomy"). Every plan's report gives a lower bound on the step
    no plan beats and the plan's gap to it; --json adds them (lower_bound_step_s, gap)
    for --model, and for --problem with --explain: a problem file's object is the
    spec's.
    """
    # The planner (numpy) is imported by the command, not with the module: every other
    # command starts without it ([Note: commands without torch] in edgetrain.cli).
    from coordinator.planner.build import build_problem, parse_fleet
    from coordinator.planner.group_search import plan_any
    from coordinator.planner.simulator import simulate

    if (problem_file is None) == (model is None):
        raise UserError("give either --problem FILE or --model NAME (with --devices)")
    if problem_file is not None:
        problem = load_problem(problem_file)
    else:
        assert model is not None
        if not devices:
            raise UserError("--model needs --devices")
        from edge.models.zoo import parse_options  # [Note: commands without torch]

        problem = build_problem(
            model,
            parse_fleet(devices, power=groups),
            batch_size=batch_size,
            microbatches=microbatches,
            pin_first=pin_first,
            optimizer_state_factor=optimizer_state_factor,
            model_options=parse_options(option),
            version=2 if groups else 1,
        )
    problem = with_objective(problem, objective, deadline)
    if emit_problem is not None:
        _write(emit_problem, json.dumps(problem.to_json(), indent=2) + "\n", "--emit-problem")
    result = plan_any(problem, time_budget_s=time_budget)
    if result.score is None:
        typer.echo(json.dumps({"feasible": False, "reason": result.reason}))
        raise typer.Exit(INFEASIBLE_EXIT)
    if timeline is not None:
        trace = simulate(problem, result.score.plan, "1f1b").to_chrome_trace()
        _write(timeline, json.dumps(trace), "--timeline")
    if json_out:
        typer.echo(json.dumps(_plan_object(problem, result.score, explain, problem_file is None)))
        return
    _print_report(problem, result, _anatomy(problem, result.score) if explain else None)


def _plan_object(
    problem: PlanningProblem, score: PlanScore, explain: bool, of_model: bool
) -> dict[str, Any]:
    """What ``--json`` prints: the spec's object, and edgetrain's own figures with it when
    asked for (``explain``: the anatomy) or for a plan of a model (the certificate). A
    problem file's plain object is the spec's, exactly."""
    from coordinator.planner.bounds import certificate

    extra: dict[str, Any] = {"anatomy": _anatomy(problem, score).to_json()} if explain else {}
    if explain or of_model:
        extra |= certificate(problem, score.step_time_s)
    return score.to_json() | extra


def _anatomy(problem: PlanningProblem, score: PlanScore) -> Anatomy:
    from coordinator.planner.anatomy import StepTerms, anatomy

    return anatomy(score.plan, StepTerms.of_score(problem, score))


def with_objective(
    problem: PlanningProblem, objective: str | None, deadline: float | None
) -> PlanningProblem:
    """``problem`` with ``--objective``/``--deadline`` applied (as version 2 when given)."""
    if objective is None and deadline is None:
        return problem
    if objective not in (None, "time", "energy"):
        raise UserError(f"--objective: {objective!r} is not one of: time, energy")
    if deadline is not None and not deadline > 0:
        raise UserError(f"--deadline: {deadline} is not a positive number of seconds")
    goal = problem.goal
    new = Objective(
        minimize=objective or goal.minimize,  # type: ignore[arg-type]
        max_step_time_s=deadline if deadline is not None else goal.max_step_time_s,
    )
    return problem.as_version(2).model_copy(update={"objective": new})


def _write(path: Path, text: str, option: str) -> None:
    """Write an output file whole ([Note: nothing torn] in :mod:`edge.files`); one line if
    it cannot be."""
    try:
        write_atomic(path, text)
    except OSError as exc:
        raise UserError(f"{option} {path}: cannot write: {exc.strerror or exc}") from None


def _print_report(problem: PlanningProblem, result: SearchResult, parts: Anatomy | None) -> None:
    from rich.console import Console
    from rich.table import Table

    from coordinator.planner.bounds import certificate
    from coordinator.planner.simulator import memory_error, simulate
    from edge.runtime.schedules import SCHEDULES

    score = result.score
    assert score is not None
    names = [unit.name for unit in problem.layers]
    table = Table(title=f"plan: {len(score.plan.stages)} stages, {result.method}")
    for col in ("stage", "device", "units", "compute ms", "link ms", "memory MB"):
        left = col in ("device", "units")
        table.add_column(col, justify="left" if left else "right", no_wrap=col != "units")
    for s, st in enumerate(score.plan.stages):
        mark = " *" if score.compute_s[s] == score.bottleneck_s else ""
        link = "-"
        if s < len(score.link_s):
            link = f"{score.link_s[s] * 1e3:.2f}" + (
                " *" if score.link_s[s] == score.bottleneck_s else ""
            )
        units = names[st.start : st.end]
        shown = ",".join(units) if len(units) <= 4 else f"{units[0]}..{units[-1]} ({len(units)})"
        members = st.device
        if st.helpers:
            members = "+".join(
                f"{d} ({w:.0%})" for d, w in zip(st.devices, score.shares[s], strict=True)
            )
        table.add_row(
            str(s),
            members,
            shown,
            f"{score.compute_s[s] * 1e3:.2f}{mark}",
            link,
            f"{score.memory_bytes[s] / 1e6:.0f}/{score.memory_limit_bytes[s] / 1e6:.0f}",
        )
    console = Console()
    console.print(table)
    console.print(
        f"* bottleneck {score.bottleneck_s * 1e3:.2f} ms per microbatch; step "
        f"{score.step_time_s * 1e3:.1f} ms; predicted {score.throughput_sps:.1f} samples/s "
        f"(planned in {result.wall_s:.2f} s, {'exact' if result.exact else 'heuristic'})"
    )
    certified = certificate(problem, score.step_time_s)
    console.print(
        f"lower bound {certified['lower_bound_step_s'] * 1e3:.1f} ms a step: no plan is "
        f"faster; this one is within {certified['gap']:.0%} of it"
    )
    if problem.version == 2:
        reduce = max(score.allreduce_s, default=0.0)
        console.print(
            f"all-reduce {reduce * 1e3:.2f} ms per step; predicted "
            f"{score.energy_j_per_sample:.3g} J/sample ({score.energy_j_per_step:.3g} J/step, "
            "from datasheet power figures: a prediction, nothing measures power)"
        )
    sims = {name: simulate(problem, score.plan, name) for name in SCHEDULES}
    fits = {n for n in SCHEDULES if memory_error(problem, score.plan, n, sims[n]) is None}
    console.print(
        "simulated step: "
        + "; ".join(
            f"{name} {sim.step_time_s * 1e3:.1f} ms, bubble {sim.bubble_fraction:.0%}, "
            f"peak memory {max(sim.peak_memory_bytes) / 1e6:.1f} MB"
            + ("" if name in fits else " (does not fit)")
            for name, sim in sims.items()
        )
    )
    if parts is not None:
        _print_anatomy(console, parts)
    _print_baselines(console, problem, score)


def _print_anatomy(console: Console, parts: Anatomy) -> None:
    """Each member's step in its parts (ms), each part's share of the fleet's
    device-seconds, and the part besides compute the fleet loses most to."""
    from rich.table import Table

    from coordinator.planner.anatomy import PARTS

    step = parts.step_time_s
    table = Table(title=f"where the step goes (predicted, ms of a {step * 1e3:.1f} ms step)")
    table.add_column("stage", justify="right")
    table.add_column("device")
    for part in PARTS:
        table.add_column(part.replace("_", " "), justify="right")
    for m in parts.members:
        table.add_row(str(m.stage), m.device, *(f"{getattr(m, p) * 1e3:.1f}" for p in PARTS))
    console.print(table)
    shares = parts.fractions()
    worst = parts.largest_loss()
    console.print(
        "of the plan's device-seconds: "
        + ", ".join(f"{p.replace('_', ' ')} {shares[p]:.0%}" for p in PARTS)
        + f"; the largest loss is {worst.replace('_', ' ')}"
    )


def _print_baselines(console: Console, problem: PlanningProblem, score: PlanScore) -> None:
    from rich.table import Table

    from coordinator.planner.baselines import run_baselines

    base = Table(title="baselines (same score)")
    for col in ("baseline", "samples/s", "step ms", "edgetrain speed-up", "feasible"):
        base.add_column(col, justify="left" if col == "baseline" else "right")
    for name, b in run_baselines(problem).items():
        base.add_row(
            name,
            f"{b.throughput_sps:.1f}",
            f"{b.step_time_s * 1e3:.1f}",
            f"{b.step_time_s / score.step_time_s:.2f}x",
            "yes" if b.feasible else "no: " + b.reasons[0],
        )
    console.print(base)
