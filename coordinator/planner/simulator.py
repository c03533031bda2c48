"""Event-driven simulation of one training step of a plan under a schedule.

This module owns the timing model of one step, finer than the spec's closed form
(:func:`coordinator.planner.score.score_plan`), and what it reports: the step
time, idle share, per-stage busy time and peak memory, and the timeline as data
(JSON, Chrome trace). It reads ``T_s`` and ``C_s`` from ``score_plan``, so both
price the same plan; the schedule is data from :mod:`edge.runtime.schedules`.

The model:

- Stage ``s`` runs its actions in the schedule's order, one at a time. A forward
  takes ``f_s = T_s * phi_s`` and a backward ``g_s = T_s - f_s``, where ``phi_s``
  is the stage's share of forward FLOPs, ``sum(fwd) / sum(fwd + bwd)``. A schedule
  that splits the backward ([Note: zero bubble] in :mod:`edge.runtime.schedules`)
  runs its ``B`` in ``min(f_s, g_s)``, an input gradient costing what the forward
  costs (a matmul's or a convolution's, transposed), and its ``W`` in the rest of
  ``g_s``; on stage 0, whose input takes no gradient, ``B`` is free and ``W`` is all
  of ``g_s``, as the runtime does it.
- Link ``s`` joins stages ``s`` and ``s + 1``. The spec's ``C_s`` is a round trip
  (an activation forward, its gradient back, each paying both latencies), so
  each direction takes ``c_s = C_s / 2``. Each direction is a resource carrying
  one tensor at a time, first come first served; latency occupies it too (not
  pipelined, the conservative reading). Sending overlaps computing, and a
  device's links to its two neighbours do not share its bandwidth (as in the spec).
- An action starts when its stage is free and its input is there: ``F`` on stage
  0 needs nothing, ``F`` on stage ``s`` the activation from ``s - 1``; ``B`` needs
  the stage's own ``F`` of that microbatch and, except on the last stage, the
  gradient from ``s + 1``; ``W`` needs the stage's own ``B``. The gradient leaves
  when ``B`` ends.
- A microbatch's activations are held from the start of its ``F`` to the end of
  its backward (its ``W`` when split); memory is ``k * params + held * b * acts``.
  The optimizer step after the last backward is taken as free, so the step ends
  with the stage's last action, or, in a version 2 plan, when the last group has
  summed its gradients: stage ``s``'s group sends its reduce-scatter half while
  its own last action runs, and takes the rest, ``R_s - min(R_s / 2, last)``,
  after it ([Note: what the overlap hides] in
  :mod:`coordinator.planner.predict`; the spec's score keeps the whole ``R_s``, so
  here a group's step is that much below the closed form). A group runs as one stage at the
  score's ``T_s`` (its members' summed speed); its peak memory is its most
  loaded member's, whose share of each microbatch it holds. A U-shaped plan's two
  ends (:attr:`~coordinator.planner.score.Plan.u_shaped`) are simulated as two
  stages: that the holders compute both on the same devices is in the score, not
  here.

[Note: closed form versus simulation]

The spec's step time ``(M - 1) * tau + sum(T) + sum(C)`` moves each microbatch
through a stage as one block ``T_s`` and through a link as one block ``C_s``.
Write ``L = S - 1`` for the last stage.

*Exact for 1F1B.* The simulated 1F1B step equals the closed form when ``M = 1``,
or when all three hold:

(a) ``T_L = tau``: the last stage is a bottleneck;
(b) ``T_s + C_s <= T_L`` for every ``s < L`` that runs steady-state forwards
    (``M > S - s``);
(c) ``min(L - s, M - 1) * m_s <= T_L + sum(T_q + C_q for s < q < L)`` for every
    ``s < L``, where ``m_s = max(f_0..f_s, c_0..c_s)`` (warm-up keeps up).

So: one stage, any ``M``: ``M * T``; ``S`` stages of equal ``T`` and free links,
whatever the forward shares: ``(M + S - 1) * T``, idle share ``(S - 1) / (M + S - 1)``.

*Proof.* ``M = 1``: one microbatch crosses every stage and link forward and back:
``sum(T) + sum(C)``. Otherwise, lower bound (any schedule): the last stage cannot
start before ``A = sum(f_s + c_s for s < L)``, then works ``M * T_L`` one action at
a time, and its last gradient needs ``sum(g_s + c_s for s < L)`` to reach stage 0;
under (a) the sum is the closed form. Upper bound: every constraint has the form
"start >= max(ends of predecessors)" (links in the order the sender produces), so
the simulated times are the least solution, and any times satisfying every
constraint bound them. Take: the last stage busy without a gap, ``F_i`` at
``A + i * T_L``; ``B_i`` of stage ``s < L`` the moment its gradient arrives,
``A + (i + 1) * T_L + sum(g_q, s < q < L) + sum(c_q, s <= q < L)``; warm-up
forwards as soon as possible (a tandem line: ``F_i`` of stage ``s`` reaches stage
``s + 1`` by ``sum(f_r + c_r, r <= s) + i * m_s``); each steady forward right
after the backward before it.
Gradient edges hold with equality; steady ``F`` then ``B`` on a stage needs
``T_s <= T_L``; a steady forward reaching the next stage in time needs (b); the
last warm-up forward reaching stage ``s + 1`` before its first steady forward
(and stage ``s``'s own ``B_0``) needs (c); in steady state each link direction
carries one tensor per ``T_L >= c_s``. These times end at the lower bound. QED.
The tests check it on random plans; (b) and (c) are sufficient, not necessary.

*Where they differ.* The closed form is neither an upper nor a lower bound on
the 1F1B step (one unit per stage, ``bwd = 2 * fwd`` unless said):

- The bottleneck is not last (first or middle): the formula charges the later stages in full,
  but 1F1B overlaps them with the bottleneck's drain. ``T = [3, 1]``, free link,
  ``M = 4``: closed form 13, simulated 12.
- A link too slow for the window: 1F1B keeps at most ``S - s`` microbatches in
  flight at stage ``s``, and a slow round trip starves the next stage, so the
  formula is optimistic. ``T = [1, 1]``, ``C = [1]``, ``M = 8``: closed form 10,
  simulated 13 (GPipe, whose window is ``M``: 11.17). ``T = [1, 2]``: exact, 18.
- A link as bottleneck: the formula charges ``C_s`` per microbatch, but the two
  directions work in parallel. ``T = [0.1, 0.1]``, ``C = [1]``, ``M = 8``: 8.2
  against 5.3.
- The split into ``F`` and ``B``: a stage with slow forwards spends long on its
  ``S - s`` warm-up forwards before its first backward, which holds up the
  backwards of the stages before it (a violation of (c)).
  ``T = [1, 1, 0.5, 1]``, stage 1 all forward (``bwd = 0``), the others all
  backward, free links, ``M = 3``: closed form 5.5, simulated 6.

GPipe's two phases are tandem lines, so here it is exactly ``sum(T) + sum(C) +
(M - 1) * (max(f_s, c_s over s) + max(g_s, c_s over s))``: never below the closed
form, equal to 1F1B for equal stages with equal forward shares and free links.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from coordinator.planner.score import Plan, member_needs, score_plan
from coordinator.planner.terms import need_bytes, ordered_sum
from edge.config import Schedule as ScheduleName
from edge.files import write_atomic
from edge.problem import PlanningProblem
from edge.runtime.schedules import (
    Action,
    Schedule,
    is_split,
    make_schedule,
    splits_backward,
    validate_schedule,
)

__all__ = [
    "DeadlockError",
    "SimulationResult",
    "TimelineEvent",
    "fastest_schedule",
    "memory_error",
    "schedule_saving",
    "simulate",
]

EventKind = Literal["F", "B", "W", "send-fwd", "send-bwd"]


@dataclass(frozen=True)
class TimelineEvent:
    """One interval of work: a stage computing, or a link carrying one tensor."""

    lane: Literal["stage", "link"]
    index: int
    """Stage ``s``; for a link, the link between stage ``s`` and ``s + 1``."""
    kind: EventKind
    """``F``/``B``/``W`` on a stage; ``send-fwd`` (activation to ``s + 1``) or
    ``send-bwd`` (gradient to ``s``) on a link."""
    microbatch: int
    start_s: float
    end_s: float


class DeadlockError(RuntimeError):
    """No action can start, yet some remain: the schedule's order is impossible."""


@dataclass(frozen=True)
class SimulationResult:
    """What one simulated step did; times in seconds, memory in bytes."""

    schedule: str
    """The schedule's name, or ``"custom"`` for one given as actions."""
    devices: list[str]
    """The device of each stage."""
    num_microbatches: int
    step_time_s: float
    """When the last backward ends and the groups have summed (the optimizer step is
    taken as free)."""
    bubble_fraction: float
    """Idle share of stage-time: ``1 - sum(busy_s) / (S * step_time_s)``."""
    busy_s: list[float]
    """Per stage, the time spent computing."""
    peak_memory_bytes: list[float]
    """Per stage, ``k * params + (most microbatches held at once) * b * acts``."""
    peak_microbatches_held: list[int]
    """Per stage, the most microbatches whose activations were held at once."""
    timeline: list[TimelineEvent]
    """Every compute and transfer interval, ordered by start."""

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["timeline"] = [asdict(e) for e in self.timeline]
        return out

    def to_chrome_trace(self) -> dict[str, Any]:
        """Chrome trace event format (``chrome://tracing``, Perfetto): one process per
        stage, threads for its compute and its two outgoing link directions."""
        events: list[dict[str, Any]] = []
        threads = {0: "compute", 1: "send activations ->", 2: "<- send gradients"}
        for s, device in enumerate(self.devices):
            events.append(_meta("process_name", s, 0, f"stage {s} ({device})"))
            events.append(_meta("process_sort_index", s, 0, s, key="sort_index"))
            for tid, name in threads.items():
                events.append(_meta("thread_name", s, tid, name))
        for e in self.timeline:
            if e.lane == "stage":
                pid, tid, name = e.index, 0, f"{e.kind}{e.microbatch}"
            elif e.kind == "send-fwd":  # sent by the stage before the link
                pid, tid, name = e.index, 1, f"act {e.microbatch}"
            else:  # sent by the stage after the link
                pid, tid, name = e.index + 1, 2, f"grad {e.microbatch}"
            events.append(
                {
                    "name": name,
                    "cat": e.lane,
                    "ph": "X",
                    "pid": pid,
                    "tid": tid,
                    "ts": e.start_s * 1e6,
                    "dur": (e.end_s - e.start_s) * 1e6,
                    "args": {"microbatch": e.microbatch, "kind": e.kind},
                }
            )
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write_chrome_trace(self, path: Path | str) -> None:
        write_atomic(path, json.dumps(self.to_chrome_trace()))


def _meta(name: str, pid: int, tid: int, value: object, key: str = "name") -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": {key: value}}


def simulate(
    problem: PlanningProblem,
    plan: Plan,
    schedule: str | Sequence[Sequence[Action]] = "1f1b",
    *,
    sum_every: int = 1,
) -> SimulationResult:
    """Simulate one step of ``plan`` under ``schedule`` (a name from
    :data:`edge.runtime.schedules.SCHEDULES`, or actions per stage). ``sum_every``: a
    non-exact job's groups sum once in that many steps, after the optimizer's step (none
    of it hidden behind a backward), and the step is the mean one ([Note: a DiLoCo
    group's sum] in :mod:`coordinator.planner.predict`).

    Raises ``ValueError`` for an invalid plan or a schedule that does not run
    every microbatch's ``F`` and ``B`` (and ``W``, or none) once per stage, and
    :class:`DeadlockError` for one whose order cannot complete.
    """
    score = score_plan(problem, plan)
    n_stages, m = len(plan.stages), problem.microbatches
    if isinstance(schedule, str):
        name, actions = schedule, make_schedule(schedule, n_stages, m)
    else:
        name, actions = "custom", [list(a) for a in schedule]
    validate_schedule(actions, n_stages, m)

    b = problem.batch_size / problem.microbatches
    k = problem.optimizer_state_factor
    fwd_s, bwd_s = _forward_backward(problem, plan, score.compute_s)
    params, acts = [], []
    for st in plan.stages:
        chunk = problem.layers[st.start : st.end]
        # The same sums in the same order as score_plan, so the peaks match it exactly.
        params.append(ordered_sum(unit.param_bytes for unit in chunk))
        acts.append(ordered_sum(unit.saved_bytes for unit in chunk))

    run = _Run(actions, fwd_s, _split(actions, fwd_s, bwd_s), [c / 2 for c in score.link_s])
    run.run()
    compute = [e for e in run.timeline if e.lane == "stage"]
    # A group sums its gradients (version 2's ``R_s``, 0 for one device), its
    # reduce-scatter half during its last backward or weight pass ([Note: what the
    # overlap hides] in coordinator.planner.predict): what is left of it runs after
    # that, and the step ends when the last group has summed.
    last = [
        max((e for e in compute if e.index == s), key=lambda e: e.end_s) for s in range(n_stages)
    ]
    reduce = score.allreduce_s or [0.0] * n_stages
    if sum_every > 1:
        step = max(e.end_s + r / sum_every for e, r in zip(last, reduce, strict=True))
    else:
        step = max(
            e.end_s + r - min(r / 2, e.end_s - e.start_s) for e, r in zip(last, reduce, strict=True)
        )
    busy = [0.0] * n_stages
    for e in compute:
        busy[e.index] += e.end_s - e.start_s
    bubble = 1 - sum(busy) / (n_stages * step) if step > 0 else 0.0
    return SimulationResult(
        schedule=name,
        devices=["+".join(st.devices) for st in plan.stages],
        num_microbatches=m,
        step_time_s=step,
        bubble_fraction=bubble,
        busy_s=busy,
        peak_memory_bytes=[
            need_bytes(k, params[s], run.peak[s], max(score.shares[s]), b, acts[s])
            for s in range(n_stages)
        ],
        peak_microbatches_held=run.peak,
        timeline=sorted(run.timeline, key=lambda e: (e.start_s, e.lane != "stage", e.index)),
    )


def _split(actions: Schedule, fwd_s: list[float], bwd_s: list[float]) -> list[tuple[float, float]]:
    """Per stage, the seconds of its ``B`` and of its ``W`` (0 for a whole backward)."""
    out = []
    for s, (f, g) in enumerate(zip(fwd_s, bwd_s, strict=True)):
        if not is_split(actions[s]):
            out.append((g, 0.0))
        else:
            inp = 0.0 if s == 0 else min(f, g)  # stage 0's input takes no gradient
            out.append((inp, g - inp))
    return out


def fastest_schedule(
    problem: PlanningProblem,
    plan: Plan,
    *,
    sum_every: int = 1,
    split: bool = True,
) -> tuple[ScheduleName, dict[str, float]]:
    """The schedule whose simulated step of ``plan`` is shortest among those its devices
    hold (:func:`memory_error`), 1F1B on a tie, and each of those schedules' step
    (``sum_every``: as :func:`simulate`'s; ``split=False``: none that splits a backward,
    for a job whose stages cannot). 1F1B fits whatever the planner found; should it not
    (shares the score does not know), it is what the job would have run anyway."""
    names: tuple[ScheduleName, ...] = tuple(
        n for n in get_args(ScheduleName) if split or not splits_backward(n)
    )
    sims = {name: simulate(problem, plan, name, sum_every=sum_every) for name in names}
    fits = [n for n in names if memory_error(problem, plan, n, sims[n]) is None]
    steps: dict[str, float] = {n: sims[n].step_time_s for n in fits}
    fallback: ScheduleName = "1f1b"
    return min(fits, key=lambda name: steps[name], default=fallback), steps


def _forward_backward(
    problem: PlanningProblem, plan: Plan, compute_s: Sequence[float]
) -> tuple[list[float], list[float]]:
    """Each stage's ``compute_s`` per microbatch split into its forward and backward by the
    stage's share of forward FLOPs (half and half for a stage without FLOPs)."""
    fwd_s, bwd_s = [], []
    for st, t in zip(plan.stages, compute_s, strict=True):
        chunk = problem.layers[st.start : st.end]
        total = sum(unit.train_flops for unit in chunk)
        share = sum(unit.fwd_flops for unit in chunk) / total if total > 0 else 0.5
        fwd_s.append(t * share)
        bwd_s.append(t - fwd_s[-1])
    return fwd_s, bwd_s


def schedule_saving(
    problem: PlanningProblem,
    plan: Plan,
    compute_s: Sequence[float],
    link_s: Sequence[float],
    schedule: str,
) -> float:
    """Seconds a step takes under 1F1B beyond what it takes under ``schedule``, both
    simulated on these per-microbatch stage times and link round trips (the internal
    model's, say) instead of the spec's: what a model of 1F1B's shape takes off for
    ``schedule`` (negative for a slower one). Group sums are left out: they end the step
    the same way under every schedule."""
    if schedule == "1f1b":
        return 0.0
    n, m = len(plan.stages), problem.microbatches
    fwd_s, bwd_s = _forward_backward(problem, plan, compute_s)
    sends = [c / 2 for c in link_s]

    def step(name: str) -> float:
        actions = make_schedule(name, n, m)
        run = _Run(actions, fwd_s, _split(actions, fwd_s, bwd_s), sends)
        run.run()
        return max(e.end_s for e in run.timeline if e.lane == "stage")

    return step("1f1b") - step(schedule)


def memory_error(
    problem: PlanningProblem,
    plan: Plan,
    schedule: str,
    simulated: SimulationResult | None = None,
) -> str | None:
    """Why ``plan`` does not fit its devices' memory under ``schedule``, in one line, or
    ``None`` when it does; ``simulated``: the plan's step under it, when already simulated.

    The planner checks 1F1B's memory, ``min(S - s, M)`` microbatches in flight on stage
    ``s``. GPipe holds ``M`` on every stage and ZB-H1 ``min(S, M)``, so a plan can fit
    under one and not the other. This is the score's per-member check (the member with
    the least room decides; a U-shape's tail also holds the head) at the simulated peak.
    """
    sim = simulated if simulated is not None else simulate(problem, plan, schedule)
    shares = score_plan(problem, plan).shares
    needs = member_needs(problem, plan, shares, sim.peak_microbatches_held)
    devices = {d.id: d for d in problem.devices}
    for s, (st, need) in enumerate(zip(plan.stages, needs, strict=True)):
        held = sim.peak_microbatches_held[s]
        for device, bytes_ in zip(st.devices, need, strict=True):
            has = devices[device].memory_bytes
            if bytes_ > has:
                return (
                    f"stage {s} on {device} needs {bytes_ / 2**20:.0f} MiB under {schedule} "
                    f"({held} microbatches in flight), and it has {has / 2**20:.0f} MiB: "
                    "use 1f1b or more microbatches"
                )
    return None


class _Run:
    """The event loop. Events are ``(time, seq, stage, what, microbatch)``: ``what``
    is ``F``/``B``/``W`` (that compute ended on ``stage``) or ``act``/``grad`` (that
    input arrived at ``stage``); ``seq`` keeps ties in the order they were made."""

    def __init__(
        self,
        actions: Schedule,
        fwd_s: list[float],
        bwd_s: list[tuple[float, float]],
        send_s: list[float],
    ) -> None:
        n = len(actions)
        self.actions, self.fwd_s, self.bwd_s, self.send_s = actions, fwd_s, bwd_s, send_s
        self.split = [is_split(row) for row in actions]
        self.next = [0] * n
        self.busy = [False] * n
        self.inputs: list[set[tuple[str, int]]] = [set() for _ in range(n)]
        self.forwarded: list[set[int]] = [set() for _ in range(n)]
        self.backwarded: list[set[int]] = [set() for _ in range(n)]
        self.held = [0] * n
        self.peak = [0] * n
        self.link_free: dict[tuple[int, str], float] = {}
        self.heap: list[tuple[float, int, int, str, int]] = []
        self.seq = 0
        self.now = 0.0
        self.timeline: list[TimelineEvent] = []

    def run(self) -> None:
        self._start_ready()
        while self.heap:
            self.now, _, s, what, mb = heapq.heappop(self.heap)
            if what == "F":
                self.busy[s] = False
                self.forwarded[s].add(mb)
                if s + 1 < len(self.actions):
                    self._send(s, "send-fwd", mb, to=s + 1, what="act")
            elif what == "B":
                self.busy[s] = False
                self.backwarded[s].add(mb)
                if not self.split[s]:
                    self.held[s] -= 1
                if s > 0:
                    self._send(s - 1, "send-bwd", mb, to=s - 1, what="grad")
            elif what == "W":
                self.busy[s] = False
                self.held[s] -= 1
            else:
                self.inputs[s].add((what, mb))
            self._start_ready()
        stuck = [s for s, acts in enumerate(self.actions) if self.next[s] < len(acts)]
        if stuck:
            waits = "; ".join(self._waiting_for(s) for s in stuck)
            raise DeadlockError(f"schedule deadlocks at t={self.now:.6g} s: {waits}")

    def _ready(self, s: int, a: Action) -> bool:
        if a.kind == "F":
            return s == 0 or ("act", a.microbatch) in self.inputs[s]
        if a.kind == "W":
            return a.microbatch in self.backwarded[s]
        last = s == len(self.actions) - 1
        return a.microbatch in self.forwarded[s] and (
            last or ("grad", a.microbatch) in self.inputs[s]
        )

    def _start_ready(self) -> None:
        for s, acts in enumerate(self.actions):
            if self.busy[s] or self.next[s] == len(acts) or not self._ready(s, acts[self.next[s]]):
                continue
            a = acts[self.next[s]]
            self.next[s] += 1
            self.busy[s] = True
            if a.kind == "F":
                # Activations count from the forward's start to the backward's end.
                self.held[s] += 1
                self.peak[s] = max(self.peak[s], self.held[s])
            took = {"F": self.fwd_s[s], "B": self.bwd_s[s][0], "W": self.bwd_s[s][1]}[a.kind]
            end = self.now + took
            self.timeline.append(
                TimelineEvent(
                    lane="stage",
                    index=s,
                    kind=a.kind,
                    microbatch=a.microbatch,
                    start_s=self.now,
                    end_s=end,
                )
            )
            self._push(end, s, a.kind, a.microbatch)

    def _send(self, link: int, kind: EventKind, mb: int, to: int, what: str) -> None:
        # One transfer at a time per link direction, first come first served.
        start = max(self.now, self.link_free.get((link, kind), 0.0))
        end = start + self.send_s[link]
        self.link_free[link, kind] = end
        self.timeline.append(
            TimelineEvent(
                lane="link", index=link, kind=kind, microbatch=mb, start_s=start, end_s=end
            )
        )
        self._push(end, to, what, mb)

    def _push(self, time: float, s: int, what: str, mb: int) -> None:
        heapq.heappush(self.heap, (time, self.seq, s, what, mb))
        self.seq += 1

    def _waiting_for(self, s: int) -> str:
        a = self.actions[s][self.next[s]]
        if a.kind == "F":
            need = f"the activation of microbatch {a.microbatch} from stage {s - 1}"
        elif a.kind == "W":
            need = f"its own B{a.microbatch}"
        elif a.microbatch not in self.forwarded[s]:
            need = f"its own F{a.microbatch}"
        else:
            need = f"the gradient of microbatch {a.microbatch} from stage {s + 1}"
        return f"stage {s} waits at {a} for {need}"
