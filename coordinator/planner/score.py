"""Plans and their score, exactly as ``shared/spec/planning.md`` and
``planning-v2.md`` define them.

A :class:`Plan` is a list of stages ``(devices, start, end)``: one device, or in
version 2 a group that trains the stage data-parallel, each member on a share of
every microbatch proportional to its speed. :func:`score_plan` computes, with
the spec's formulas and nothing else, each stage's compute time per microbatch
``T_s``, each link's time ``C_s``, each group's all-reduce ``R_s``, each
member's 1F1B memory, the bottleneck ``tau``, the step time
``(M - 1) * tau + sum(T) + sum(C) + max(R)`` and the energy per step. A plan of
one-device stages scores, to the last bit, as version 1 scores it. Every
planner and baseline is judged by this one function, so any plan can be checked
by anyone with a calculator.

The terms themselves (``T_s``, ``C_s``, ``R_s``, memory, a group's figures) are
:mod:`coordinator.planner.terms`'s functions, which the search's tables call
too, so both get the same bits ([Note: one formula, two kinds of number]). The
search does not call this per candidate (it works on prefix sums, see
:mod:`coordinator.planner.tables`), but every plan it returns is re-scored here.

Tested in tests/unit/coordinator/planner/test_planner_exact.py,
tests/unit/coordinator/planner/test_terms.py and tests/integration/test_plan_cli.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from coordinator.planner.terms import (
    allreduce_s,
    compute_s,
    group_bandwidth_mbps,
    group_gflops,
    group_latency_ms,
    link_s,
    need_bytes,
    ordered_sum,
)
from edge.problem import DeviceSpec, PlanningProblem

__all__ = [
    "CODEC_RATIO",
    "Plan",
    "PlanScore",
    "Stage",
    "for_plan",
    "member_needs",
    "member_seconds",
    "score_plan",
    "shares_of",
    "validate_plan",
    "with_codecs",
]


@dataclass(frozen=True)
class Stage:
    """Stage ``s`` runs layers ``start..end-1`` on ``device``, and in a version 2 plan
    also on ``helpers``: the group ``devices`` trains the stage data-parallel."""

    device: str
    start: int
    end: int
    helpers: tuple[str, ...] = ()
    """The group's other members, after ``device`` (its first); empty for one device."""

    @property
    def devices(self) -> tuple[str, ...]:
        """Every member of the stage's group, ``device`` first."""
        return (self.device, *self.helpers)

    @classmethod
    def group(cls, devices: tuple[str, ...] | list[str], start: int, end: int) -> Stage:
        """The stage of ``devices`` (one or more) over layers ``start..end-1``."""
        return cls(devices[0], start, end, tuple(devices[1:]))


@dataclass(frozen=True)
class Plan:
    stages: tuple[Stage, ...]
    codecs: tuple[str, ...] | None = None
    """Each link's codec when the planner chose them (:mod:`coordinator.planner.codecs`);
    ``None``: the job's codec on every link. The score never reads it: a plan is scored
    as the runtime runs it on :func:`for_plan`'s problem, which scales the links' bytes."""
    u_shaped: bool = False
    """The last stage runs on stage 0's devices again, in the same order (labels that stay
    home: :mod:`coordinator.planner.holders`): they hold two segments each, so they
    compute, hold memory and all-reduce for both (see :func:`score_plan`)."""

    @classmethod
    def of(cls, *stages: tuple[str, int, int]) -> Plan:
        return cls(tuple(Stage(*s) for s in stages))

    @property
    def grouped(self) -> bool:
        """Whether a stage runs on more than one device."""
        return any(s.helpers for s in self.stages)

    @property
    def devices(self) -> list[str]:
        """Every device of the plan, stage by stage."""
        return [d for s in self.stages for d in s.devices]

    def to_json(self, shares: list[list[float]] | None = None) -> list[dict[str, Any]]:
        """Version 1's stage objects; a group's stage (or any stage, given ``shares``)
        also carries ``devices`` and ``shares``."""
        out: list[dict[str, Any]] = []
        for s, st in enumerate(self.stages):
            stage: dict[str, Any] = {"layers": [st.start, st.end]}
            if st.helpers or shares is not None:
                stage["devices"] = list(st.devices)
                if shares is not None:
                    stage["shares"] = shares[s]
            if not st.helpers:
                stage["device"] = st.device
            out.append(stage)
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
    """The 1F1B memory of each stage's most loaded member (relative to its limit)."""
    memory_limit_bytes: list[float]
    bottleneck_s: float
    step_time_s: float
    throughput_sps: float
    feasible: bool
    reasons: list[str] = field(default_factory=list)
    version: int = 1
    shares: list[list[float]] = field(default_factory=list)
    """Each stage's members' shares of a microbatch (``[1.0]`` for one device)."""
    allreduce_s: list[float] = field(default_factory=list)
    """``R_s``: each stage's gradient all-reduce per step (0 for one device)."""
    energy_j_per_step: float = 0.0
    """Version 2's ``E``: joules per step from the devices' power figures."""
    batch_size: float = 1.0

    @property
    def energy_j_per_sample(self) -> float:
        return self.energy_j_per_step / self.batch_size

    def objective(self, minimize: str = "time") -> tuple[float, float]:
        """The sort key of the objective: ``(step time, 0)`` or ``(energy, step time)``."""
        if minimize == "energy":
            return (self.energy_j_per_step, self.step_time_s)
        return (self.step_time_s, 0.0)

    def to_json(self) -> dict[str, Any]:
        """The object ``edgetrain plan --json`` prints for a feasible plan."""
        out = {
            "stages": self.plan.to_json(self.shares if self.version == 2 else None),
            "step_time_s": self.step_time_s,
            "bottleneck_s": self.bottleneck_s,
            "throughput_sps": self.throughput_sps if math.isfinite(self.throughput_sps) else None,
        }
        if self.version == 2:
            out["allreduce_s"] = max(self.allreduce_s, default=0.0)
            out["energy_j_per_step"] = self.energy_j_per_step
            out["energy_j_per_sample"] = self.energy_j_per_sample
        if self.plan.u_shaped:  # the last stage is stage 0's devices again
            out["u_shaped"] = True
        out["feasible"] = self.feasible
        return out


def validate_plan(problem: PlanningProblem, plan: Plan) -> list[str]:
    """What makes ``plan`` structurally invalid for ``problem`` (empty when valid)."""
    errors = []
    ids = {d.id for d in problem.devices}
    if not plan.stages:
        return ["plan has no stages"]
    expect = 0
    for s, st in enumerate(plan.stages):
        for device in st.devices:
            if device not in ids:
                errors.append(f"stage {s}: unknown device {device!r}")
        if st.helpers and not problem.allows_groups:
            why = "version 1" if problem.version == 1 else '"groups": false'
            errors.append(f"stage {s}: a group of {len(st.devices)} devices under {why}")
        if st.start != expect or st.end <= st.start:
            errors.append(f"stage {s}: layers [{st.start}, {st.end}) do not continue at {expect}")
        expect = st.end
    if expect != len(problem.layers):
        errors.append(f"plan covers {expect} of {len(problem.layers)} layers")
    used = plan.devices
    if plan.u_shaped:
        first, last = plan.stages[0].devices, plan.stages[-1].devices
        if len(plan.stages) < 3 or first != last:
            errors.append("a U-shaped plan ends on stage 0's devices, with a stage between")
        used = used[: len(used) - len(last)]
    if len(set(used)) != len(used):
        errors.append("a device appears in two stages")
    if problem.pin_first is not None and problem.pin_first not in plan.stages[0].devices:
        errors.append(f"stage 0 is on {plan.stages[0].device}, not pin_first {problem.pin_first}")
    return errors


CODEC_RATIO = {"fp32": 1.0, "bf16": 0.5, "fp16": 0.5, "int8": 0.25}
"""Bytes a codec puts on the wire per fp32 byte (int8's one scale per tensor is
negligible); :mod:`coordinator.planner.codecs` chooses among them."""


def with_codecs(problem: PlanningProblem, plan: Plan, codecs: Sequence[str]) -> PlanningProblem:
    """``problem`` with the output bytes of each link's last unit scaled by its codec."""
    if len(codecs) != len(plan.stages) - 1:
        raise ValueError(f"{len(codecs)} codecs for {len(plan.stages) - 1} links")
    layers = list(problem.layers)
    for stage, codec in zip(plan.stages, codecs, strict=False):
        i = stage.end - 1
        layers[i] = layers[i].model_copy(
            update={"out_bytes": layers[i].out_bytes * CODEC_RATIO[codec]}
        )
    return problem.model_copy(update={"layers": layers})


def for_plan(problem: PlanningProblem, plan: Plan) -> PlanningProblem:
    """``problem`` as a plan of the runtime is scored: as version 2 when the plan has
    groups (a job's problem is version 1 unless it has an objective), and with each
    link's bytes as its codec sends them when the plan carries its codecs
    (:attr:`Plan.codecs`, which :func:`score_plan` itself never reads). Pass the
    problem as built, not one already scaled: the codecs would count twice."""
    if plan.grouped and problem.version == 1:
        problem = problem.as_version(2)
    return with_codecs(problem, plan, plan.codecs) if plan.codecs else problem


def score_plan(
    problem: PlanningProblem,
    plan: Plan,
    *,
    fixed_shares: Mapping[int, Sequence[float]] | None = None,
) -> PlanScore:
    """Score ``plan`` with the spec's formulas; structural errors raise ``ValueError``.

    ``fixed_shares`` fixes the members' shares of the stages it names, where the runtime splits
    by something else than speed (the data each holder has, for data that stays home):
    such a stage computes for as long as its slowest member, ``max_i w_i b F / gflops_i``.
    Without it (as for every problem file) the shares are the spec's, by speed.

    A U-shaped plan (:attr:`Plan.u_shaped`) is scored with the same formulas, its last
    stage being one more stage, and three figures for what its devices hold twice: each
    must fit both segments' memory; the bottleneck is at least ``T_0 + T_last`` (they
    compute both, one microbatch at a time); the all-reduce is at least ``R_0 + R_last``.
    """
    fixed = dict(fixed_shares or {})
    errors = validate_plan(problem, plan)
    if errors:
        raise ValueError("; ".join(errors))
    dev = {d.id: d for d in problem.devices}
    layers = problem.layers
    b = problem.batch_size / problem.microbatches
    m = problem.microbatches
    n_stages = len(plan.stages)
    compute, links, memory, limits, reasons = [], [], [], [], []
    shares: list[list[float]] = []
    allreduce: list[float] = []
    busy: list[tuple[DeviceSpec, float]] = []  # each member and its busy seconds per step
    for s, st in enumerate(plan.stages):
        group = [dev[i] for i in st.devices]
        share = list(fixed[s]) if s in fixed else shares_of(group)
        if len(share) != len(group) or abs(ordered_sum(share) - 1.0) > 1e-9 or min(share) <= 0:
            raise ValueError(f"stage {s}: shares {share} do not split a microbatch over its group")
        shares.append(share)
    # 1F1B: stage s holds min(S - s, M) microbatches in flight
    needs = member_needs(problem, plan, shares, [min(n_stages - s, m) for s in range(n_stages)])
    for s, st in enumerate(plan.stages):
        group = [dev[i] for i in st.devices]
        speed = group_gflops(group)
        share = shares[s]
        chunk = layers[st.start : st.end]
        flops = ordered_sum(unit.train_flops for unit in chunk)
        if s in fixed:
            slowest = max(w / d.gflops for d, w in zip(group, share, strict=True))
            compute.append(b * flops * slowest / 1e9)
        else:
            compute.append(compute_s(b, flops, speed))
        params = ordered_sum(unit.param_bytes for unit in chunk)
        # The member with the least room decides; one device: version 1's figure exactly.
        need = needs[s]
        tight = max(range(len(group)), key=lambda i: need[i] / group[i].memory_bytes)
        memory.append(need[tight])
        limits.append(group[tight].memory_bytes)
        for d, mem in zip(group, need, strict=True):
            if mem > d.memory_bytes:
                reasons.append(
                    f"stage {s} on {d.id} needs {mem / 1e9:.3f} GB of {d.memory_bytes / 1e9:.3f} GB"
                )
        busy.extend(
            (d, compute_s(m * w * b, flops, d.gflops)) for d, w in zip(group, share, strict=True)
        )
        allreduce.append(allreduce_s(group, params))
        if s + 1 < n_stages:
            nxt = [dev[i] for i in plan.stages[s + 1].devices]
            nxt_share = list(fixed[s + 1]) if s + 1 in fixed else shares_of(nxt)
            out = layers[st.end - 1].out_bytes
            links.append(
                link_s(
                    b,
                    out,
                    group_latency_ms(group),
                    group_latency_ms(nxt),
                    group_bandwidth_mbps(group, share),
                    group_bandwidth_mbps(nxt, nxt_share),
                )
            )
    both = [compute[0] + compute[-1]] if plan.u_shaped else []
    tau = max(compute + links + both)
    step = (m - 1) * tau + ordered_sum(compute) + ordered_sum(links)
    if problem.version == 2:
        step += max(allreduce + ([allreduce[0] + allreduce[-1]] if plan.u_shaped else []))
    # A problem of zero-FLOP layers and free links takes no time at all.
    throughput = problem.batch_size / step if step > 0 else math.inf
    if plan.u_shaped:  # a device of both ends: busy for both, idle once
        per: dict[str, tuple[DeviceSpec, float]] = {}
        for d, u in busy:
            per[d.id] = (d, per[d.id][1] + u if d.id in per else u)
        busy = list(per.values())
    energy = ordered_sum(
        (d.watts_busy or 0.0) * u + (d.watts_idle or 0.0) * (step - u) for d, u in busy
    )
    deadline = problem.goal.max_step_time_s
    if deadline is not None and step > deadline:
        reasons.append(f"step time {step:.6g} s exceeds max_step_time_s {deadline:.6g} s")
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
        version=problem.version,
        shares=shares,
        allreduce_s=allreduce,
        energy_j_per_step=energy,
        batch_size=problem.batch_size,
    )


def member_needs(
    problem: PlanningProblem,
    plan: Plan,
    shares: Sequence[Sequence[float]],
    held: Sequence[int],
) -> list[list[float]]:
    """Each stage's members' memory in bytes, ``held[s]`` microbatches in flight on stage
    ``s`` and each member at its share of a microbatch's rows
    (:func:`~coordinator.planner.terms.need_bytes`); a U-shape's tail also holds the head
    (its devices are stage 0's). The same sums in the same order wherever it is asked,
    so the score's figure and a schedule's check
    (:func:`~coordinator.planner.simulator.memory_error`) agree to the bit."""
    b, k = problem.batch_size / problem.microbatches, problem.optimizer_state_factor
    out: list[list[float]] = []
    for s, st in enumerate(plan.stages):
        chunk = problem.layers[st.start : st.end]
        params = ordered_sum(unit.param_bytes for unit in chunk)
        acts = ordered_sum(unit.saved_bytes for unit in chunk)
        need = [need_bytes(k, params, held[s], w, b, acts) for w in shares[s]]
        if plan.u_shaped and s == len(plan.stages) - 1:
            need = [mine + first for mine, first in zip(need, out[0], strict=True)]
        out.append(need)
    return out


def shares_of(group: list[DeviceSpec]) -> list[float]:
    """Each member's share of a microbatch: proportional to its speed (``[1.0]`` alone)."""
    if len(group) == 1:
        return [1.0]
    speed = group_gflops(group)
    return [d.gflops / speed for d in group]


def member_seconds(problem: PlanningProblem, score: PlanScore) -> list[list[float]]:
    """Per stage of ``score``'s plan, each member's compute per microbatch at its share of
    the rows and its own speed (the spec's: the slowest member's is ``T_s``)."""
    b = problem.batch_size / problem.microbatches
    dev = {d.id: d for d in problem.devices}
    members = []
    for st, shares in zip(score.plan.stages, score.shares, strict=True):
        flops = ordered_sum(unit.train_flops for unit in problem.layers[st.start : st.end])
        members.append(
            [
                compute_s(w * b, flops, dev[i].gflops)
                for i, w in zip(st.devices, shares, strict=True)
            ]
        )
    return members
