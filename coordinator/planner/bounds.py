"""A lower bound on the step time of any plan, to judge the heuristic search by.

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

Tested in tests/unit/coordinator/planner/test_baselines.py (the bound under every plan).
"""

from __future__ import annotations

from coordinator.planner.terms import compute_s, link_s
from edge.problem import PlanningProblem

__all__ = ["lower_bound"]


def lower_bound(problem: PlanningProblem) -> float:
    """A step time no feasible plan can beat (see the module docstring)."""
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
