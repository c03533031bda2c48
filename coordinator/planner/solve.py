"""The planner's entry point: exact on small fleets, structured heuristics on large ones.

:func:`plan_problem` returns the best plan it can prove or find:

- Fleets of at most :data:`EXACT_DEVICES` devices, or more where the model is
  short enough (:func:`exact_capacity`), get :func:`subset_dp` under the
  threshold search: provably optimal under the spec's score.
- Larger fleets get, within a time budget, the best of
  1. the exact search over a shortlist of devices (the
     fastest, the largest memories, the fastest links, and ``pin_first``): exact
     whenever the optimum uses only shortlisted devices;
  2. :func:`sequence_dp` on device *sequences*: for orderings by speed, by
     memory and by link bandwidth (``pin_first`` always first), the best prefix
     length, each evaluated exactly for that sequence;
  3. a first-improvement local search from the best sequence (swap neighbours,
     drop a device, insert or swap in an unused one) while time remains.

With ``stages=N`` every method keeps to plans of exactly ``N`` stages: the
exact search answers from device sets of size ``N`` (so it stays provably
optimal among ``N``-stage plans), the sequences are the first ``N`` of each
ordering, and the local search only swaps devices (it never drops or inserts
one). The work is bounded as without it, by the same time budget.

A sequence fixes which devices run and in which order; :func:`sequence_dp`
then finds the best cuts for it exactly. Ordering by speed is exact when links
cost nothing and memory is ample: then only the set of devices matters, and the
best set of ``k`` devices is the ``k`` fastest, since a faster device can take
any range a slower one can, in less time.

Tested in tests/unit/coordinator/planner/test_planner_exact.py and
tests/unit/coordinator/planner/test_groups_scale.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from coordinator.planner.score import Plan, PlanScore, score_plan
from coordinator.planner.search import sequence_dp, subset_dp, threshold_search
from coordinator.planner.tables import CostTables
from edge.problem import PlanningProblem

__all__ = ["EXACT_DEVICES", "SearchResult", "exact_capacity", "plan_problem"]

EXACT_DEVICES = 6
"""Fleets up to this size are always searched exactly."""

_EXACT_WORK = 2e7
"""Array elements one exact ``G(t)`` may touch (about ``L^2 * D * 2^(D-1)``) for a
fleet to be searched exactly: a few tenths of a second per threshold here."""

_SHORTLIST_WORK = 4e6

_UNUSED_CLASSES = 6
"""How many classes of unused devices the local search tries to bring in."""


def exact_capacity(n_units: int, work: float = _EXACT_WORK) -> int:
    """The most devices the exact search takes on for ``n_units`` units."""
    size = 1
    while size < 12 and n_units**2 * (size + 1) * 2**size <= work:
        size += 1
    return size


@dataclass
class SearchResult:
    """What the planner found, how, and at what effort."""

    score: PlanScore | None
    exact: bool
    method: str
    evaluations: int
    wall_s: float
    reason: str = ""

    @property
    def plan(self) -> Plan | None:
        return None if self.score is None else self.score.plan


def _exact(
    tab: CostTables, devices: list[int] | None = None, stages: int | None = None
) -> tuple[Plan | None, int]:
    pin_id = tab.problem.pin_first
    if devices is not None:
        sub = tab.problem.model_copy(update={"devices": [tab.problem.devices[i] for i in devices]})
        tab = CostTables.build(sub)
    fits = tab.fits_all(tab.num_devices)
    pin = tab.ids.index(pin_id) if pin_id is not None else None
    res = threshold_search(
        lambda t: subset_dp(tab, t, fits, pin, stages),
        tab.candidate_bottlenecks(),
        tab.m,
        tab.bottleneck,
    )
    return res.plan, res.evaluations


def _best_single(tab: CostTables) -> int | None:
    """The device with the least step time running the whole model alone, if any fits."""
    n = tab.num_units
    alone = np.where(tab.fits_all(1)[1, :, 0, n], tab.compute[:, 0, n], np.inf)
    if tab.problem.pin_first is not None:
        pin = tab.ids.index(tab.problem.pin_first)
        alone = np.where(np.arange(tab.num_devices) == pin, alone, np.inf)
    best = int(np.argmin(alone))
    return best if np.isfinite(alone[best]) else None


def _shortlist(problem: PlanningProblem, size: int, first: list[int]) -> list[int]:
    """Devices most likely to matter: ``first``, the pin, then the fastest, the most
    memory and the fastest links in turn."""
    devs = problem.devices
    chosen: list[int] = list(dict.fromkeys(first))
    if problem.pin_first is not None:
        pin = next(i for i, d in enumerate(devs) if d.id == problem.pin_first)
        if pin not in chosen:
            chosen.insert(0, pin)
    keys: list[Callable[[int], tuple[float, ...]]] = [
        lambda i: (-devs[i].gflops,),
        lambda i: (-devs[i].memory_bytes,),
        lambda i: (-devs[i].bandwidth_mbps, devs[i].latency_ms),
    ]
    rankings = [sorted(range(len(devs)), key=k) for k in keys]
    depth = 0
    while len(chosen) < size and depth < len(devs):
        for ranking in rankings:
            if ranking[depth] not in chosen and len(chosen) < size:
                chosen.append(ranking[depth])
        depth += 1
    return chosen


def _orders(problem: PlanningProblem) -> list[list[int]]:
    devs = problem.devices
    idx = list(range(len(devs)))
    pin = [i for i in idx if devs[i].id == problem.pin_first]
    rest = [i for i in idx if i not in pin]
    keys: list[Callable[[int], tuple[float, ...]]] = [
        lambda i: (-devs[i].gflops, -devs[i].bandwidth_mbps),
        lambda i: (-devs[i].memory_bytes, -devs[i].gflops),
        lambda i: (-devs[i].bandwidth_mbps, devs[i].latency_ms, -devs[i].gflops),
    ]
    return [pin + sorted(rest, key=k) for k in keys]


class _SequenceEvaluator:
    def __init__(self, tab: CostTables, candidates: np.ndarray) -> None:
        self.tab, self.candidates = tab, candidates
        self.cache: dict[tuple[int, ...], tuple[float, Plan | None]] = {}
        self.evaluations = 0

    def __call__(self, seq: list[int]) -> tuple[float, Plan | None]:
        key = tuple(seq)
        if key not in self.cache:
            res = threshold_search(
                lambda t: sequence_dp(self.tab, t, seq),
                self.candidates,
                self.tab.m,
                self.tab.bottleneck,
            )
            self.evaluations += res.evaluations
            self.cache[key] = (res.objective, res.plan)
        return self.cache[key]


def _prefix_lengths(n: int) -> list[int]:
    out, k = [], 1
    while k < n:
        out.append(k)
        k = max(k + 1, int(k * 1.5))
    return [*out, n]


def _neighbours(
    seq: list[int], problem: PlanningProblem, pinned: bool, fixed: bool = False
) -> Iterator[list[int]]:
    """Sequences one move away: swap neighbours, drop one, insert or swap in an unused one
    (``fixed``: only the moves that keep the length, swapping neighbours or swapping in).

    Unused devices are represented by one per class of identical devices (same
    speed, memory and link), the fastest classes first: identical devices give
    identical plans, so trying more than one of a class is wasted work.
    """
    devs = problem.devices
    first = 1 if pinned else 0
    used = set(seq)
    classes: dict[tuple[float, ...], int] = {}
    for i in sorted(range(len(devs)), key=lambda i: -devs[i].gflops):
        key = (devs[i].gflops, devs[i].memory_bytes, devs[i].bandwidth_mbps, devs[i].latency_ms)
        if i not in used and key not in classes:
            classes[key] = i
    unused = list(classes.values())[:_UNUSED_CLASSES]
    for a in range(first, len(seq) - 1):
        yield [*seq[:a], seq[a + 1], seq[a], *seq[a + 2 :]]
    for a in range(first, len(seq)):
        if len(seq) > 1 and not fixed:
            yield seq[:a] + seq[a + 1 :]
    for u in unused:
        for a in range(first, len(seq) + 1) if not fixed else ():
            yield [*seq[:a], u, *seq[a:]]
        for a in range(first, len(seq)):
            yield [*seq[:a], u, *seq[a + 1 :]]


def _local_search(
    evaluator: _SequenceEvaluator,
    seq: list[int],
    problem: PlanningProblem,
    pinned: bool,
    deadline: float,
    fixed: bool = False,
) -> list[int]:
    """First-improvement descent over :func:`_neighbours` until none helps or time is up."""
    current, current_obj = seq, evaluator(seq)[0]
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        for cand in _neighbours(current, problem, pinned, fixed):
            if evaluator(cand)[0] < current_obj * (1 - 1e-12):
                current, current_obj, improved = cand, evaluator(cand)[0], True
                break
            if time.perf_counter() > deadline:
                break
    return current


def plan_problem(
    problem: PlanningProblem, *, time_budget_s: float = 8.0, stages: int | None = None
) -> SearchResult:
    """The best plan for ``problem``, of exactly ``stages`` stages when given (see the
    module docstring for how)."""
    started = time.perf_counter()
    tab = CostTables.build(problem)
    n_dev = tab.num_devices
    if stages is not None and not 1 <= stages <= min(n_dev, tab.num_units):
        why = f"no plan has {stages} stages: {n_dev} devices, {tab.num_units} units"
        return SearchResult(
            score=None,
            exact=True,
            method="none",
            evaluations=0,
            wall_s=time.perf_counter() - started,
            reason=why,
        )
    if n_dev <= max(EXACT_DEVICES, exact_capacity(tab.num_units)):
        plan, evals = _exact(tab, stages=stages)
        return _result(problem, plan, True, "exact subset DP", evals, started, stages)

    deadline = started + time_budget_s
    best: tuple[float, Plan | None, str] = (float("inf"), None, "")
    # The best device alone is always on the shortlist: then the exact search over the
    # shortlist is never worse than the best single device.
    single = _best_single(tab)
    shortlist = _shortlist(
        problem,
        exact_capacity(tab.num_units, _SHORTLIST_WORK),
        [] if single is None else [single],
    )
    plan, evals = None, 0
    if stages is None or stages <= len(shortlist):
        plan, evals = _exact(tab, shortlist, stages)
    if plan is not None:
        best = (score_plan(problem, plan).step_time_s, plan, "exact on a shortlist")
    evaluator = _SequenceEvaluator(tab, tab.candidate_bottlenecks())
    evaluator.evaluations += evals
    seqs_tried: list[tuple[float, list[int]]] = []
    for order in _orders(problem):
        lengths = _prefix_lengths(min(n_dev, tab.num_units)) if stages is None else [stages]
        for k in lengths:
            if time.perf_counter() > deadline:
                break
            obj, plan = evaluator(order[:k])
            seqs_tried.append((obj, order[:k]))
            if plan is not None and obj < best[0]:
                best = (obj, plan, "sequence DP")
    seqs_tried.sort(key=lambda x: x[0])
    if seqs_tried and np.isfinite(seqs_tried[0][0]):
        pinned = problem.pin_first is not None
        fixed = stages is not None
        seq = _local_search(evaluator, seqs_tried[0][1], problem, pinned, deadline, fixed)
        obj, plan = evaluator(seq)
        if plan is not None and obj < best[0]:
            best = (obj, plan, "sequence DP + local search")
    return _result(problem, best[1], False, best[2], evaluator.evaluations, started, stages)


def _result(
    problem: PlanningProblem,
    plan: Plan | None,
    exact: bool,
    method: str,
    evaluations: int,
    started: float,
    stages: int | None = None,
) -> SearchResult:
    wall = time.perf_counter() - started
    if plan is None:
        reason = "no assignment of layers to devices fits every stage's memory"
        if stages is not None:
            reason = f"no {stages}-stage plan fits every stage's memory"
        return SearchResult(
            score=None,
            exact=exact,
            method=method,
            evaluations=evaluations,
            wall_s=wall,
            reason=reason,
        )
    score = score_plan(problem, plan)
    if not score.feasible:  # the search checks memory exactly; this guards the guarantee
        raise AssertionError(f"planner returned an infeasible plan: {score.reasons}")
    return SearchResult(
        score=score, exact=exact, method=method, evaluations=evaluations, wall_s=wall
    )
