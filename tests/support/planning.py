"""Reference planners and random problems for the planner's tests.

Everything here is written from ``shared/spec/planning.md`` alone and shares no
code with ``coordinator.planner`` except :func:`score_plan`, the spec's formula:

- :func:`brute_force_literal` enumerates every plan and scores each with
  :func:`score_plan` (the definition, slow);
- :func:`brute_force` enumerates the same plans, vectorised with numpy over all
  device orders and cut sets of one stage count (fast enough for 6 devices and
  10 units); its memory test repeats the spec's expression term for term over
  range sums taken with Python's ``sum`` on the same slices as ``score_plan``, so
  its feasibility agrees with ``score_plan``'s to the last bit;
- :func:`pareto_exact` is an exact method of another kind for bigger instances:
  a dynamic programme over *device sequences* built from the last stage
  backwards, keeping for every suffix start the Pareto front of
  (bottleneck, sum of stage and link times);
- :func:`problems` is a hypothesis strategy for random problems in named regimes.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import strategies as st

from coordinator.planner.score import Plan, Stage, score_plan
from edge.problem import DeviceSpec, PlanningProblem, UnitSpec

__all__ = [
    "REGIMES",
    "Reference",
    "all_group_plans",
    "all_plans",
    "brute_force",
    "brute_force_literal",
    "count_plans",
    "make_problem",
    "pareto_exact",
    "plan_errors",
    "problems",
    "random_problem",
]


@dataclass(frozen=True)
class Reference:
    """The least step time a reference method found, and a plan achieving it."""

    step_time_s: float
    plan: Plan


def make_problem(
    layers: Sequence[Mapping[str, Any]],
    devices: Sequence[Mapping[str, Any]],
    *,
    batch_size: float = 32.0,
    microbatches: int = 4,
    k: float = 4.0,
    pin_first: str | None = None,
) -> PlanningProblem:
    """A problem from plain dicts; layers get names ``u0..``, devices need ``id``."""
    return PlanningProblem(
        version=1,
        batch_size=batch_size,
        microbatches=microbatches,
        optimizer_state_factor=k,
        pin_first=pin_first,
        layers=[UnitSpec(name=f"u{j}", **unit) for j, unit in enumerate(layers)],
        devices=[DeviceSpec(**d) for d in devices],
    )


def count_plans(n_devices: int, n_units: int) -> int:
    """Number of plans without a pin: ordered device subsets times cut sets."""
    return sum(
        math.perm(n_devices, s) * math.comb(n_units - 1, s - 1)
        for s in range(1, min(n_devices, n_units) + 1)
    )


def plan_errors(problem: PlanningProblem, plan: Plan) -> list[str]:
    """Structural faults of ``plan``, checked from the spec's definition of a plan."""
    errors = []
    ids = [d.id for d in problem.devices]
    n = len(problem.layers)
    covered = [u for st_ in plan.stages for u in range(st_.start, st_.end)]
    if covered != list(range(n)):
        errors.append(f"units covered {covered}, expected 0..{n - 1} once each, in order")
    if any(st_.end <= st_.start for st_ in plan.stages):
        errors.append("an empty stage")
    used = [st_.device for st_ in plan.stages]
    if len(set(used)) != len(used) or any(u not in ids for u in used):
        errors.append(f"devices {used} not distinct known devices")
    if problem.pin_first is not None and (not used or used[0] != problem.pin_first):
        errors.append(f"stage 0 on {used[:1]}, pin_first is {problem.pin_first}")
    return errors


def all_plans(problem: PlanningProblem) -> Iterator[Plan]:
    """Every plan of the spec: an ordered subset of devices (stage 0 on ``pin_first``
    when given) and a choice of cuts, one stage per device, no stage empty."""
    ids = [d.id for d in problem.devices]
    n = len(problem.layers)
    for s in range(1, min(len(ids), n) + 1):
        for order in itertools.permutations(ids, s):
            if problem.pin_first is not None and order[0] != problem.pin_first:
                continue
            for inner in itertools.combinations(range(1, n), s - 1):
                bounds = (0, *inner, n)
                yield Plan(tuple(Stage(d, bounds[j], bounds[j + 1]) for j, d in enumerate(order)))


def all_group_plans(problem: PlanningProblem) -> list[Plan]:
    """Every plan of ``shared/spec/planning-v2.md``, literally: each device left out or in
    one of ``k`` stages (members in index order), every set of cuts; groups only where
    the problem allows them, stage 0 holding ``pin_first``."""
    ids = [d.id for d in problem.devices]
    n = len(problem.layers)
    plans = []
    for k in range(1, min(len(ids), n) + 1):
        for where in itertools.product(range(-1, k), repeat=len(ids)):
            groups = [[d for d, w in zip(ids, where, strict=True) if w == s] for s in range(k)]
            if not all(groups):
                continue
            if not problem.allows_groups and any(len(g) > 1 for g in groups):
                continue
            if problem.pin_first is not None and problem.pin_first not in groups[0]:
                continue
            for cuts in itertools.combinations(range(1, n), k - 1):
                bounds = [0, *cuts, n]
                plans.append(
                    Plan(
                        tuple(
                            Stage.group(g, a, b)
                            for g, a, b in zip(groups, bounds, bounds[1:], strict=False)
                        )
                    )
                )
    return plans


def brute_force_literal(problem: PlanningProblem) -> Reference | None:
    """The least step time over every plan, each scored by :func:`score_plan`."""
    best: Reference | None = None
    for plan in all_plans(problem):
        sc = score_plan(problem, plan)
        if sc.feasible and (best is None or sc.step_time_s < best.step_time_s):
            best = Reference(sc.step_time_s, plan)
    return best


class _Tables:
    """The spec's terms for every range ``[h, i)``, device and cut, as arrays."""

    def __init__(self, problem: PlanningProblem) -> None:
        layers, devices = problem.layers, problem.devices
        n = len(layers)
        self.n, self.n_dev = n, len(devices)
        self.m = problem.microbatches
        self.b = problem.batch_size / problem.microbatches
        self.k = problem.optimizer_state_factor
        self.ids = [d.id for d in devices]
        self.pin = None if problem.pin_first is None else self.ids.index(problem.pin_first)

        def ranges(values: list[float]) -> np.ndarray:
            # Python's sum over the very slice score_plan sums: the same bits.
            out = np.full((n + 1, n + 1), np.nan)
            for h in range(n):
                for i in range(h + 1, n + 1):
                    out[h, i] = sum(values[h:i])
            return out

        self.flops = ranges([unit.train_flops for unit in layers])
        self.params = ranges([unit.param_bytes for unit in layers])
        self.acts = ranges([unit.saved_bytes for unit in layers])
        gflops = np.array([d.gflops for d in devices])
        self.memory = np.array([d.memory_bytes for d in devices])
        # compute[d, h, i] = T of [h, i) on d
        self.compute = self.b * self.flops[None, :, :] / (gflops[:, None, None] * 1e9)
        # link[d, e, i] = C of a cut after unit i - 1 (1 <= i <= n - 1) from d to e
        self.link = np.full((self.n_dev, self.n_dev, n + 1), np.nan)
        for d, e in itertools.product(range(self.n_dev), repeat=2):
            dd, ee = devices[d], devices[e]
            for i in range(1, n):
                self.link[d, e, i] = 2 * (dd.latency_ms + ee.latency_ms) / 1000 + 2 * self.b * (
                    layers[i - 1].out_bytes
                ) * 8 / (min(dd.bandwidth_mbps, ee.bandwidth_mbps) * 1e6)

    def need(self, from_end: int | np.ndarray) -> np.ndarray:
        """1F1B memory of every range as the stage ``from_end`` stages from the end
        (1 = last): ``k * params + min(S - s, M) * b * acts``, in the spec's order."""
        factor = np.minimum(from_end, self.m)
        return self.k * self.params + factor * self.b * self.acts


def brute_force(problem: PlanningProblem) -> Reference | None:
    """The least step time over every plan, by exhaustive enumeration (vectorised).

    For each stage count ``S`` every ordered ``S``-subset of devices (stage 0 on
    ``pin_first`` when given) is paired with every choice of ``S - 1`` cuts among
    the ``n - 1`` places; each pair is scored with the spec's formulas.
    """
    tab = _Tables(problem)
    n, m = tab.n, tab.m
    best: tuple[float, Plan] | None = None
    for s in range(1, min(tab.n_dev, n) + 1):
        orders = np.array(list(itertools.permutations(range(tab.n_dev), s)), dtype=np.intp)
        if tab.pin is not None:
            orders = orders[orders[:, 0] == tab.pin]
        bounds = np.array(
            [(0, *c, n) for c in itertools.combinations(range(1, n), s - 1)], dtype=np.intp
        )
        starts, ends = bounds[:, :-1], bounds[:, 1:]  # [Q, s]
        comp = tab.compute[orders[:, None, :], starts[None], ends[None]]  # [P, Q, s]
        from_end = np.arange(s, 0, -1)  # stage j is s - j from the end
        need = (
            tab.k * tab.params[starts, ends]
            + (np.minimum(from_end, m) * tab.b)[None, :] * tab.acts[starts, ends]
        )  # [Q, s]
        fits = (need[None] <= tab.memory[orders][:, None, :]).all(axis=2)  # [P, Q]
        if s > 1:
            links = tab.link[orders[:, None, :-1], orders[:, None, 1:], ends[None, :, :-1]]
            tau = np.maximum(comp.max(axis=2), links.max(axis=2))
            step = (m - 1) * tau + comp.sum(axis=2) + links.sum(axis=2)
        else:
            step = (m - 1) * comp.max(axis=2) + comp.sum(axis=2)
        step = np.where(fits, step, np.inf)
        p, q = np.unravel_index(int(np.argmin(step)), step.shape)
        if np.isfinite(step[p, q]) and (best is None or step[p, q] < best[0]):
            plan = Plan(
                tuple(
                    Stage(tab.ids[int(orders[p, j])], int(starts[q, j]), int(ends[q, j]))
                    for j in range(s)
                )
            )
            best = (float(step[p, q]), plan)
    return None if best is None else Reference(best[0], best[1])


@dataclass
class _Front:
    """Pareto-optimal suffix plans of one device sequence: point ``j`` starts at unit
    ``start[j]``, has bottleneck ``tau[j]`` and sum ``total[j]``; its first stage ends
    at ``end[j]``, where point ``parent[j]`` of the shorter sequence takes over."""

    start: np.ndarray
    tau: np.ndarray
    total: np.ndarray
    end: np.ndarray
    parent: np.ndarray


def _pareto(start: np.ndarray, tau: np.ndarray, total: np.ndarray, n: int) -> np.ndarray:
    """Indices of the points not dominated (lower-or-equal tau and total) within their start."""
    if start.size == 0:
        return np.zeros(0, dtype=np.intp)
    order = np.lexsort((total, tau, start))  # by start, then tau, then total
    _, rank = np.unique(total[order], return_inverse=True)
    # A key that falls at each new start, so that one running minimum serves every group.
    key = rank.astype(np.int64) + (n - start[order]).astype(np.int64) * (rank.size + 1)
    running = np.minimum.accumulate(key)
    keep = np.ones(order.size, dtype=bool)
    keep[1:] = key[1:] < running[:-1]
    return order[keep]


def pareto_exact(problem: PlanningProblem) -> Reference | None:
    """The least step time, exactly, by a Pareto dynamic programme over device sequences.

    For a device sequence ``q`` (the devices of the *last* ``len(q)`` stages, in
    order) and a unit ``h``, the front holds every non-dominated pair (bottleneck,
    sum of ``T`` and ``C``) of a way to run units ``h..n-1`` on ``q``. Prepending a
    device ``e`` with a stage ``[h, i)`` in front of a suffix starting at ``i``
    gives bottleneck ``max(T, C, tau)`` and sum ``T + C + total``; the memory of
    that stage depends on ``len(q) + 1`` (its distance from the end), which the
    sequence fixes. Both quantities only grow on prepending and the step time
    ``(M - 1) * tau + sum`` is increasing in both, so dominated pairs can never
    become optimal, and a pair whose step time already exceeds the best complete
    plan can be dropped. Every ordered device subset is visited (the trie of
    suffixes), so the method is exact.
    """
    tab = _Tables(problem)
    n, m = tab.n, tab.m
    fronts: dict[tuple[int, ...], _Front] = {}
    best: tuple[float, tuple[int, ...], int] | None = None

    def record(seq: tuple[int, ...], front: _Front) -> None:
        nonlocal best
        if tab.pin is not None and seq[0] != tab.pin:
            return
        for j in np.nonzero(front.start == 0)[0]:
            f = (m - 1) * float(front.tau[j]) + float(front.total[j])
            if best is None or f < best[0]:
                best = (f, seq, int(j))

    def bound() -> float:
        return np.inf if best is None else best[0]

    layer: list[tuple[int, ...]] = []
    hs = np.arange(n)
    for d in range(tab.n_dev):
        t = tab.compute[d, hs, n]
        ok = tab.need(1)[hs, n] <= tab.memory[d]
        front = _Front(hs[ok], t[ok], t[ok], np.full(int(ok.sum()), n), np.full(int(ok.sum()), -1))
        fronts[(d,)] = front
        record((d,), front)
        layer.append((d,))
    for depth in range(2, min(tab.n_dev, n) + 1):
        need = tab.need(depth)
        nxt: list[tuple[int, ...]] = []
        for child in layer:
            cf = fronts[child]
            d = child[0]
            if tab.pin is not None and d == tab.pin:
                continue  # pin_first's stage must be stage 0: nothing goes before it
            live = (cf.start >= 1) & ((m - 1) * cf.tau + cf.total <= bound())
            pts = np.nonzero(live)[0]
            if pts.size == 0:
                continue
            cut = cf.start[pts]  # [P]: the new stage ends where the child starts
            for e in range(tab.n_dev):
                if e in child:
                    continue
                h_grid = np.broadcast_to(hs[None, :], (pts.size, n))
                i_grid = np.broadcast_to(cut[:, None], (pts.size, n))
                valid = h_grid < i_grid
                h_safe = np.where(valid, h_grid, 0)
                t = tab.compute[e, h_safe, i_grid]
                c = tab.link[e, d, cut][:, None]
                valid &= need[h_safe, i_grid] <= tab.memory[e]
                tau = np.maximum(np.maximum(t, c), cf.tau[pts][:, None])
                total = t + c + cf.total[pts][:, None]
                valid &= (m - 1) * tau + total <= bound()
                rows, cols = np.nonzero(valid)
                if rows.size == 0:
                    continue
                start, tau_v, total_v = cols, tau[rows, cols], total[rows, cols]
                keep = _pareto(start, tau_v, total_v, n)
                seq: tuple[int, ...] = (e, *child)
                front = _Front(
                    start[keep], tau_v[keep], total_v[keep], cut[rows[keep]], pts[rows[keep]]
                )
                fronts[seq] = front
                record(seq, front)
                nxt.append(seq)
        layer = nxt
    if best is None:
        return None
    value, path, j = best
    stages = []
    for depth in range(len(path)):
        front = fronts[path[depth:]]
        stages.append(Stage(tab.ids[path[depth]], int(front.start[j]), int(front.end[j])))
        j = int(front.parent[j])
    return Reference(value, Plan(tuple(stages)))


# --- random problems ---------------------------------------------------------------

REGIMES = (
    "mixed",
    "tight_memory",
    "pinned_tight",
    "single_microbatch",
    "hetero_100x",
    "identical",
    "zero_latency",
    "slow_links",
    "zero_flops",
    "memory_at_boundary",
)
"""Named corners of the problem space; :func:`problems` draws from any of them."""


def _pos(lo: float, hi: float) -> st.SearchStrategy[float]:
    return st.floats(min_value=lo, max_value=hi, allow_nan=False, allow_infinity=False)


def _log(lo: float, hi: float) -> st.SearchStrategy[float]:
    """Spread over orders of magnitude between ``lo`` and ``hi`` (both > 0)."""
    return _pos(math.log10(lo), math.log10(hi)).map(lambda x: min(max(10.0**x, lo), hi))


@st.composite
def problems(
    draw: st.DrawFn, regime: str = "mixed", max_devices: int = 6, max_units: int = 10
) -> PlanningProblem:
    """A random problem of 1..``max_devices`` devices and 1..``max_units`` units in ``regime``.

    Scales are chosen so that compute and link times are comparable and optima of
    several stages are common; each regime pushes one feature to its corner.
    """
    assert regime in REGIMES, regime
    mixed = regime == "mixed"
    n_dev = draw(st.integers(1, max_devices), label="devices")
    n = draw(st.integers(1, max_units), label="units")
    zero_flops = regime == "zero_flops" or (mixed and draw(st.booleans()))
    layers = []
    for _ in range(n):
        zero = zero_flops and draw(st.booleans())
        fwd = 0.0 if zero else draw(_log(1e7, 1e11))
        bwd = 0.0 if zero and draw(st.booleans()) else draw(st.one_of(st.none(), _log(1e7, 2e11)))
        layers.append(
            {
                "fwd_flops": fwd,
                "bwd_flops": bwd,
                "param_bytes": draw(st.one_of(st.just(0.0), _log(1e3, 1e8))),
                "out_bytes": draw(st.one_of(st.just(0.0), _log(1e2, 1e7))),
                "act_bytes": draw(st.one_of(st.none(), st.just(0.0), _log(1e2, 1e7))),
            }
        )
    m = 1 if regime == "single_microbatch" else draw(st.integers(1, 16), label="microbatches")
    batch = draw(st.sampled_from([1.0, 8.0, 32.0, 100.0, 7.5]))
    k = draw(st.sampled_from([1.0, 2.0, 4.0, 5.5]))

    base = draw(_log(0.5, 200.0))
    spread = draw(st.sampled_from(["wide", "near", "100x" if mixed else "near"]))

    def speed() -> float:
        if regime == "hetero_100x" or spread == "100x":
            return draw(st.sampled_from([1.0, 100.0])) * draw(_pos(0.9, 1.1))
        if spread == "near":  # similar speeds: where splitting pays
            return base * draw(_pos(0.7, 1.3))
        return draw(_log(0.5, 200.0))

    same_speed, same_link = speed(), (draw(_log(10.0, 1e4)), draw(_pos(0.0, 5.0)))
    devices = []
    for j in range(n_dev):
        if regime == "identical":
            gflops, (bw, lat) = same_speed, same_link
        else:
            gflops = speed()
            if regime == "slow_links" or (mixed and draw(st.integers(0, 4)) == 0):
                bw = draw(_log(0.001, 0.1))
            else:
                bw = draw(_log(10.0, 1e4))
            lat = 0.0
            if regime != "zero_latency" and not (mixed and draw(st.booleans())):
                lat = draw(_pos(0.0, 50.0) if draw(st.booleans()) else _pos(0.0, 2.0))
        devices.append(
            {
                "id": f"d{j}",
                "gflops": gflops,
                "memory_bytes": 1e18,
                "bandwidth_mbps": bw,
                "latency_ms": lat,
            }
        )
    pin = None
    if regime == "pinned_tight" or (mixed and draw(st.booleans())):
        pin = f"d{draw(st.integers(0, n_dev - 1))}"
    problem = make_problem(layers, devices, batch_size=batch, microbatches=m, k=k, pin_first=pin)

    # Memory is ample in half of the other regimes' problems, tight in the rest.
    tight = regime in ("tight_memory", "pinned_tight", "single_microbatch") or draw(st.booleans())
    if tight or regime == "memory_at_boundary":
        tab = _Tables(problem)
        # The model's total k * params + M * b * acts: what one stage of everything
        # would need with all M microbatches in flight.
        scale = float(tab.need(m)[0, n])
        # At the boundary: a random plan of all min(D, n) stages whose every stage needs
        # exactly its device's memory, to the bit (feasible only if ``<=`` is exact);
        # devices beyond the plan get exactly what some range needs somewhere.
        stages = min(n_dev, n)
        cuts: list[int] = []
        if stages > 1:
            inner = st.integers(1, n - 1)
            cuts = sorted(draw(st.sets(inner, min_size=stages - 1, max_size=stages - 1)))
        bounds = [0, *cuts, n]
        order = draw(st.permutations(range(n_dev)))
        for slot, j in enumerate(order):
            if regime != "memory_at_boundary":
                mem = scale * draw(_log(0.02, 1.3))
            elif slot < stages:
                mem = float(tab.need(stages - slot)[bounds[slot], bounds[slot + 1]])
            else:
                h = draw(st.integers(0, n - 1))
                i = draw(st.integers(h + 1, n))
                mem = float(tab.need(draw(st.integers(1, n_dev)))[h, i])
            devices[j]["memory_bytes"] = mem if mem > 0 else 1.0
        if regime == "memory_at_boundary" and pin is not None:
            pin = str(devices[order[0]]["id"])
        problem = make_problem(
            layers, devices, batch_size=batch, microbatches=m, k=k, pin_first=pin
        )
    return problem


def random_problem(
    seed: int,
    n_devices: int,
    n_units: int,
    *,
    memory_fraction: tuple[float, float] = (0.1, 1.5),
    pinned: bool = False,
    microbatches: int = 4,
    slow_links: bool = False,
) -> PlanningProblem:
    """A seeded random problem for the fixed-size checks (no hypothesis)."""
    rng = random.Random(seed)
    layers = [
        {
            "fwd_flops": 0.0 if rng.random() < 0.1 else 10 ** rng.uniform(7, 10),
            "param_bytes": 10 ** rng.uniform(3, 7.5),
            "out_bytes": 10 ** rng.uniform(3, 6),
            "act_bytes": 10 ** rng.uniform(3, 6.5),
        }
        for _ in range(n_units)
    ]
    devices: list[dict[str, Any]] = [
        {
            "id": f"dev{j:02d}",
            "gflops": rng.choice([1.0, 5.0, 20.0, 100.0]) * rng.uniform(0.8, 1.25),
            "memory_bytes": 1.0,
            "bandwidth_mbps": rng.uniform(0.5, 5.0) if slow_links else 10 ** rng.uniform(1, 3),
            "latency_ms": rng.choice([0.0, rng.uniform(0.1, 20.0)]),
        }
        for j in range(n_devices)
    ]
    batch = 32.0
    k = 4.0
    b = batch / microbatches
    total = k * sum(unit["param_bytes"] for unit in layers) + microbatches * b * sum(
        unit["act_bytes"] for unit in layers
    )
    for dev in devices:
        dev["memory_bytes"] = total * rng.uniform(*memory_fraction)
    pin = devices[rng.randrange(n_devices)]["id"] if pinned else None
    return make_problem(
        layers, devices, batch_size=batch, microbatches=microbatches, k=k, pin_first=pin
    )
