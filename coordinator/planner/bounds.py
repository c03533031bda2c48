"""A lower bound on the step time of any plan, to judge a plan by: its certificate.

Notation as in ``shared/spec/planning.md``: ``b = B / M``, ``w_l`` the training
FLOPs per sample of unit ``l``, ``W = sum(w_l)``, ``g_max`` the fastest device,
``G`` the sum of all devices' speeds (FLOP/s).

Without ``pin_first``:

- ``sum(T_s) >= b W / g_max``: moving any range to the fastest device never
  makes its time larger;
- ``tau >= b W / G``: if every stage took less, the stages together would
  process ``b W`` FLOPs in less than ``b W / G`` at a total rate of at most ``G``;
- ``tau >= b w_max / g_max``: the heaviest unit runs on some device;
- ``sum(C_s) >= 0``.

So ``step >= (M - 1) * max(b W / G, b w_max / g_max) + b W / g_max``.

With ``pin_first = p``, stage 0 holds unit 0 on ``p``, so ``tau >= b w_0 / g_p``
and ``sum(T_s) >= b w_0 / g_p + b (W - w_0) / g_max``. A one-stage plan is then
``p`` alone, with step ``M b W / g_p``. A plan with two or more stages has a
link out of ``p`` after some unit ``k``, costing at least
``C_min = min over k of 2 (lat_p + lat_min) / 1000 + 2 b out_k 8 / (min(bw_p, bw_max) 1e6)``,
which is both a term of the sum and a candidate for ``tau``. The bound is the
smaller of the two cases. Memory limits are ignored, so the bound holds for
every feasible plan. Each term is :mod:`coordinator.planner.terms`'s, the score's own.

[Note: the bound with groups]
In a version 2 problem that allows groups, a plan with no group is a version 1 plan
(every ``R_s`` is 0), so the bound above holds for it. A plan with a group of ``g >= 2``
devices has

- ``sum(T_s) >= b W / G`` and ``tau >= b W / G``: stage ``s`` computes ``b W_s`` FLOPs at
  its group's speed ``G_s``, and the groups are disjoint, so ``sum(G_s) <= G``; hence
  ``(M - 1) tau + sum(T_s) >= M b W / G``;
- ``max(R_s) >= R_min = 2 lat_(2) / 1000 + p_min 8 / (bw_(2) 1e6)``: the group's slowest
  latency is at least the second smallest of the fleet's, ``lat_(2)``, its least
  bandwidth at most the second largest, ``bw_(2)``, it holds at least one unit's
  parameters (``p_min`` the fewest), and ``2 (g - 1) >= 2``, ``2 (g - 1) / g >= 1``.

So such a plan's step is at least ``M b W / G + R_min``, and the bound is the smaller
of that and version 1's. Memory and ``pin_first`` are ignored (they only remove plans).

:func:`certificate` gives a plan its bound and its gap, ``step / bound - 1``: 0 is a
plan proved optimal, 0.25 one at most 25% slower than the best plan could be.

Tested in tests/unit/coordinator/planner/test_baselines.py (the bound under every plan)
and tests/unit/coordinator/planner/test_bounds.py (with groups, against brute force).
"""

from __future__ import annotations

from coordinator.planner.terms import compute_s, link_s
from edge.problem import PlanningProblem

__all__ = ["certificate", "lower_bound"]


def certificate(problem: PlanningProblem, step_time_s: float) -> dict[str, float]:
    """A plan's certificate: the bound no plan of ``problem`` beats, and how far the plan's
    step (the spec's score) is above it (``gap``, ``step / bound - 1``)."""
    bound = lower_bound(problem)
    gap = step_time_s / bound - 1 if bound > 0 else (0.0 if step_time_s <= 0 else float("inf"))
    return {"lower_bound_step_s": bound, "gap": max(0.0, gap)}


def lower_bound(problem: PlanningProblem) -> float:
    """A step time no feasible plan can beat (see the module docstring; with groups,
    [Note: the bound with groups])."""
    pipelines = _pipeline_bound(problem)
    if problem.version < 2 or not problem.allows_groups or len(problem.devices) < 2:
        return pipelines
    return min(pipelines, _group_bound(problem))


def _group_bound(problem: PlanningProblem) -> float:
    """The least step of a plan with a group ([Note: the bound with groups])."""
    m = problem.microbatches
    b = problem.batch_size / problem.microbatches
    total = sum(unit.train_flops for unit in problem.layers)
    g_all = sum(d.gflops for d in problem.devices)
    latency = sorted(d.latency_ms for d in problem.devices)[1]
    bandwidth = sorted((d.bandwidth_mbps for d in problem.devices), reverse=True)[1]
    params = min(unit.param_bytes for unit in problem.layers)
    reduce = 2 * latency / 1000 + params * 8 / (bandwidth * 1e6)
    return compute_s(m * b, total, g_all) + reduce


def _pipeline_bound(problem: PlanningProblem) -> float:
    """The least step of a plan with one device a stage (the module docstring)."""
    m = problem.microbatches
    b = problem.batch_size / problem.microbatches
    work = [unit.train_flops for unit in problem.layers]
    total = sum(work)
    g_max = max(d.gflops for d in problem.devices)
    g_all = sum(d.gflops for d in problem.devices)
    tau = max(compute_s(b, total, g_all), compute_s(b, max(work), g_max))
    if problem.pin_first is None:
        return (m - 1) * tau + compute_s(b, total, g_max)
    pin = next(d for d in problem.devices if d.id == problem.pin_first)
    alone = compute_s(m * b, total, pin.gflops)
    others = [d for d in problem.devices if d.id != pin.id]
    if not others or len(problem.layers) == 1:
        return alone
    lat = min(d.latency_ms for d in others)
    bw = max(d.bandwidth_mbps for d in others)
    link = min(
        link_s(b, unit.out_bytes, pin.latency_ms, lat, pin.bandwidth_mbps, bw)
        for unit in problem.layers[:-1]
    )
    head = compute_s(b, work[0], pin.gflops)
    tau = max(tau, head, link)
    split = (m - 1) * tau + head + compute_s(b, total - work[0], g_max) + link
    return min(alone, split)
