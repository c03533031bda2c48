"""Version 2's cost terms per device group, as arrays for the group search.

In the version 2 score (``shared/spec/planning-v2.md``) a group of devices acts
as one device whose speed is its members' sum, whose link latency is its
slowest member's and whose link bandwidth is the least ``bw_i / w_i``; its
memory is checked per member, and it adds a ring all-reduce once per step.
:class:`GroupTables` holds, for every group the search asks about (a tuple of
device indices, cached), those figures and its ``[L+1, L+1]`` arrays over unit
ranges ``[h, i)``: compute time per microbatch, all-reduce time, energy
coefficient and the 1F1B fit at each distance from the end. The terms are
:func:`coordinator.planner.score.score_plan`'s own functions
(:mod:`coordinator.planner.terms`) on arrays, so a one-device group reproduces
version 1's tables and the search agrees with the score to the last bit
([Note: one formula, two kinds of number]).

:class:`GroupLimits` is what a runtime cannot train on a group and a problem
file does not say (units holding BatchNorm, members left without a sample): the
fit arrays of a group of several devices exclude it, so every search that reads
them (exact, structured, re-plan, data parallel only) honours it. Problem files
are scored without it, exactly as the spec says.

Tested in tests/unit/coordinator/planner/test_groups_exact.py and
tests/unit/coordinator/planner/test_terms.py (the score's bits).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from coordinator.planner.score import Plan, Stage, shares_of
from coordinator.planner.tables import range_sums
from coordinator.planner.terms import (
    allreduce_s,
    compute_s,
    group_bandwidth_mbps,
    group_gflops,
    group_latency_ms,
    link_s,
    need_bytes,
)
from edge.problem import PlanningProblem
from edge.wire.groups import split_samples

__all__ = ["Group", "GroupCosts", "GroupLimits", "GroupTables"]

Group = tuple[int, ...]
"""A group: device indices into the problem's ``devices``, in the plan's member order."""


@dataclass(frozen=True)
class GroupLimits:
    """What a group of several devices may not train, beyond the problem's own terms
    (internal to the planner: not a problem-file field)."""

    solo_units: frozenset[int] = frozenset()
    """Units only a one-device stage may hold (a unit with BatchNorm: a group's statistics
    would cover a member's share, not the microbatch)."""
    whole_samples: bool = False
    """Every member gets at least one sample of each microbatch, split by its share as the
    runtime splits it (:func:`edge.wire.groups.split_samples`)."""

    def allows(self, problem: PlanningProblem, plan: Plan) -> bool:
        """Whether every group of ``plan`` keeps within these limits."""
        ids = {d.id: d for d in problem.devices}
        for st in plan.stages:
            if len(st.devices) == 1:
                continue
            if self.solo_units & set(range(st.start, st.end)):
                return False
            if not _splits(problem, [ids[d].gflops for d in st.devices], self.whole_samples):
                return False
        return True


def _splits(problem: PlanningProblem, speeds: list[float], whole_samples: bool) -> bool:
    """Whether a microbatch splits into a sample or more per member (always, unless
    ``whole_samples``; a fractional microbatch is not checked)."""
    b = problem.batch_size / problem.microbatches
    if not whole_samples or b != int(b):
        return True
    try:
        split_samples(int(b), speeds)
    except ValueError:
        return False
    return True


@dataclass
class GroupCosts:
    """One group's figures and arrays (``L`` units, ranges ``[h, i)``)."""

    members: Group
    speed: float
    latency_ms: float
    bandwidth_mbps: float
    """The least ``bw_i / w_i``: the rate at which the group moves a whole microbatch."""
    compute: np.ndarray
    """``[L+1, L+1]``: ``T`` of a range (``inf`` where ``i <= h``)."""
    allreduce: np.ndarray
    """``[L+1, L+1]``: ``R`` of a range (0 for one device)."""
    energy: np.ndarray
    """``[L+1, L+1]``: ``sum_i (watts_busy_i - watts_idle_i) * u_i`` per step for a range."""
    idle_w: float
    """The members' idle watts, summed: each pays it for the whole step."""
    _fits: dict[int, np.ndarray] = field(default_factory=dict)
    _terms: dict[int, np.ndarray] = field(default_factory=dict)


@dataclass
class GroupTables:
    """Cost arrays of one problem, built per group on demand."""

    problem: PlanningProblem
    b: float
    m: int
    flops: np.ndarray
    params: np.ndarray
    acts: np.ndarray
    out: np.ndarray
    """``[L+1]``: ``out[i]`` is what crosses a cut before unit ``i``."""
    grouped_ok: np.ndarray
    """``[L+1, L+1]``: range ``[h, i)`` holds no solo unit (``limits.solo_units``)."""
    limits: GroupLimits = field(default_factory=GroupLimits)
    _groups: dict[Group, GroupCosts] = field(default_factory=dict)

    @classmethod
    def build(cls, problem: PlanningProblem, limits: GroupLimits | None = None) -> GroupTables:
        layers = problem.layers
        limits = limits or GroupLimits()
        solo = range_sums([1.0 if j in limits.solo_units else 0.0 for j in range(len(layers))])
        return cls(
            problem=problem,
            b=problem.batch_size / problem.microbatches,
            m=problem.microbatches,
            flops=range_sums([unit.train_flops for unit in layers]),
            params=range_sums([unit.param_bytes for unit in layers]),
            acts=range_sums([unit.saved_bytes for unit in layers]),
            out=np.array([0.0] + [unit.out_bytes for unit in layers]),
            grouped_ok=solo == 0,
            limits=limits,
        )

    @property
    def num_units(self) -> int:
        return len(self.problem.layers)

    @property
    def num_devices(self) -> int:
        return len(self.problem.devices)

    def costs(self, group: Group) -> GroupCosts:
        """The figures of ``group`` (computed once per group)."""
        got = self._groups.get(group)
        if got is not None:
            return got
        devs = [self.problem.devices[i] for i in group]
        shares = shares_of(devs)
        speed = group_gflops(devs)
        with np.errstate(invalid="ignore"):
            compute = compute_s(self.b, self.flops, speed)
        allreduce = allreduce_s(devs, self.params)
        energy = np.zeros_like(self.flops)
        for d, w in zip(devs, shares, strict=True):
            watts = (d.watts_busy or 0.0) - (d.watts_idle or 0.0)
            if watts:
                with np.errstate(invalid="ignore"):
                    energy = energy + watts * compute_s(self.m * w * self.b, self.flops, d.gflops)
        got = GroupCosts(
            members=group,
            speed=speed,
            latency_ms=group_latency_ms(devs),
            bandwidth_mbps=group_bandwidth_mbps(devs, shares),
            compute=compute,
            allreduce=np.where(np.isfinite(compute), allreduce, np.inf),
            energy=energy,
            idle_w=sum(d.watts_idle or 0.0 for d in devs),
        )
        if len(self._groups) > 4096:  # a bounded cache: the search revisits few groups
            self._groups.clear()
        self._groups[group] = got
        return got

    def fits(self, group: Group, position_from_end: int) -> np.ndarray:
        """``[L+1, L+1]`` booleans: every member of ``group`` holds range ``[h, i)`` as the
        stage that many stages from the end (the score's per-member 1F1B check)."""
        c = self.costs(group)
        depth = min(position_from_end, self.m)
        got = c._fits.get(depth)
        if got is None:
            devs = [self.problem.devices[i] for i in group]
            k = self.problem.optimizer_state_factor
            got = np.ones_like(self.params, dtype=bool)
            for d, w in zip(devs, shares_of(devs), strict=True):
                got &= need_bytes(k, self.params, depth, w, self.b, self.acts) <= d.memory_bytes
            if len(group) > 1:  # the runtime's limits on groups
                got &= self.grouped_ok
                if not _splits(self.problem, [d.gflops for d in devs], self.limits.whole_samples):
                    got[:] = False
            c._fits[depth] = got
        return got

    def stage_terms(self, group: Group, position_from_end: int) -> np.ndarray:
        """``[L+1, L+1]``: ``compute + allreduce`` of ``group`` holding range ``[h, i)``
        that many stages from the end, ``inf`` where a member cannot hold it
        (:meth:`fits`); cached."""
        c = self.costs(group)
        depth = min(position_from_end, self.m)
        got = c._terms.get(depth)
        if got is None:
            got = np.where(self.fits(group, depth), c.compute + c.allreduce, np.inf)
            c._terms[depth] = got
        return got

    def link(self, a: Group, b: Group) -> np.ndarray:
        """``[L+1]``: ``C`` of a cut before unit ``i`` from group ``a`` to group ``b``."""
        ca, cb = self.costs(a), self.costs(b)
        return link_s(
            self.b, self.out, ca.latency_ms, cb.latency_ms, ca.bandwidth_mbps, cb.bandwidth_mbps
        )

    def plan(self, groups: list[Group], cuts: list[int]) -> Plan:
        """The plan of ``groups`` over the ranges between ``cuts`` (``0 .. L``)."""
        ids = [d.id for d in self.problem.devices]
        return Plan(
            tuple(
                Stage.group([ids[i] for i in g], h, e)
                for g, h, e in zip(groups, cuts, cuts[1:], strict=False)
            )
        )
