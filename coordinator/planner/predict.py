"""The planner's internal cost model: what a plan's step will take on real devices.

The spec's score (:mod:`coordinator.planner.score`) prices FLOPs and bytes and
nothing else, so that anyone can check a plan with a calculator; a problem file
is always scored that way. A job's devices know more. This module owns the one
prediction every job shows and plans by, :func:`predict`:

- compute per microbatch of stage ``s``: the stage's units' measured seconds
  (:class:`UnitSeconds`, timed once per model and batch shape on this machine
  through the real training step) scaled from this machine's best matmul rate to
  each member's speed (a measured device's best rate over its software slowdown,
  else its ``gflops``; see :func:`device_speed`), at the member's share of the rows
  (:meth:`UnitSeconds.at_share`: a part of each unit's time does not shrink with
  the rows, so a member of a group of four takes more than a quarter of the
  whole microbatch's time; but not on a device that emulates a slower one with
  the software throttle, see [Note: the fixed part under a throttle]); a device
  that timed the units itself (``UnitSeconds.devices``, a job's
  ``unit_times="devices"``: [Note: a device's own unit seconds] in
  :mod:`coordinator.engine.unit_profiles`) takes its own seconds unscaled; the
  slowest member's; without them, the spec's
  ``T_s``. A job is also cut by these seconds (:func:`timed_problem`). Plus the device's
  fixed cost per microbatch (two thirds of it before the last stage, which alone
  runs the loss: the cost is per compute block, see
  :data:`~edge.profiling.fixed_costs.PROBE_BLOCKS`);
- link per microbatch: the spec's ``C_s`` plus one frame's fixed cost on each
  side (the activation's sender, the gradient's sender), plus the CPU its bytes
  cost each member both ways (its share of them times its ``byte_s``);
- a group's sum: the larger of the spec's ``R_s`` (each member's link still
  receives ``2 (g - 1) / g`` of the gradients) and the time of what each member
  moves at the slowest member's ``byte_s``: it publishes the whole vector's size
  (the all-gather is one publish, fanned out by the broker: [Note: the all-gather
  is one publish] in :mod:`edge.runtime.group_sum`) and receives ``2 (g - 1) / g``
  of it (:func:`edge.wire.groups.sum_traffic`); ``byte_s`` prices a byte sent and
  received together (the probe publishes to itself), so each side at half of it
  (:func:`edge.runtime.group_sum.sum_load`: a ring's share, or ``g - 1`` whole
  vectors in for a small sum); its frames are not priced ([Note: a small sum over
  many members is its frames]).
  The larger, not the sum: the pieces keep both busy at once (see [Note: a group's
  sum is the larger of its links and its bytes]). The links' part is less what the
  last backward hides of it ([Note: what the overlap hides]);
- per step: the slowest stage's fixed cost per step plus one frame (its report),
  and on a pipeline the labels stage 0 sends the last stage, one frame each
  (none when the labels stay home: a U-shaped plan, whose holders compute both
  ends, so ``tau`` is at least their sum, as in the score);
- step time: the spec's shape, ``(M - 1) * tau + sum(T) + sum(C) + max(R)``, over
  these terms, plus the per-step terms.

[Note: what the overlap hides]
A group's member sends each piece of its reduce-scatter as soon as its gradients are
final, during the step's last backward ([Note: the sum overlapped with the backward]
in :mod:`edge.runtime.group_sum`). So of the links' ring time ``R_s`` (half of it the
reduce-scatter, half the all-gather) the reduce-scatter's half can pass while the
last backward computes: ``min(R_s / 2, bwd)`` is hidden, ``bwd`` the member's backward
of one microbatch (its seconds a microbatch times the stage's backward share of
FLOPs; the member with the least). The all-gather must wait for every member's sum,
and what the bytes cost the members' CPU is spent either way, so neither hides. The
spec's score keeps its ``R_s`` (a problem file scores as the spec says).

A device's fixed costs are what its agent measured and announced
(:func:`edge.profiling.fixed_costs.fixed_costs_of`); a device without them (a
catalogue entry, a problem file) costs nothing fixed. With no unit seconds and no
fixed costs the prediction is the spec's step time (up to rounding).

[Note: a DiLoCo group's sum]
A non-exact job's group (``diloco``, [Note: DiLoCo in a group] in
:mod:`edge.runtime.outer_sync`) sums once in ``every`` steps, after the step's own
optimizer step, so nothing of it hides behind a backward: its whole sum, the larger of
the links' ``R_s`` and what the members' CPU moves, is spread over ``every`` steps.
The rest of the step is an exact one's.

[Note: another schedule]
The step's shape is 1F1B's. Under another schedule (ZB-H1 fills the drain with weight
passes, GPipe holds every forward first) :func:`under_schedule` takes off what the
event simulator (:func:`coordinator.planner.simulator.schedule_saving`) finds that
schedule saves over 1F1B on this prediction's own stage and link times: the shape's
terms stay, and the bubble shrinks by the saving (:mod:`coordinator.planner.anatomy`).

The simulator (``plan --timeline``) and the rebalancer stay on the spec score:
they compare a plan with others under one calculator-checkable model, and the
rebalancer's measured/predicted factors are per device compute, which fixed terms
per step would blur.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from coordinator.planner.score import Plan, Stage, for_plan, member_seconds, score_plan
from coordinator.planner.simulator import schedule_saving
from edge.models.zoo import get_model
from edge.problem import DeviceSpec, PlanningProblem
from edge.profiling.fixed_costs import PROBE_BLOCKS, FixedCosts, fixed_costs_of
from edge.profiling.matmul import matmul_benchmark
from edge.runtime.group_sum import sum_load
from edge.runtime.unit_times import Timing, UnitTime, measure_unit_times
from edge.wire.messages import OptimizerSpec

__all__ = [
    "PLANNING_DETAILS",
    "SMALL_ROWS_DIVISOR",
    "Prediction",
    "UnitSeconds",
    "balanced_shares",
    "calibrated",
    "device_speed",
    "fit_unit_seconds",
    "measure_unit_seconds",
    "predict",
    "small_rows",
    "timed_problem",
    "under_schedule",
]

_NONE = FixedCosts(0.0, 0.0, 0.0, 0.0)

PLANNING_DETAILS = ("fixed_costs", "matmul", "slowdown")
"""The keys of a device's free-form ``details`` this model reads; whoever hands devices
to the planner without the rest of their details keeps these."""


@dataclass(frozen=True)
class UnitSeconds:
    """Each unit's seconds per microbatch of a training step on this machine (forward,
    backward, its optimizer share), and this machine's matmul GFLOP/s under the same
    threads: a device of ``g`` GFLOP/s takes ``seconds * gflops / g``."""

    seconds: tuple[float, ...]
    gflops: float
    fixed: tuple[float, ...] = ()
    """Each unit's part of ``seconds`` that does not shrink with the rows of the
    microbatch (the optimizer step, per-call overheads, kernels less efficient on few
    rows): the intercept of the line through its timings at two row counts
    (:func:`fit_unit_seconds`). Empty: time proportional to the rows."""

    devices: Mapping[str, UnitSeconds] = field(default_factory=dict, hash=False)
    """Devices that timed the units themselves, under their own limits
    (:mod:`coordinator.engine.unit_profiles`): each one's own seconds, which it takes
    as they are, instead of these scaled to its speed."""

    def at_share(self, start: int, end: int, share: float, *, fixed_whole: bool = True) -> float:
        """Seconds per microbatch of units ``start..end-1`` for a member computing
        ``share`` of each microbatch's rows: the fixed part whole, the rest by share
        (without ``fixed_whole``, all of it by share)."""
        total = sum(self.seconds[start:end])
        fixed = sum(self.fixed[start:end]) if self.fixed and fixed_whole else 0.0
        return fixed + (total - fixed) * share

    def on_device(self, device: DeviceSpec, start: int, end: int, share: float) -> float:
        """Seconds per microbatch of units ``start..end-1`` on ``device`` at ``share`` of the
        rows: its own seconds where it timed them, else these at its speed
        (:func:`device_speed`); the fixed part whole unless it runs the software
        throttle ([Note: the fixed part under a throttle])."""
        whole = not _throttled(device)
        own = self.devices.get(device.id)
        if own is not None:
            return own.at_share(start, end, share, fixed_whole=whole)
        return (
            self.at_share(start, end, share, fixed_whole=whole) * self.gflops / device_speed(device)
        )

    def speed(self, device: DeviceSpec) -> float:
        """The GFLOP/s ``device`` computes these units at: :func:`device_speed`, or where it
        timed them itself, what its own seconds of the whole model are worth at
        ``gflops`` (a speed for the spec's search of :func:`timed_problem`; a prediction
        takes its seconds unit by unit)."""
        own = self.devices.get(device.id)
        if own is None or sum(own.seconds) <= 0:
            return device_speed(device)
        return self.gflops * sum(self.seconds) / sum(own.seconds)

    def at_rows(self, rows: float, timed_rows: float) -> UnitSeconds:
        """These seconds, timed at ``timed_rows`` rows a microbatch, moved along each unit's
        fitted line to ``rows`` rows: the fixed part as it is, the rest in proportion
        (the devices' own seconds too, timed at the same rows)."""
        if rows == timed_rows:
            return self
        k = rows / timed_rows
        fixed = self.fixed or (0.0,) * len(self.seconds)
        seconds = tuple(f + (s - f) * k for s, f in zip(self.seconds, fixed, strict=True))
        devices = {d: u.at_rows(rows, timed_rows) for d, u in self.devices.items()}
        return UnitSeconds(seconds, self.gflops, self.fixed, devices)

    def check(self, problem: PlanningProblem) -> None:
        """:class:`ValueError` unless these, and each device's own, have one entry per
        layer of ``problem``."""
        for who, u in [("", self), *((f" of {d}", u) for d, u in self.devices.items())]:
            if len(u.seconds) != len(problem.layers):
                raise ValueError(
                    f"{len(u.seconds)} unit times{who} for {len(problem.layers)} layers"
                )


SMALL_ROWS_DIVISOR = 4
"""The units are timed again at ``1 / SMALL_ROWS_DIVISOR`` of a microbatch's rows (at
least one): a group of four equal members computes exactly that."""


def small_rows(rows: int) -> int:
    """The row count the units are timed at besides a whole microbatch of ``rows``
    (``rows`` itself when it is 1: then nothing smaller is ever computed)."""
    return max(1, rows // SMALL_ROWS_DIVISOR)


def fit_unit_seconds(
    full: Sequence[UnitTime],
    small: Sequence[UnitTime] | None,
    rows: int,
    rows_small: int,
    gflops: float,
) -> UnitSeconds:
    """:class:`UnitSeconds` from unit times at ``rows`` rows a microbatch (``full``) and at
    ``rows_small`` (``small``): each unit's time is a line ``fixed + per_row * rows``
    through the two, its intercept clamped to ``[0, full]``. Without ``small`` (or one
    row count) no fixed part."""
    seconds = tuple(t.fwd_s + t.bwd_s for t in full)
    if small is None or rows_small >= rows:
        return UnitSeconds(seconds, gflops)
    if len(small) != len(full):
        raise ValueError(f"{len(small)} small-row unit times for {len(full)} units")
    fixed = []
    for whole, t in zip(seconds, small, strict=True):
        part = t.fwd_s + t.bwd_s
        intercept = (part * rows - whole * rows_small) / (rows - rows_small)
        fixed.append(min(whole, max(0.0, intercept)))
    return UnitSeconds(seconds, gflops, tuple(fixed))


@dataclass(frozen=True)
class Prediction:
    """A plan's predicted step on its devices; times in seconds."""

    step_time_s: float
    throughput_sps: float
    compute_s: list[float]
    """Per stage, per microbatch: compute plus the fixed cost per microbatch."""
    link_s: list[float]
    """Per link, per microbatch: the spec's time plus the frames' fixed costs."""
    member_s: list[list[float]]
    """Per stage, each member's compute per microbatch at its share, without the fixed
    cost (the slowest member's plus ``fixed_s`` is ``compute_s``)."""
    fixed_s: list[float]
    """Per stage, its fixed cost per microbatch (in ``compute_s``)."""
    per_step_s: float
    """What each step adds once: fixed costs per step, reports, labels."""
    allreduce_s: list[float]
    """Per stage, its group's sum of gradients once a step (0 for one device)."""
    spec_step_time_s: float
    """The spec's score of the same plan, for comparison."""
    schedule: str = "1f1b"
    """The schedule the step runs (:func:`under_schedule`)."""
    schedule_saving_s: float = 0.0
    """What the schedule takes off 1F1B's step, already out of ``step_time_s``: the bubble
    it fills (negative for a slower schedule)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "schedule": self.schedule,
            "schedule_saving_s": self.schedule_saving_s,
            "step_time_s": self.step_time_s,
            "throughput_sps": self.throughput_sps,
            "compute_s": self.compute_s,
            "link_s": self.link_s,
            "member_s": self.member_s,
            "fixed_s": self.fixed_s,
            "per_step_s": self.per_step_s,
            "allreduce_s": self.allreduce_s,
            "spec_step_time_s": self.spec_step_time_s,
        }


def calibrated(problem: PlanningProblem) -> bool:
    """Whether any device of ``problem`` announced fixed costs (a measuring agent)."""
    return any(fixed_costs_of(d) is not None for d in problem.devices)


@functools.lru_cache(maxsize=32)
def _unit_seconds(key: str) -> UnitSeconds:
    args = json.loads(key)
    spec = get_model(args["model"], **args["options"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as an agent's stage runs; its gflops are measured the same way
    try:
        # The best matmul rate before and after the units: what this machine does alone,
        # as each measured device's best rate says what it does (see device_speed).
        before = matmul_benchmark(torch.float32, 0.3).best_gflops
        m, optimizer = args["microbatches"], OptimizerSpec.model_validate(args["optimizer"])
        rows = args["batch_size"] // m
        few = small_rows(rows)
        timing = Timing(steps=3, warmup=1)
        timed = functools.partial(measure_unit_times, timing=timing, optimizer=optimizer)
        times = timed(spec, args["batch_size"], m)
        small = timed(spec, few * m, m) if few < rows else None
        gflops = max(before, matmul_benchmark(torch.float32, 0.3).best_gflops)
    finally:
        torch.set_num_threads(threads)
    return fit_unit_seconds(times, small, rows, few, gflops)


def measure_unit_seconds(
    model: str,
    batch_size: int,
    microbatches: int,
    *,
    model_options: dict[str, Any] | None = None,
    optimizer: OptimizerSpec | None = None,
) -> UnitSeconds:
    """Time ``model``'s units in a training step on this machine (once per shape: cached),
    at a whole microbatch's rows and at :func:`small_rows` of them (:func:`fit_unit_seconds`).

    Wall seconds, not the thread's CPU seconds: on one host with its agents (a local
    fleet) both feel the same load; ``bench/hybrid.py``, whose agents run under a CPU
    quota, times in CPU seconds instead."""
    key = {
        "model": model,
        "options": model_options or {},
        "batch_size": batch_size,
        "microbatches": microbatches,
        "optimizer": (optimizer or OptimizerSpec()).model_dump(mode="json"),
    }
    return _unit_seconds(json.dumps(key, sort_keys=True))


def predict(
    problem: PlanningProblem,
    plan: Plan,
    units: UnitSeconds | None = None,
    *,
    fixed_shares: Mapping[int, Sequence[float]] | None = None,
    sum_every: int = 1,
) -> Prediction:
    """The predicted step of ``plan`` (see the module docstring); ``units`` must have one
    entry per layer of ``problem`` when given; ``fixed_shares`` as for
    :func:`~coordinator.planner.score.score_plan` (the holders of local data);
    ``sum_every``: a non-exact job's groups sum once in that many steps ([Note: a DiLoCo
    group's sum])."""
    if units is not None:
        units.check(problem)
    coded = for_plan(problem, plan)  # a link's bytes as its codec sends them
    spec = score_plan(coded, plan, fixed_shares=fixed_shares)
    dev = {d.id: d for d in problem.devices}
    fixed = {d.id: fixed_costs_of(d) or _NONE for d in problem.devices}
    m, n_stages = problem.microbatches, len(plan.stages)
    compute, links, fixed_mb = [], [], []
    members = member_seconds(problem, spec)
    per_step = 0.0
    b = problem.batch_size / m
    allreduce = list(spec.allreduce_s)
    for s, st in enumerate(plan.stages):
        share = spec.shares[s]
        t = spec.compute_s[s]
        if units is not None:  # the member that takes longest on its share
            members[s] = [
                units.on_device(dev[i], st.start, st.end, w)
                for i, w in zip(st.devices, share, strict=True)
            ]
            t = max(members[s])
        if len(st.devices) > 1 and sum_every > 1:  # [Note: a DiLoCo group's sum]
            allreduce[s] = max(allreduce[s], _sum_cpu_s(problem, st, fixed)) / sum_every
        elif len(st.devices) > 1:
            # The links' reduce-scatter runs while the last backward does; what each
            # member's CPU moves, half each way, does not hide ([Note: what the overlap
            # hides]).
            hidden = min(allreduce[s] / 2, min(members[s]) * _backward_share(problem, st))
            allreduce[s] = max(allreduce[s] - hidden, _sum_cpu_s(problem, st, fixed))
        # The probe's microbatch ran PROBE_BLOCKS compute blocks; only the last stage runs
        # the loss's block too.
        blocks = PROBE_BLOCKS if s == n_stages - 1 else PROBE_BLOCKS - 1
        per_microbatch = max(fixed[i].microbatch_s for i in st.devices) * blocks / PROBE_BLOCKS
        compute.append(t + per_microbatch)
        fixed_mb.append(per_microbatch)
        per_step = max(per_step, max(fixed[i].step_s + fixed[i].frame_s for i in st.devices))
        if s + 1 < n_stages:
            nxt = plan.stages[s + 1]
            send = max(fixed[i].frame_s for i in st.devices)
            back = max(fixed[i].frame_s for i in nxt.devices)
            # Each member moves its rows both ways: its CPU per byte, at its share.
            cpu = max(
                max(w * fixed[i].byte_s for i, w in zip(st.devices, share, strict=True)),
                max(
                    w * fixed[i].byte_s
                    for i, w in zip(nxt.devices, spec.shares[s + 1], strict=True)
                ),
            )
            out = coded.layers[st.end - 1].out_bytes
            links.append(spec.link_s[s] + send + back + 2 * b * out * cpu)
    if n_stages > 1 and not plan.u_shaped:  # stage 0 sends each microbatch's labels
        per_step += m * max(fixed[i].frame_s for i in plan.stages[0].devices)
    # A U's holders compute both ends and sum both ends' gradients (as the score says).
    both = [compute[0] + compute[-1]] if plan.u_shaped else []
    tau = max(compute + links + both)
    step = (m - 1) * tau + sum(compute) + sum(links) + per_step
    if problem.version == 2:
        step += max(allreduce + ([allreduce[0] + allreduce[-1]] if plan.u_shaped else []))
    return Prediction(
        step_time_s=step,
        throughput_sps=problem.batch_size / step if step > 0 else float("inf"),
        compute_s=compute,
        link_s=links,
        member_s=members,
        fixed_s=fixed_mb,
        per_step_s=per_step,
        allreduce_s=allreduce,
        spec_step_time_s=spec.step_time_s,
    )


def under_schedule(
    problem: PlanningProblem, plan: Plan, prediction: Prediction, schedule: str
) -> Prediction:
    """``prediction`` (1F1B's) for the step under ``schedule``: less what the schedule's
    order saves on these stage and link times, simulated ([Note: another schedule])."""
    if schedule == prediction.schedule:
        return prediction
    saving = schedule_saving(
        for_plan(problem, plan), plan, prediction.compute_s, prediction.link_s, schedule
    )
    saving -= prediction.schedule_saving_s  # from 1F1B's, whichever it was for
    step = prediction.step_time_s - saving
    return replace(
        prediction,
        step_time_s=step,
        throughput_sps=problem.batch_size / step if step > 0 else float("inf"),
        schedule=schedule,
        schedule_saving_s=prediction.schedule_saving_s + saving,
    )


def balanced_shares(
    problem: PlanningProblem, plan: Plan, units: UnitSeconds
) -> dict[int, list[float]]:
    """For each group of ``plan`` with a member that timed the units itself
    (``units.devices``), the shares at which its members finish a microbatch together
    by :meth:`UnitSeconds.on_device`; the stages without one keep the spec's shares
    (by ``gflops``), so a problem no device timed is planned as the spec says.

    [Note: shares by a device's own seconds]
    The spec splits a microbatch by announced GFLOP/s; a device's own timing of the
    model says what it does with this model, fixed parts included. Member ``i`` takes
    ``a_i + c_i w_i`` at share ``w_i`` (``a_i``: the part that does not shrink with the
    rows), so all finish at ``T`` when ``w_i = (T - a_i) / c_i`` with the shares adding
    up to one; a member below one sample's share gets one sample (the runtime gives
    every member at least one) and the rest are balanced again. Measured on the
    testbed's 30x fleet, gpt-mini trained by its three fastest devices at the spec's
    shares waited 0.43 s a step in the sum for the slowest and measured 0.74 of its
    prediction; at these shares (13, 2 and 1 of 16 rows) it measured 1.05.
    """
    rows = problem.batch_size / problem.microbatches
    dev = {d.id: d for d in problem.devices}
    out: dict[int, list[float]] = {}
    for s, st in enumerate(plan.stages):
        g = len(st.devices)
        if g < 2 or not any(i in units.devices for i in st.devices) or g > rows:
            continue
        a = [units.on_device(dev[i], st.start, st.end, 0.0) for i in st.devices]
        whole = [units.on_device(dev[i], st.start, st.end, 1.0) for i in st.devices]
        c = [y - x for x, y in zip(a, whole, strict=True)]
        if min(c) <= 0:
            continue
        out[s] = _finish_together(a, c, 1 / rows)
    return out


def _finish_together(a: Sequence[float], c: Sequence[float], floor: float) -> list[float]:
    """Shares ``w`` adding up to one at which every member's ``a_i + c_i w_i`` is the same,
    none below ``floor`` (one sample's share): a member that would be is held there and
    the rest balanced again."""
    g = len(a)
    clamped: set[int] = set()
    while True:
        free = [k for k in range(g) if k not in clamped]
        t = (1 - floor * len(clamped) + sum(a[k] / c[k] for k in free)) / sum(
            1 / c[k] for k in free
        )
        w = [floor if k in clamped else (t - a[k]) / c[k] for k in range(g)]
        low = {k for k in free if w[k] < floor}
        if not low:
            return w
        if low == set(free):  # all at one sample, up to rounding: as many rows as members
            return [1 / g] * g
        clamped |= low


def _backward_share(problem: PlanningProblem, stage: Stage) -> float:
    """The part of ``stage``'s compute that is backward: its units' backward FLOPs over
    their training FLOPs (a half where they have none)."""
    units = problem.layers[stage.start : stage.end]
    total = sum(u.train_flops for u in units)
    return (total - sum(u.fwd_flops for u in units)) / total if total > 0 else 0.5


def _sum_cpu_s(problem: PlanningProblem, stage: Stage, fixed: Mapping[str, FixedCosts]) -> float:
    """Seconds a step's sum of ``stage``'s group takes its members' CPU (the slowest
    member's costs): its bytes, the vector's size sent and ``2 (g - 1) / g`` of it
    received, each at half of ``byte_s`` (which prices one sent and received):
    :func:`~edge.runtime.group_sum.sum_load`, a ring's share or, for a small sum,
    ``g - 1`` whole vectors in.

    [Note: a small sum over many members is its frames]
    A frame costs its ends a fixed part of CPU whatever it holds, and a member of a
    group of ``g`` handles ``3 g - 2`` ring chunks a step (``g`` whole vectors for a
    small sum: [Note: a small sum goes whole] in :mod:`edge.runtime.group_sum`). Eight
    emulated Pi 4 holders summing cnn-digits' first convolution (2.3 kB) under the
    scalar method measured 140 ms a step of sum by the ring against 1 ms priced by its
    bytes alone and 22 ms with its 22 frames at the holders' announced ``frame_s``;
    summed whole, 35 ms against 7 ms. The frames are not priced yet: at the sender's
    ``frame_s`` they made the planner drop groups the suite's jobs rely on (a group of
    two local agents planned as a chain) for a few ms, and a frame's cost to its
    receiver and the members' wait for the last to start
    (:func:`edge.wire.groups.sum_waits`), most of the gap on holders whose share of a
    core their messaging fills, are not measured per device yet.

    [Note: a group's sum is the larger of its links and its bytes]
    A chunk travels in pieces ([Note: pieces of a chunk] in
    :mod:`edge.runtime.group_sum`), so a member's link carries one piece while its
    CPU encodes, decodes or adds another: the sum takes the longer of the two, not
    both. Measured on ``bench/hybrid.py``'s four agents at 0.117 of a core on
    940 Mbit/s links, data parallel (``R_s`` 0.47 s for vgg11, 0.57 s for
    resnet18): the sum's transfer (less the wait for the last member's start,
    ``allreduce_started``) took 2.08 s and 2.78 s a step, what its process's CPU
    takes at that share (2.13 s, 2.81 s), not that plus ``R_s``. The rest of a
    measured sum, each member's wait for the last member to start its own
    (:func:`edge.wire.groups.sum_waits`: 0.09-0.40 s a step, 4-15% of the sum, in
    six runs on a host busy with other work), is not priced: it is the spread of
    the members' compute, which nothing a device announces predicts.
    """
    params = sum(unit.param_bytes for unit in problem.layers[stage.start : stage.end])
    _frames, sent, received = sum_load(math.ceil(params / 4), len(stage.devices))
    worst = max(fixed[i].byte_s for i in stage.devices)
    return (sent + received) / 2 * params * worst


def timed_problem(problem: PlanningProblem, units: UnitSeconds) -> PlanningProblem:
    """``problem`` with each layer's FLOPs those its measured seconds are worth at
    ``units.gflops`` (a third forward, two thirds backward) and each device's speed the
    one :func:`predict` scales them by: the spec's search on it balances stages by
    measured time. Memory and links are unchanged."""
    units.check(problem)
    b = problem.batch_size / problem.microbatches
    layers = []
    for layer, seconds in zip(problem.layers, units.seconds, strict=True):
        flops = seconds * units.gflops * 1e9 / b  # per sample, forward and backward
        layers.append(layer.model_copy(update={"fwd_flops": flops / 3, "bwd_flops": flops * 2 / 3}))
    devices = [d.model_copy(update={"gflops": units.speed(d)}) for d in problem.devices]
    return problem.model_copy(update={"layers": layers, "devices": devices})


def _throttled(device: DeviceSpec) -> bool:
    """Whether ``device`` emulates a slower one with the software throttle
    (``details["slowdown"]`` above 1; see [Note: the fixed part under a throttle]).

    [Note: the fixed part under a throttle]
    A member of a group pays the part of each unit's time that does not shrink with
    the rows whole (:meth:`UnitSeconds.at_share`), except on a device whose agent runs
    the software throttle: there it pays its share of the whole time. Measured, not
    derived: on four agents under a CPU quota (``bench/hybrid.py``, vgg11, a group of
    four) a member's compute was 4.78 s a step against 3.73 s with the fixed part
    whole and 2.85 s by share alone; on the demo's three throttled Pi 4s (a group of
    three running one convolution), the job measured 0.94-1.00 of its prediction by
    share alone in three runs, and 1.09-1.43 (six runs) with the fixed part whole,
    where its stage 0 was predicted at 41-44 ms a microbatch against 29 measured.
    The throttle sleeps after every block, so each block starts cold, and the
    agent's fixed cost per microbatch (:mod:`edge.profiling.fixed_costs`, measured
    throttled) holds that cold start; the warm per-call overheads the unit times'
    fixed part is made of seem to be paid inside it, not on top.
    """
    slowdown = (device.details or {}).get("slowdown", 1.0)
    return isinstance(slowdown, (int, float)) and slowdown > 1


def device_speed(device: DeviceSpec) -> float:
    """The GFLOP/s unit seconds scale by: a measured device's best matmul rate (over its
    software slowdown, when it emulates a slower one), else its ``gflops``.

    Best, not median: the same statistic as the unit seconds' own reference rate, and
    one a busy moment during a profile does not drag down.
    """
    details = device.details or {}
    best = (details.get("matmul") or {}).get("best_gflops")
    if not isinstance(best, (int, float)) or best <= 0:
        return device.gflops
    slowdown = details.get("slowdown", 1.0)
    return float(best) / (float(slowdown) if isinstance(slowdown, (int, float)) else 1.0)
