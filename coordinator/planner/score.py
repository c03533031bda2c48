"""Plans and their score, exactly as ``shared/spec/planning.md`` defines them.

A :class:`Plan` is a list of stages ``(device, start, end)``; :func:`score_plan`
computes, with the spec's formulas and nothing else, each stage's compute time
per microbatch ``T_s``, each link's time ``C_s``, each stage's 1F1B memory, the
bottleneck ``tau`` and the step time ``(M - 1) * tau + sum(T) + sum(C)``. Every
planner and baseline is judged by this one function, so any plan can be checked
by anyone with a calculator.

The search does not call this per candidate (it works on prefix sums, see
:mod:`coordinator.planner.tables`), but every plan it returns is re-scored here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from edge.problem import PlanningProblem

__all__ = ["Plan", "PlanScore", "Stage", "score_plan", "validate_plan"]


@dataclass(frozen=True)
class Stage:
    """Stage ``s`` runs layers ``start..end-1`` on ``device``."""

    device: str
    start: int
    end: int


@dataclass(frozen=True)
class Plan:
    stages: tuple[Stage, ...]
    codecs: tuple[str, ...] | None = None
    """Each link's codec when the planner chose them (:mod:`coordinator.planner.codecs`);
    ``None``: the job's codec on every link. The score never reads it."""

    @classmethod
    def of(cls, *stages: tuple[str, int, int]) -> Plan:
        return cls(tuple(Stage(*s) for s in stages))

    def to_json(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [
            {"device": s.device, "layers": [s.start, s.end]} for s in self.stages
        ]
        for stage, codec in zip(out, self.codecs or (), strict=False):
            stage["codec_out"] = codec  # the link to the next stage
        return out


@dataclass(frozen=True)
class PlanScore:
    """The spec's figures for one plan; times in seconds, memory in bytes."""

    plan: Plan
    compute_s: list[float]
    """``T_s``: compute per microbatch of each stage."""
    link_s: list[float]
    """``C_s``: per microbatch, between stage ``s`` and ``s + 1``."""
    memory_bytes: list[float]
    memory_limit_bytes: list[float]
    bottleneck_s: float
    step_time_s: float
    throughput_sps: float
    feasible: bool
    reasons: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The object ``edgetrain plan --json`` prints for a feasible plan."""
        return {
            "stages": self.plan.to_json(),
            "step_time_s": self.step_time_s,
            "bottleneck_s": self.bottleneck_s,
            "throughput_sps": self.throughput_sps if math.isfinite(self.throughput_sps) else None,
            "feasible": self.feasible,
        }


def _sum(values: Iterable[float]) -> float:
    """Left-to-right float sum: what :mod:`coordinator.planner.tables` reproduces exactly.

    Python 3.12's ``sum()`` compensates rounding, so it is not used here: the
    search's feasibility must agree with the score to the last bit on every version.
    """
    total = 0.0
    for v in values:
        total += v
    return total


def validate_plan(problem: PlanningProblem, plan: Plan) -> list[str]:
    """What makes ``plan`` structurally invalid for ``problem`` (empty when valid)."""
    errors = []
    ids = {d.id for d in problem.devices}
    if not plan.stages:
        return ["plan has no stages"]
    expect = 0
    for s, st in enumerate(plan.stages):
        if st.device not in ids:
            errors.append(f"stage {s}: unknown device {st.device!r}")
        if st.start != expect or st.end <= st.start:
            errors.append(f"stage {s}: layers [{st.start}, {st.end}) do not continue at {expect}")
        expect = st.end
    if expect != len(problem.layers):
        errors.append(f"plan covers {expect} of {len(problem.layers)} layers")
    used = [st.device for st in plan.stages]
    if len(set(used)) != len(used):
        errors.append("a device appears in two stages")
    if problem.pin_first is not None and plan.stages[0].device != problem.pin_first:
        errors.append(f"stage 0 is on {plan.stages[0].device}, not pin_first {problem.pin_first}")
    return errors


def score_plan(problem: PlanningProblem, plan: Plan) -> PlanScore:
    """Score ``plan`` with the spec's formulas; structural errors raise ``ValueError``."""
    errors = validate_plan(problem, plan)
    if errors:
        raise ValueError("; ".join(errors))
    dev = {d.id: d for d in problem.devices}
    layers = problem.layers
    b = problem.batch_size / problem.microbatches
    m = problem.microbatches
    n_stages = len(plan.stages)
    compute, links, memory, limits, reasons = [], [], [], [], []
    for s, st in enumerate(plan.stages):
        d = dev[st.device]
        chunk = layers[st.start : st.end]
        compute.append(b * _sum(unit.train_flops for unit in chunk) / (d.gflops * 1e9))
        params = _sum(unit.param_bytes for unit in chunk)
        acts = _sum(unit.saved_bytes for unit in chunk)
        mem = problem.optimizer_state_factor * params + min(n_stages - s, m) * b * acts
        memory.append(mem)
        limits.append(d.memory_bytes)
        if mem > d.memory_bytes:
            reasons.append(
                f"stage {s} on {d.id} needs {mem / 1e9:.3f} GB of {d.memory_bytes / 1e9:.3f} GB"
            )
        if s + 1 < n_stages:
            e = dev[plan.stages[s + 1].device]
            out = layers[st.end - 1].out_bytes
            links.append(
                2 * (d.latency_ms + e.latency_ms) / 1000
                + 2 * b * out * 8 / (min(d.bandwidth_mbps, e.bandwidth_mbps) * 1e6)
            )
    tau = max(compute + links)
    step = (m - 1) * tau + _sum(compute) + _sum(links)
    # A problem of zero-FLOP layers and free links takes no time at all.
    throughput = problem.batch_size / step if step > 0 else math.inf
    return PlanScore(
        plan=plan,
        compute_s=compute,
        link_s=links,
        memory_bytes=memory,
        memory_limit_bytes=limits,
        bottleneck_s=tau,
        step_time_s=step,
        throughput_sps=throughput,
        feasible=not reasons,
        reasons=reasons,
    )
