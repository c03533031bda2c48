"""Search for the plan with the least step time under the spec's score.

The score is ``F = (M - 1) * tau + S`` where ``tau`` is the largest of the
stage times ``T_s`` and link times ``C_s`` and ``S`` their sum. Two facts make
it tractable:

1. *Bottleneck-threshold decomposition.* For a threshold ``t`` let ``G(t)`` be
   the least ``S`` over plans whose every ``T_s`` and ``C_s`` is at most ``t``.
   The optimal plan's own ``tau*`` is one of the finitely many ``T`` and ``C``
   values (the *candidates*), and ``(M - 1) * tau* + G(tau*) <= F*``, while any
   plan achieving ``G(t)`` has ``F <= (M - 1) * t + G(t)``. Hence
   ``F* = min over candidates t of (M - 1) * t + G(t)``.
2. ``G`` is non-increasing in ``t``. So over a range of candidates ``[lo, hi]``,
   if ``G(lo) == G(hi)`` the best of the range is at ``lo``, and no ``t`` in the
   range can beat ``(M - 1) * t_lo + G(t_hi)``; :func:`threshold_search` splits
   ranges in half only where neither shortcut applies, so it evaluates ``G`` a
   number of times proportional to the number of steps of ``G`` (times a log),
   not the number of candidates.

``G(t)`` itself is a dynamic programme over suffixes of the unit list:

- *exact* (:func:`subset_dp`): state ``(first unit of the suffix, set of
  devices used by the suffix, device of its first stage)``. Building plans from
  the last stage backwards, a stage's distance from the end is the size of the
  set, which is exactly what its 1F1B memory ``min(S - s, M)`` needs, so the
  memory limit is checked exactly. The state space is ``L * 2^D * D``: exact and
  fast up to about 10 devices.
- *fixed order* (:func:`sequence_dp`): the devices and their order are given;
  state ``(stage index, first unit)``, ``O(k * L^2)`` per threshold. It is
  exact for that sequence; which sequences to try is the heuristic part,
  in :mod:`coordinator.planner.solve`.

A fixed stage count ``N`` (a job's ``stages``) restricts both to plans of exactly
``N`` stages: the set size is the stage count, so :func:`subset_dp` keeps sets
of at most ``N`` devices and answers from those of exactly ``N``, and a
sequence of ``N`` devices has ``N`` stages. The decomposition above holds for
any class of plans (``G`` restricted to the class is still non-increasing), so
the threshold search stays exact.

Every plan returned is re-scored by :func:`coordinator.planner.score.score_plan`.

Tested in tests/unit/coordinator/planner/test_planner_exact.py.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from coordinator.planner.score import Plan, Stage
from coordinator.planner.tables import CostTables

__all__ = ["ThresholdResult", "sequence_dp", "subset_dp", "threshold_search"]

Inner = Callable[[float], tuple[float, Plan | None]]


@dataclass
class ThresholdResult:
    """The best plan a threshold search found, with its objective and effort."""

    plan: Plan | None
    objective: float
    evaluations: int


def threshold_search(
    inner: Inner,
    candidates: np.ndarray,
    m: int,
    bottleneck: Callable[[Plan], float],
    deadline: float = math.inf,
) -> ThresholdResult:
    """Minimise ``(m - 1) * t + G(t)`` over sorted ``candidates``; ``inner(t)`` is ``G``.

    ``bottleneck(plan)`` is the plan's own ``tau``. A plan that achieves ``G(t)``
    with ``tau <= t`` shows ``G`` is flat on ``[tau, t]`` (``G`` is
    non-increasing and the plan is feasible at ``tau``), which lets whole ranges
    of candidates be settled by one evaluation. Past ``deadline`` (a
    ``time.perf_counter()`` reading) it stops with the best plan found so far.
    """
    evaluations = 0
    cache: dict[int, tuple[float, Plan | None, float]] = {}

    def g(idx: int) -> tuple[float, Plan | None, float]:
        nonlocal evaluations
        if idx not in cache:
            evaluations += 1
            val, plan = inner(float(candidates[idx]))
            cache[idx] = (val, plan, bottleneck(plan) if plan is not None else np.inf)
        return cache[idx]

    g_inf, plan_inf = inner(float("inf"))
    evaluations += 1
    if plan_inf is None:
        return ThresholdResult(None, float("inf"), evaluations)
    tau_inf = bottleneck(plan_inf)
    best_obj, best_plan = (m - 1) * tau_inf + g_inf, plan_inf
    if m == 1:
        return ThresholdResult(best_plan, best_obj, evaluations)

    def offer(idx: int) -> None:
        nonlocal best_obj, best_plan
        val, plan, tau = g(idx)
        if plan is not None and (m - 1) * tau + val < best_obj:
            best_obj, best_plan = (m - 1) * tau + val, plan

    # Above tau_inf, G equals G(inf); above (best - G(inf)) / (m - 1) nothing can win.
    limit = min(tau_inf, (best_obj - g_inf) / (m - 1))
    top = int(np.searchsorted(candidates, limit, side="right")) - 1
    if top < 0:
        return ThresholdResult(best_plan, best_obj, evaluations)
    # The least feasible candidate, by bisection (below it G is infinite).
    lo, hi = 0, top
    if g(hi)[1] is None:
        return ThresholdResult(best_plan, best_obj, evaluations)
    while lo < hi:
        if time.perf_counter() > deadline:
            return ThresholdResult(best_plan, best_obj, evaluations)
        mid = (lo + hi) // 2
        if g(mid)[1] is None:
            lo = mid + 1
        else:
            tau = g(mid)[2]
            hi = max(lo, int(np.searchsorted(candidates, tau, side="left")))
            if g(hi)[1] is None:  # rounding guard: tau should be a candidate
                hi = mid
    stack = [(lo, top)]
    while stack and time.perf_counter() <= deadline:
        a, z = stack.pop()
        offer(a)
        if a >= z:
            continue
        val_z, _plan_z, tau_z = g(z)
        offer(z)
        if tau_z <= candidates[a]:
            continue  # G is flat on [a, z]: the plan at z is the best of the range
        if (m - 1) * float(candidates[a]) + val_z >= best_obj:
            continue  # nothing in the range can beat what we have
        if z - a == 1:
            continue
        mid = (a + z) // 2
        stack.append((mid, z))
        stack.append((a, mid))
    return ThresholdResult(best_plan, best_obj, evaluations)


def subset_dp(
    tab: CostTables,
    t: float,
    fits: np.ndarray,
    pin: int | None = None,
    stages: int | None = None,
) -> tuple[float, Plan | None]:
    """``G(t)`` over every device subset and order (exact; ``2^D`` states per unit).

    ``fits[r, d, h, i]``: range ``[h, i)`` fits device ``d`` as the stage ``r``
    stages from the end. ``pin`` forces the first stage onto that device index;
    ``stages`` keeps only plans of exactly that many stages.
    """
    n_units, n_dev = tab.num_units, tab.num_devices
    n_sets = 1 << n_dev
    inf = np.inf
    comp = np.where(tab.compute <= t, tab.compute, inf)  # [D, L+1, L+1]
    link = np.where(tab.link <= t, tab.link, inf)  # [D, D, L+1]
    sets = np.arange(n_sets)
    size = np.array([bin(u).count("1") for u in sets])
    # best[h, U, e]: least sum for the suffix from unit h whose stages use the set U
    # and whose first stage runs on e; nxt_* remember the choice for reconstruction.
    best = np.full((n_units + 1, n_sets, n_dev), inf)
    nxt_cut = np.zeros((n_units + 1, n_sets, n_dev), dtype=np.int32)
    nxt_dev = np.full((n_units + 1, n_sets, n_dev), -1, dtype=np.int32)
    without = [sets[(sets >> e) & 1 == 0] for e in range(n_dev)]
    hs = np.arange(n_units)
    # The last stage: range [h, L) alone, position 1 from the end.
    for e in range(n_dev):
        ok = fits[1, e, hs, n_units]
        best[hs, 1 << e, e] = np.where(ok, comp[e, hs, n_units], inf)
        nxt_cut[hs, 1 << e, e] = n_units
    # Push from each suffix start i (descending) to every stage [h, i) before it.
    for i in range(n_units - 1, 0, -1):
        suffix = best[i]  # [U, d], final: every push into it came from larger i
        if not np.isfinite(suffix).any():
            continue
        # via[U, e] = min over d of suffix[U, d] + link[e, d, i]
        total = suffix[:, None, :] + link[None, :, :, i]
        arg = total.argmin(axis=2)
        via = np.take_along_axis(total, arg[:, :, None], axis=2)[:, :, 0]
        before = np.arange(i)
        for e in range(n_dev):
            src = without[e]
            src = src[np.isfinite(via[src, e])]
            if stages is not None:  # a suffix of `stages` stages takes nothing before it
                src = src[size[src] < stages]
            if src.size == 0:
                continue
            dst = src | (1 << e)
            # stage [h, i) on e at position size(U) + 1 from the end
            stage = comp[e, before, i][:, None]  # [h, 1]
            ok = fits[size[src] + 1, e, :i, i].T  # [h, src]
            cand = np.where(ok, stage + via[src, e][None, :], inf)
            cur = best[:i, dst, e]
            better = cand < cur
            if not better.any():
                continue
            hh, jj = np.nonzero(better)
            best[hh, dst[jj], e] = cand[hh, jj]
            nxt_cut[hh, dst[jj], e] = i
            nxt_dev[hh, dst[jj], e] = arg[src[jj], e]
    starts = best[0] if pin is None else np.where(np.arange(n_dev) == pin, best[0], inf)
    if stages is not None:
        starts = np.where((size == stages)[:, None], starts, inf)
    u, e = divmod(int(np.argmin(starts)), n_dev)
    value = float(starts[u, e])
    if not np.isfinite(value):
        return value, None
    plan: list[Stage] = []
    h = 0
    while True:
        cut = int(nxt_cut[h, u, e])
        plan.append(Stage(tab.ids[e], h, cut))
        if cut == n_units:
            break
        u, e, h = u & ~(1 << e), int(nxt_dev[h, u, e]), cut
    return value, Plan(tuple(plan))


def sequence_dp(tab: CostTables, t: float, seq: list[int]) -> tuple[float, Plan | None]:
    """``G(t)`` for one device sequence, every device of it used in order (exact for it)."""
    n_units, k = tab.num_units, len(seq)
    if k > n_units:
        return float("inf"), None
    inf = np.inf
    # value[h]: least sum of the stages s..k-1 when stage s starts at unit h.
    d = seq[-1]
    comp = tab.compute[d, :, n_units]
    fit = tab.fits_row(1, d, n_units)
    value = np.where((comp <= t) & fit, comp, inf)
    cuts: list[np.ndarray] = []
    for s in range(k - 2, -1, -1):
        d, e = seq[s], seq[s + 1]
        comp = tab.compute[d]  # [h, i]
        fit = tab.fits_matrix(k - s, d)
        link = tab.link[d, e]  # [i]
        link_ok = np.where(link <= t, link, inf)
        total = np.where((comp <= t) & fit, comp, inf) + (link_ok + value)[None, :]
        arg = total.argmin(axis=1)
        value = total[np.arange(n_units + 1), arg]
        cuts.append(arg)
    if not np.isfinite(value[0]):
        return float("inf"), None
    stages, h = [], 0
    for s in range(k - 1):
        cut = int(cuts[k - 2 - s][h])
        stages.append(Stage(tab.ids[seq[s]], h, cut))
        h = cut
    stages.append(Stage(tab.ids[seq[-1]], h, n_units))
    return float(value[0]), Plan(tuple(stages))
