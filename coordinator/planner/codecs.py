"""Choosing the codec of every link of a plan: compress a link only where it pays.

The spec's score (``shared/spec/planning.md``) prices a link by the bytes of
the activation crossing it; a codec (:class:`edge.wire.frames.Codec`) shrinks those
bytes, both ways (activations forward, their gradients back), by
:data:`RATIO` and costs accuracy: fp32 is exact, bf16 and fp16 round to 8 or
11 bits of mantissa, int8 quantises with one scale per tensor. AccEPT's
observation is that compression is worth it on the slow links only; a hybrid
plan (edge devices run the first units, a server the rest, across one uplink)
is the case where it matters most.

:func:`choose_codecs` gives each link of a plan the most precise allowed codec
under which it is off the critical path (its time is at most the slowest
stage's compute time, so the bottleneck is compute), or the most compressing
one if none is. :func:`plan_with_codecs` searches plans for every allowed codec
(activation bytes scaled as if every link used it, so the search sees what
compression makes possible), chooses each plan's codecs, and keeps the plan
with the least step time, preferring more precise codecs on ties. Scores are
the spec's formulas on the problem with each boundary's bytes scaled
(:func:`with_codecs`), so any result can be checked with a calculator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from coordinator.planner.score import Plan, PlanScore, score_plan
from edge.problem import PlanningProblem

__all__ = [
    "DEFAULT_ALLOWED",
    "RATIO",
    "CodecChoice",
    "choose_codecs",
    "plan_with_codecs",
    "with_codecs",
]

RATIO = {"fp32": 1.0, "bf16": 0.5, "fp16": 0.5, "int8": 0.25}
"""Bytes on the wire per fp32 byte (int8's one scale per tensor is negligible)."""

DEFAULT_ALLOWED = ("fp32", "bf16", "int8")
"""Most precise first. bf16 over fp16: gradients keep fp32's range."""


@dataclass(frozen=True)
class CodecChoice:
    """A plan, the codec of each of its links, and its score under those codecs."""

    plan: Plan
    codecs: list[str]
    score: PlanScore


def _check(allowed: Sequence[str]) -> None:
    if not allowed:
        raise ValueError("no codec allowed")
    unknown = [c for c in allowed if c not in RATIO]
    if unknown:
        raise ValueError(f"unknown codecs {unknown}; known: {sorted(RATIO)}")


def with_codecs(problem: PlanningProblem, plan: Plan, codecs: Sequence[str]) -> PlanningProblem:
    """``problem`` with the output bytes of each link's last unit scaled by its codec."""
    if len(codecs) != len(plan.stages) - 1:
        raise ValueError(f"{len(codecs)} codecs for {len(plan.stages) - 1} links")
    layers = list(problem.layers)
    for stage, codec in zip(plan.stages, codecs, strict=False):
        i = stage.end - 1
        layers[i] = layers[i].model_copy(update={"out_bytes": layers[i].out_bytes * RATIO[codec]})
    return problem.model_copy(update={"layers": layers})


def _scaled(problem: PlanningProblem, codec: str) -> PlanningProblem:
    layers = [
        unit.model_copy(update={"out_bytes": unit.out_bytes * RATIO[codec]})
        for unit in problem.layers
    ]
    return problem.model_copy(update={"layers": layers})


def choose_codecs(
    problem: PlanningProblem, plan: Plan, allowed: Sequence[str] = DEFAULT_ALLOWED
) -> list[str]:
    """Per link of ``plan``: the first of ``allowed`` that keeps it off the critical path."""
    _check(allowed)
    codecs = [allowed[0]] * (len(plan.stages) - 1)
    bottleneck = max(score_plan(problem, plan).compute_s)
    for link in range(len(codecs)):
        for codec in allowed:
            codecs[link] = codec
            if score_plan(with_codecs(problem, plan, codecs), plan).link_s[link] <= bottleneck:
                break
        else:
            codecs[link] = min(allowed, key=lambda c: RATIO[c])
    return codecs


def plan_with_codecs(
    problem: PlanningProblem,
    search: Callable[[PlanningProblem], Plan | None],
    allowed: Sequence[str] = DEFAULT_ALLOWED,
) -> CodecChoice | None:
    """The best plan and its link codecs over every allowed codec (see the module).

    ``search`` plans a problem (``None``: nothing fits). Returns ``None`` when no
    codec gives a feasible plan.
    """
    _check(allowed)
    best: CodecChoice | None = None
    for codec in allowed:
        plan = search(_scaled(problem, codec))
        if plan is None:
            continue
        codecs = choose_codecs(problem, plan, allowed)
        plan = Plan(plan.stages, tuple(codecs))
        score = score_plan(with_codecs(problem, plan, codecs), plan)
        if not score.feasible:
            continue
        if best is None or score.step_time_s < best.score.step_time_s * (1 - 1e-9):
            best = CodecChoice(plan, codecs, score)
    return best
