"""Choosing the codec of every link of a plan: compress a link only where it pays.

The spec's score (``shared/spec/planning.md``) prices a link by the bytes of
the activation crossing it; a codec (:class:`edge.wire.frames.Codec`) shrinks those
bytes, both ways (activations forward, their gradients back), by
:data:`~coordinator.planner.score.CODEC_RATIO` and costs accuracy: fp32 is exact,
bf16 and fp16 round to 8 or 11 bits of mantissa, int8 quantises with one scale per
tensor. AccEPT's
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
(:func:`~coordinator.planner.score.for_plan` of a plan that carries its codecs),
so any result can be checked with a calculator. Both take the stages' fixed
shares, where a plan has them (the holders of local data, whose U-shaped plans
compress their links too: :func:`~coordinator.planner.partition.plan_holders_job`).

Tested in tests/unit/coordinator/planner/test_codecs.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from coordinator.planner.score import CODEC_RATIO, Plan, PlanScore, for_plan, score_plan
from edge.problem import PlanningProblem

__all__ = [
    "DEFAULT_ALLOWED",
    "CodecChoice",
    "choose_codecs",
    "plan_with_codecs",
]

DEFAULT_ALLOWED = ("fp32", "bf16", "int8")
"""Most precise first. bf16 over fp16: gradients keep fp32's range."""

Shares = Mapping[int, Sequence[float]]
"""The fixed shares of a plan's stages (:func:`~coordinator.planner.score.score_plan`)."""


@dataclass(frozen=True)
class CodecChoice:
    """A plan, the codec of each of its links, and its score under those codecs."""

    plan: Plan
    codecs: list[str]
    score: PlanScore


def _check(allowed: Sequence[str]) -> None:
    if not allowed:
        raise ValueError("no codec allowed")
    unknown = [c for c in allowed if c not in CODEC_RATIO]
    if unknown:
        raise ValueError(f"unknown codecs {unknown}; known: {sorted(CODEC_RATIO)}")


def _scaled(problem: PlanningProblem, codec: str) -> PlanningProblem:
    layers = [
        unit.model_copy(update={"out_bytes": unit.out_bytes * CODEC_RATIO[codec]})
        for unit in problem.layers
    ]
    return problem.model_copy(update={"layers": layers})


def _coded(
    problem: PlanningProblem, plan: Plan, codecs: Sequence[str], shares: Shares | None
) -> PlanScore:
    """``plan``'s score with ``codecs`` on its links."""
    coded = replace(plan, codecs=tuple(codecs))
    return score_plan(for_plan(problem, coded), coded, fixed_shares=shares)


def choose_codecs(
    problem: PlanningProblem,
    plan: Plan,
    allowed: Sequence[str] = DEFAULT_ALLOWED,
    *,
    fixed_shares: Shares | None = None,
) -> list[str]:
    """Per link of ``plan``: the first of ``allowed`` that keeps it off the critical path,
    no longer than the slowest stage's compute (a U-shaped plan's holders compute both
    ends); ``fixed_shares`` as :func:`~coordinator.planner.score.score_plan` takes them."""
    _check(allowed)
    codecs = [allowed[0]] * (len(plan.stages) - 1)
    compute = _coded(problem, plan, codecs, fixed_shares).compute_s
    bottleneck = max([*compute, compute[0] + compute[-1]] if plan.u_shaped else compute)
    for link in range(len(codecs)):
        for codec in allowed:
            codecs[link] = codec
            if _coded(problem, plan, codecs, fixed_shares).link_s[link] <= bottleneck:
                break
        else:
            codecs[link] = min(allowed, key=lambda c: CODEC_RATIO[c])
    return codecs


def plan_with_codecs(
    problem: PlanningProblem,
    search: Callable[[PlanningProblem], Plan | None],
    allowed: Sequence[str] = DEFAULT_ALLOWED,
    *,
    fixed_shares: Callable[[Plan], Shares] | None = None,
) -> CodecChoice | None:
    """The best plan and its link codecs over every allowed codec (see the module).

    ``search`` plans a problem (``None``: nothing fits), ``problem`` itself for a codec
    that keeps every byte (a search it has run already can be reused); ``fixed_shares``
    gives a plan's fixed shares, where its stages have them. Returns ``None`` when no
    codec gives a feasible plan.
    """
    _check(allowed)
    best: CodecChoice | None = None
    for codec in allowed:
        plan = search(problem if CODEC_RATIO[codec] == 1.0 else _scaled(problem, codec))
        if plan is None:
            continue
        shares = fixed_shares(plan) if fixed_shares is not None else None
        codecs = choose_codecs(problem, plan, allowed, fixed_shares=shares)
        plan = replace(plan, codecs=tuple(codecs))
        score = score_plan(for_plan(problem, plan), plan, fixed_shares=shares)
        if not score.feasible:
            continue
        if best is None or score.step_time_s < best.score.step_time_s * (1 - 1e-9):
            best = CodecChoice(plan, codecs, score)
    return best
