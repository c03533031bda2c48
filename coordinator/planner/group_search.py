"""The version 2 search: stages on device groups, the time or energy objective, deadlines.

:func:`plan_groups` returns the best plan it can prove or find for a version 2
problem (``shared/spec/planning-v2.md``):

- **Exact** where the plans are few enough to score them all
  (:func:`exact_plan_count` at most :data:`EXACT_PLANS`, in at most
  :data:`EXACT_SEQUENCES` sequences of groups): every sequence of
  disjoint groups, each with every set of cuts, scored in arrays with the score's
  own terms. Identical devices (same speed, memory, link and power) are
  interchangeable, so a group is a count per class of identical devices: that
  removes the symmetric copies without losing a plan. ``pin_first`` is a class of
  its own and must be in the first group; ``"groups": false`` keeps groups of one.
- **Structured search** beyond that, within a time budget: the version 1 plan
  (pipeline only, version 1's answer: see the note below), every "data parallel
  only" plan (one group of the ``k`` fastest), then a first-improvement local
  search over group sequences (add, remove, move
  or swap a member, merge or split stages, bring in an unused device as a
  stage), each sequence's cuts chosen by :func:`best_cuts`. Unused devices come
  in one per class, and only from classes no other unused class dominates (as
  fast, as much memory, as good a link, and for energy as frugal): in the
  64-device catalogue fleets that leaves a handful of the twenty-odd classes,
  and the search converges in half the time.

:func:`best_cuts` is version 1's threshold decomposition (see
:mod:`coordinator.planner.search`) over one sequence of groups: for a threshold
``t`` a dynamic programme over cuts minimises the sum of stage, link and
all-reduce times with every ``T`` and ``C`` at most ``t``. It counts the
all-reduces as a sum where the score takes their largest, an upper bound that is
exact with at most one group; every plan is then scored exactly. For the energy
objective the stage terms carry each group's energy, divided by the plan's idle
watts (the step's multiplier in ``E``), so the same decomposition minimises
``E`` for a fixed set of devices.

:func:`replan` is the warm start after a device leaves or joins: the current
plan without the missing devices (a group shrinks; a stage left empty hands its
units to its neighbours, or takes a spare device), ranked by a quick look at
their cuts, then the same local search from each in turn, the best first, with a
short budget.

[Note: version 2 holds version 1's answer]
Every version 1 plan is a version 2 plan (a stage of one device), so a version 2
plan is never worse than version 1's answer to the same problem: both searches
hold that answer as a candidate, computed as version 1 computes it
(:func:`coordinator.planner.solve.plan_problem` on ``problem.as_version(1)``,
with the same ``time_budget_s`` and ``stages``), and replace it only by a plan
that scores strictly better. The structured search once gave that step 35% of
the budget, and where version 1 needed more (``bench/planner.py``'s 64 x 200
seed 21 on a loaded machine: version 1 converges in 2.7 s alone, past 2.8 s
under load) it returned a plan 0.165% slower than version 1's. The group search
now has what version 1 leaves of the budget. The guarantee is exact wherever
version 1's search ends before its budget (it is deterministic then); where
the budget cuts it, each call stops where the clock stops it.

Each search takes ``limits`` (:class:`~coordinator.planner.group_tables.GroupLimits`):
what a runtime cannot train on a group (units holding BatchNorm, members left
without a sample). Groups that break them are never built, in any search.

Tested in tests/unit/coordinator/planner/test_groups_exact.py,
tests/unit/coordinator/planner/test_groups_scale.py,
tests/unit/coordinator/planner/test_group_spares.py and
tests/unit/coordinator/planner/test_groups_v1.py (never worse than version 1).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from coordinator.planner.group_tables import Group, GroupLimits, GroupTables
from coordinator.planner.score import Plan, PlanScore, score_plan
from coordinator.planner.search import threshold_search
from coordinator.planner.solve import SearchResult, plan_problem
from edge.problem import PlanningProblem

__all__ = [
    "EXACT_PLANS",
    "EXACT_SEQUENCES",
    "best_cuts",
    "data_parallel_only",
    "exact_plan_count",
    "plan_any",
    "plan_groups",
    "replan",
]

EXACT_PLANS = 1_500_000
"""Problems with at most this many distinct plans (after symmetry) are scored whole."""
EXACT_SEQUENCES = 20_000
"""...and at most this many group sequences: each costs about 0.3 ms to set up however
few its cuts (8 distinct devices and gpt-mini's 6 units: 159,000 sequences, 823,000
plans, 48 s whole; the structured search takes 2 s there)."""

Sequence = tuple[Group, ...]


# -- classes of identical devices -----------------------------------------------------


def _classes(problem: PlanningProblem) -> list[list[int]]:
    """Device indices grouped by identical figures, fastest class first; ``pin_first``
    alone in a class of its own, first."""
    classes: dict[tuple[float | None, ...], list[int]] = {}
    pin: list[list[int]] = []
    for i, d in enumerate(problem.devices):
        if d.id == problem.pin_first:
            pin.append([i])
            continue
        key = (d.gflops, d.memory_bytes, d.bandwidth_mbps, d.latency_ms, d.watts_busy, d.watts_idle)
        classes.setdefault(key, []).append(i)
    rest = sorted(classes.values(), key=lambda c: -problem.devices[c[0]].gflops)
    return pin + rest


def _vectors(avail: tuple[int, ...], max_size: int) -> Iterator[tuple[int, ...]]:
    """Every non-empty count vector ``c <= avail`` of at most ``max_size`` devices."""
    for c in itertools.product(*(range(a + 1) for a in avail)):
        if 0 < sum(c) <= max_size:
            yield c


def _type_sequences(
    avail: tuple[int, ...], max_stages: int, max_size: int, pinned: bool
) -> Iterator[tuple[tuple[int, ...], ...]]:
    """Sequences of group count vectors that the classes can supply; with ``pinned`` the
    first group holds class 0 (the pin)."""

    def rec(
        left: tuple[int, ...], prefix: tuple[tuple[int, ...], ...]
    ) -> Iterator[tuple[tuple[int, ...], ...]]:
        if prefix:
            yield prefix
        if len(prefix) == max_stages:
            return
        for c in _vectors(left, max_size):
            if pinned and not prefix and c[0] == 0:
                continue
            yield from rec(tuple(a - x for a, x in zip(left, c, strict=True)), (*prefix, c))

    yield from rec(avail, ())


def _realise(classes: list[list[int]], types: tuple[tuple[int, ...], ...]) -> Sequence:
    """Concrete groups for count vectors: the next unused devices of each class."""
    taken = [0] * len(classes)
    groups = []
    for c in types:
        members: list[int] = []
        for j, n in enumerate(c):
            members += classes[j][taken[j] : taken[j] + n]
            taken[j] += n
        groups.append(tuple(members))
    return tuple(groups)


def exact_plan_count(
    problem: PlanningProblem, limit: float = math.inf, stages: int | None = None
) -> float:
    """How many distinct plans (after symmetry) the exact search scores (of ``stages``
    stages when given); stops counting past ``limit``."""
    classes = _classes(problem)
    n = len(problem.layers)
    max_size = len(problem.devices) if problem.allows_groups else 1
    pinned = problem.pin_first is not None
    if math.prod(len(c) + 1 for c in classes) - 1 > limit:
        return math.inf  # more kinds of group than the limit: each is a plan of one stage
    total = 0.0
    for types in _type_sequences(tuple(map(len, classes)), stages or n, max_size, pinned):
        if stages is None or len(types) == stages:
            total += math.comb(n - 1, len(types) - 1)
        if total > limit:
            return total
    return total


def _few_sequences(problem: PlanningProblem, stages: int | None = None) -> bool:
    """Whether the exact search walks at most :data:`EXACT_SEQUENCES` group sequences (up
    to ``stages`` stages when given, each counted: it walks the shorter ones too)."""
    classes = _classes(problem)
    max_size = len(problem.devices) if problem.allows_groups else 1
    every = _type_sequences(
        tuple(map(len, classes)),
        stages or len(problem.layers),
        max_size,
        problem.pin_first is not None,
    )
    return next(itertools.islice(every, EXACT_SEQUENCES, None), None) is None


# -- exact: every plan, scored in arrays ----------------------------------------------


@dataclass
class _Best:
    key: tuple[float, float] = (math.inf, math.inf)
    plan: Plan | None = None


def _score_all(gt: GroupTables, seq: Sequence, best: _Best, chunk: int = 200_000) -> None:
    """Score every set of cuts for ``seq`` and keep the best feasible plan in ``best``."""
    n, k = gt.num_units, len(seq)
    goal = gt.problem.goal
    energy_goal = goal.minimize == "energy"
    deadline = math.inf if goal.max_step_time_s is None else goal.max_step_time_s
    costs = [gt.costs(g) for g in seq]
    fits = [gt.fits(g, k - s) for s, g in enumerate(seq)]
    links = [gt.link(a, b) for a, b in itertools.pairwise(seq)]
    idle = sum(c.idle_w for c in costs)
    grouped = gt.problem.version == 2
    combos = itertools.combinations(range(1, n), k - 1)
    while True:
        block = np.array(list(itertools.islice(combos, chunk)), dtype=np.int64)
        if block.size == 0 and k > 1:
            return
        rows = max(1, len(block))
        cuts = np.empty((rows, k + 1), dtype=np.int64)
        cuts[:, 0], cuts[:, k] = 0, n
        if k > 1:
            cuts[:, 1:k] = block
        h, e = cuts[:, :-1], cuts[:, 1:]
        t = np.stack([costs[s].compute[h[:, s], e[:, s]] for s in range(k)], axis=1)
        ok = np.all(np.stack([fits[s][h[:, s], e[:, s]] for s in range(k)], axis=1), axis=1)
        c = (
            np.stack([links[s][e[:, s]] for s in range(k - 1)], axis=1)
            if k > 1
            else np.zeros((rows, 0))
        )
        tau = np.maximum(t.max(axis=1), c.max(axis=1) if k > 1 else 0.0)
        step = (gt.m - 1) * tau + t.sum(axis=1) + c.sum(axis=1)
        if grouped:
            r = np.stack([costs[s].allreduce[h[:, s], e[:, s]] for s in range(k)], axis=1)
            step = step + r.max(axis=1)
        ok &= step <= deadline
        if ok.any():
            if energy_goal:
                busy = np.stack([costs[s].energy[h[:, s], e[:, s]] for s in range(k)], axis=1)
                first = busy.sum(axis=1) + idle * step
                second = step
            else:
                first, second = step, np.zeros_like(step)
            first = np.where(ok, first, np.inf)
            i = int(np.lexsort((second, first))[0])
            key = (float(first[i]), float(second[i]))
            if key < best.key:
                best.key, best.plan = key, gt.plan(list(seq), [int(x) for x in cuts[i]])
        if k == 1:
            return


def _exact(gt: GroupTables, stages: int | None = None) -> tuple[Plan | None, int]:
    problem = gt.problem
    classes = _classes(problem)
    max_size = len(problem.devices) if problem.allows_groups else 1
    best, sequences = _Best(), 0
    types_iter = _type_sequences(
        tuple(map(len, classes)), stages or gt.num_units, max_size, problem.pin_first is not None
    )
    for types in types_iter:
        if stages is not None and len(types) != stages:
            continue
        _score_all(gt, _realise(classes, types), best)
        sequences += 1
    return best.plan, sequences


# -- one sequence: the best cuts ------------------------------------------------------


@dataclass
class _Evaluator:
    """Scores group sequences by their best cuts; caches by sequence."""

    gt: GroupTables
    lam: float = -1.0
    """Energy weight in the cut search: ``-1`` follows the objective, ``0`` is step time."""
    deadline: float = math.inf
    """A ``time.perf_counter()`` reading: a cut search still going then stops with its
    best so far (and is cached as such: the search ends there too)."""
    evaluations: int = 0

    def __post_init__(self) -> None:
        self.cache: dict[Sequence, PlanScore | None] = {}

    def __call__(self, seq: Sequence) -> PlanScore | None:
        if seq not in self.cache:
            plan = best_cuts(self.gt, seq, self.lam, deadline=self.deadline)
            self.evaluations += 1
            got = None if plan is None else _checked(self.gt.problem, plan)
            goal = self.gt.problem.goal
            if got is None and goal.minimize == "energy" and goal.max_step_time_s is not None:
                # The least-energy cuts miss the deadline: the fastest cuts may meet it.
                plan = best_cuts(self.gt, seq, 0.0, deadline=self.deadline)
                got = None if plan is None else _checked(self.gt.problem, plan)
            self.cache[seq] = got
        return self.cache[seq]

    def quick(self, seq: Sequence, near: PlanScore | None) -> PlanScore | None:
        """``seq``'s cuts at the bottleneck of ``near`` (a plan to beat) and without one:
        two passes of the cut search where a full one takes tens."""
        if seq in self.cache:
            return self.cache[seq]
        hints = () if near is None else (near.bottleneck_s, near.bottleneck_s * 1.25)
        plan = best_cuts(self.gt, seq, self.lam, hints or (math.inf,))
        self.evaluations += 1
        return None if plan is None else _checked(self.gt.problem, plan)


def _checked(problem: PlanningProblem, plan: Plan) -> PlanScore | None:
    score = score_plan(problem, plan)
    return score if score.feasible else None


def _key(problem: PlanningProblem, score: PlanScore | None) -> tuple[float, float]:
    if score is None or not score.feasible:
        return (math.inf, math.inf)
    return score.objective(problem.goal.minimize)


def best_cuts(
    gt: GroupTables,
    seq: Sequence,
    lam: float = -1.0,
    hints: tuple[float, ...] = (),
    deadline: float = math.inf,
) -> Plan | None:
    """The cuts of ``seq`` (every group used, in order) with the least objective under the
    search's cost model (module docstring); ``None`` if none fits. With ``hints``, a quick
    look instead: only those bottleneck thresholds (and none) are tried. Past
    ``deadline`` (a ``time.perf_counter()`` reading) the best cuts found so far."""
    n, k = gt.num_units, len(seq)
    if k > n:
        return None
    costs = [gt.costs(g) for g in seq]
    links = [gt.link(a, b) for a, b in itertools.pairwise(seq)]
    if lam < 0:
        idle = sum(c.idle_w for c in costs)
        lam = (1.0 / idle if idle > 0 else 1e6) if gt.problem.goal.minimize == "energy" else 0.0
    # [h, i] each: the stage's term where every member holds the range, else inf
    stage = [gt.stage_terms(g, k - s) for s, g in enumerate(seq)]
    if lam:
        stage = [
            np.where(np.isfinite(terms), terms + lam * c.energy, np.inf)
            for terms, c in zip(stage, costs, strict=True)
        ]
    found: dict[int, list[int]] = {}

    def inner(t: float) -> tuple[float, Plan | None]:
        bounded = math.isfinite(t)
        value = stage[-1][:, n]
        if bounded:
            value = np.where(costs[-1].compute[:, n] <= t, value, np.inf)
        args: list[np.ndarray] = []
        for s in range(k - 2, -1, -1):
            rows = slice(0, 1) if s == 0 else slice(None)  # the first stage starts at 0
            ahead = (np.where(links[s] <= t, links[s], np.inf) if bounded else links[s]) + value
            if bounded:
                total = np.where(costs[s].compute[rows] <= t, stage[s][rows], np.inf)
                total += ahead
            else:
                total = stage[s][rows] + ahead
            arg = total.argmin(axis=1)
            value = total[np.arange(len(arg)), arg]
            args.append(arg)
        if not np.isfinite(value[0]):
            return math.inf, None
        cuts, h = [0], 0
        for s in range(k - 1):
            h = int(args[k - 2 - s][h])
            cuts.append(h)
        cuts.append(n)
        plan = gt.plan(list(seq), cuts)
        found[id(plan)] = cuts
        return float(value[0]), plan

    def bottleneck(plan: Plan) -> float:
        cuts = found[id(plan)]
        times = [float(costs[s].compute[cuts[s], cuts[s + 1]]) for s in range(k)]
        times += [float(links[s][cuts[s + 1]]) for s in range(k - 1)]
        return max(times)

    if hints:
        best: tuple[float, Plan | None] = (math.inf, None)
        for t in (*hints, math.inf):
            value, plan = inner(t)
            if plan is not None and (gt.m - 1) * bottleneck(plan) + value < best[0]:
                best = ((gt.m - 1) * bottleneck(plan) + value, plan)
        return best[1]
    values = [c.compute[np.isfinite(c.compute)].ravel() for c in costs]
    values += [link[1:n] for link in links]
    candidates = np.unique(np.concatenate(values))
    if lam and gt.problem.goal.minimize == "energy" and sum(c.idle_w for c in costs) == 0:
        return inner(math.inf)[1]  # no idle power: the step time does not enter E
    return threshold_search(inner, candidates, gt.m, bottleneck, deadline).plan


# -- structured search ----------------------------------------------------------------


def _sequence_of(problem: PlanningProblem, plan: Plan) -> Sequence:
    index = {d.id: i for i, d in enumerate(problem.devices)}
    return tuple(tuple(index[d] for d in st.devices) for st in plan.stages)


def _class_of(problem: PlanningProblem) -> list[int]:
    out = [0] * len(problem.devices)
    for j, members in enumerate(_classes(problem)):
        for i in members:
            out[i] = j
    return out


def _dominates(problem: PlanningProblem, a: int, b: int) -> bool:
    """Whether device ``a`` is at least as good as ``b`` in every figure the objective
    reads: speed, memory, link bandwidth and latency (and power, for energy)."""
    da, db = problem.devices[a], problem.devices[b]
    better = (
        da.gflops >= db.gflops
        and da.memory_bytes >= db.memory_bytes
        and da.bandwidth_mbps >= db.bandwidth_mbps
        and da.latency_ms <= db.latency_ms
    )
    if better and problem.goal.minimize == "energy":
        better = (da.watts_busy or 0.0) <= (db.watts_busy or 0.0) and (da.watts_idle or 0.0) <= (
            db.watts_idle or 0.0
        )
    return better


def _spare(seq: Sequence, problem: PlanningProblem, cls: list[int]) -> list[int]:
    """The unused devices worth bringing in: one per class of identical devices, and none of
    a class that another spare class dominates (a heuristic in groups, where a faster
    member takes a larger share of the link)."""
    used = {i for g in seq for i in g}
    spare: dict[int, int] = {}
    for i in range(len(problem.devices)):
        if i not in used and cls[i] not in spare:
            spare[cls[i]] = i
    return [
        u
        for u in spare.values()
        if not any(_dominates(problem, v, u) for v in spare.values() if v != u)
    ]


def _neighbours(seq: Sequence, problem: PlanningProblem, cls: list[int]) -> Iterator[Sequence]:
    """Sequences one move away (module docstring); unused devices one per class, of the
    classes no other spare class dominates (:func:`_spare`)."""
    pin = next((i for i, d in enumerate(problem.devices) if d.id == problem.pin_first), None)
    groups_ok = problem.allows_groups
    unused = _spare(seq, problem, cls)
    k = len(seq)

    def valid(new: list[Group]) -> bool:
        return all(new) and (pin is None or pin in new[0])

    def emit(new: list[Group]) -> Iterator[Sequence]:
        if valid(new):
            yield tuple(tuple(sorted(g)) for g in new)

    for u in unused:  # a spare device becomes a stage
        for s in range(k + 1):
            yield from emit([*seq[:s], (u,), *seq[s:]])
    for s in range(k):
        for m in seq[s]:
            for u in unused:  # a spare device replaces a member
                yield from emit(
                    [*seq[:s], tuple(u if x == m else x for x in seq[s]), *seq[s + 1 :]]
                )
        if groups_ok:
            for u in unused:  # a spare device joins a group
                yield from emit([*seq[:s], (*seq[s], u), *seq[s + 1 :]])
        if len(seq[s]) > 1:
            for m in set(seq[s]):
                rest = tuple(x for x in seq[s] if x != m)
                yield from emit([*seq[:s], rest, *seq[s + 1 :]])  # a member leaves
                for t in (s - 1, s + 1):  # ...or moves to a neighbouring stage
                    if 0 <= t < k and groups_ok:
                        moved = list(seq)
                        moved[s], moved[t] = rest, (*seq[t], m)
                        yield from emit(moved)
                yield from emit([*seq[:s], rest, (m,), *seq[s + 1 :]])  # ...or splits off
                yield from emit([*seq[:s], (m,), rest, *seq[s + 1 :]])
        if s + 1 < k:
            if groups_ok:  # two stages become one group
                yield from emit([*seq[:s], seq[s] + seq[s + 1], *seq[s + 2 :]])
            yield from emit([*seq[:s], seq[s + 1], seq[s], *seq[s + 2 :]])
        if k > 1:
            yield from emit([*seq[:s], *seq[s + 1 :]])  # a stage is dropped


def _local_search(
    evaluate: _Evaluator,
    seq: Sequence,
    problem: PlanningProblem,
    deadline: float,
    stages: int | None = None,
) -> tuple[Sequence, PlanScore | None]:
    cls = _class_of(problem)
    current, score = seq, evaluate(seq)
    best_key = _key(problem, score)
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        for cand in _neighbours(current, problem, cls):
            if len(cand) > len(problem.layers) or stages not in (None, len(cand)):
                continue
            got = evaluate.quick(cand, score)
            if _key(problem, got) < best_key:  # promising: the full cut search
                full = evaluate(cand)
                got = full if _key(problem, full) < _key(problem, got) else got
            key = _key(problem, got)
            if key[0] < best_key[0] * (1 - 1e-12) or (
                key[0] == best_key[0] and key[1] < best_key[1] * (1 - 1e-12)
            ):
                current, score, best_key, improved = cand, got, key, True
                break
            if time.perf_counter() > deadline:
                break
    return current, score


def _data_parallel(problem: PlanningProblem, gt: GroupTables) -> list[Sequence]:
    """One-stage sequences: the ``k`` fastest devices (with ``pin_first``) for every ``k``."""
    if not problem.allows_groups:
        return []
    devs = problem.devices
    order = sorted(range(len(devs)), key=lambda i: (-devs[i].gflops, -devs[i].bandwidth_mbps))
    pin = [i for i in order if devs[i].id == problem.pin_first]
    order = pin + [i for i in order if i not in pin]
    return [(tuple(sorted(order[:k])),) for k in range(1, len(order) + 1)]


def data_parallel_only(problem: PlanningProblem, limits: GroupLimits | None = None) -> Plan | None:
    """The "data parallel only" baseline: the best plan of one stage on one group (the
    ``k`` fastest devices, ``pin_first`` among them, for the best ``k``, within
    ``limits``); ``None`` if no group holds the whole model."""
    gt = GroupTables.build(problem.as_version(2), limits)
    best: PlanScore | None = None
    for (group,) in _data_parallel(gt.problem, gt):
        if not gt.fits(group, 1)[0, gt.num_units]:
            continue
        got = _checked(gt.problem, gt.plan([group], [0, gt.num_units]))
        if _better(gt.problem, got, best):
            best = got
    return None if best is None else best.plan


def plan_any(
    problem: PlanningProblem, *, time_budget_s: float = 8.0, stages: int | None = None
) -> SearchResult:
    """The planner for a problem of either version: version 2 searches groups."""
    if problem.version == 2:
        return plan_groups(problem, time_budget_s=time_budget_s, stages=stages)
    return plan_problem(problem, time_budget_s=time_budget_s, stages=stages)


def _better(problem: PlanningProblem, a: PlanScore | None, b: PlanScore | None) -> bool:
    return _key(problem, a) < _key(problem, b)


def _version_1(
    problem: PlanningProblem, time_budget_s: float, stages: int | None
) -> tuple[PlanScore | None, SearchResult]:
    """Version 1's answer to ``problem``, as :func:`plan_any` gives it for
    ``problem.as_version(1)``, scored under ``problem`` (``None`` if there is none or
    it misses ``problem``'s deadline), and version 1's search result."""
    v1 = plan_problem(problem.as_version(1), time_budget_s=time_budget_s, stages=stages)
    return (None if v1.plan is None else _checked(problem, Plan(v1.plan.stages))), v1


def plan_groups(
    problem: PlanningProblem,
    *,
    time_budget_s: float = 8.0,
    exact_limit: float = EXACT_PLANS,
    stages: int | None = None,
    limits: GroupLimits | None = None,
) -> SearchResult:
    """The best plan for a version 2 ``problem``, of exactly ``stages`` stages when given,
    its groups within ``limits`` (module docstring)."""
    started = time.perf_counter()
    gt = GroupTables.build(problem, limits)
    if stages is not None and not 1 <= stages <= min(gt.num_devices, gt.num_units):
        why = f"no plan has {stages} stages: {gt.num_devices} devices, {gt.num_units} units"
        return SearchResult(None, True, "none", 0, time.perf_counter() - started, why)
    if exact_plan_count(problem, exact_limit, stages) <= exact_limit and _few_sequences(
        problem, stages
    ):
        plan, sequences = _exact(gt, stages)
        # The arrays sum a plan's terms in numpy's order, the score left to right: in a tie
        # to the last bit, version 1's answer must still win ([Note: version 2 holds
        # version 1's answer]).
        held = _version_1(problem, time_budget_s, stages)[0]
        if _better(problem, held, None if plan is None else _checked(problem, plan)):
            plan = None if held is None else held.plan
        return _result(gt, plan, True, "exact over every group sequence", sequences, started)
    deadline = started + time_budget_s
    evaluate = _Evaluator(gt, deadline=deadline)
    method = ""
    # Version 1's answer first, with version 1's whole budget; the groups get what it leaves.
    best, v1 = _version_1(problem, time_budget_s, stages)
    seeds: list[Sequence] = []
    if v1.plan is not None:
        seeds.append(_sequence_of(problem, v1.plan))
        method = "pipeline only (version 1)"
    for seq in _data_parallel(problem, gt) if stages in (None, 1) else []:
        got = evaluate(seq)
        if _better(problem, got, best):
            best, method = got, "data parallel only"
            seeds.append(seq)
    for seq in seeds[::-1]:
        if time.perf_counter() > deadline:
            break
        _seq, got = _local_search(evaluate, seq, problem, deadline, stages)
        if _better(problem, got, best):
            best, method = got, "group local search"
    evals = evaluate.evaluations + v1.evaluations
    return _result(gt, None if best is None else best.plan, False, method, evals, started)


def replan(
    problem: PlanningProblem,
    current: Plan,
    *,
    time_budget_s: float = 0.8,
    limits: GroupLimits | None = None,
) -> SearchResult:
    """A warm-started plan for ``problem`` (devices gone or new) from ``current``: the
    current plan without the missing devices, and the same with a spare device (one per
    class worth bringing in, :func:`_spare`) in each stage left empty, are the seeds; the
    local search goes on from each in turn, the best first, within ``time_budget_s``, its
    groups within ``limits``."""
    started = time.perf_counter()
    deadline = started + time_budget_s
    gt = GroupTables.build(problem, limits)
    evaluate = _Evaluator(gt, deadline=deadline)
    ids = {d.id: i for i, d in enumerate(problem.devices)}
    seq = tuple(
        g for g in (tuple(ids[d] for d in st.devices if d in ids) for st in current.stages) if g
    )
    pin = ids.get(problem.pin_first) if problem.pin_first else None
    if pin is not None and seq and pin not in seq[0]:
        seq = tuple(g for g in ((pin,), *(tuple(x for x in g if x != pin) for g in seq)) if g)
    seeds = [seq] if seq and len(seq) <= len(problem.layers) else []
    emptied = [s for s, st in enumerate(current.stages) if not set(st.devices) & set(ids)]
    cls = _class_of(problem)
    for u in _spare(seq, problem, cls):  # a spare device in the place of each stage left empty
        new = [tuple(ids[d] for d in st.devices if d in ids) for st in current.stages]
        for s in emptied:
            new[s] = (u,)
        if emptied and all(new):
            seeds.append(tuple(new))
    # A quick look ranks the seeds; the local search goes on from each in turn, the best
    # first, while time remains.
    scored = [(evaluate.quick(s, None), s) for s in seeds]
    scored = sorted(
        ((sc, s) for sc, s in scored if sc is not None), key=lambda x: _key(problem, x[0])
    )
    if not scored:
        return plan_groups(problem, time_budget_s=time_budget_s, limits=limits)
    best: PlanScore | None = None
    for quick, seq in scored:
        if best is not None and time.perf_counter() > deadline:
            break
        _seq, got = _local_search(evaluate, seq, problem, deadline)
        for found in (quick, got):
            if _better(problem, found, best):
                best = found
    return _result(
        gt,
        None if best is None else best.plan,
        False,
        "warm start from the current plan",
        evaluate.evaluations,
        started,
    )


def _result(
    gt: GroupTables,
    plan: Plan | None,
    exact: bool,
    method: str,
    evaluations: int,
    started: float,
) -> SearchResult:
    problem = gt.problem
    wall = time.perf_counter() - started
    if plan is None:
        reason = "no assignment of layers to device groups fits every member's memory"
        if problem.goal.max_step_time_s is not None:
            reason = (
                "no plan fits every member's memory with a step time within "
                f"max_step_time_s {problem.goal.max_step_time_s:g} s"
            )
        return SearchResult(None, exact, method, evaluations, wall, reason)
    score = score_plan(problem, plan)
    if not score.feasible:
        raise AssertionError(f"planner returned an infeasible plan: {score.reasons}")
    if not gt.limits.allows(problem, plan):
        raise AssertionError("planner returned a group its limits refuse")
    return SearchResult(score, exact, method, evaluations, wall)
