"""Per-unit seconds of a real training step: the measured unit times a planner can trust.

:func:`edge.models.unit_costs.profile_model` times each unit alone, on one input,
over and over: warm caches and no loss, no optimizer, no data. A pipeline stage
does more per microbatch. :func:`measure_unit_times` runs the model the way the
stage runtime does (:mod:`edge.runtime.stage`), with every unit as its own
stage: seeded batches from the model's dataset, split into microbatches; for
each, every unit's forward on a detached input (as a stage receives it), the
loss on the last; then every unit's backward, last to first; then the
optimizer step of each unit's parameters. Each piece is timed on its own, and
over ``steps`` measured steps (after ``warmup``) the median is kept: how it measures
is a :class:`Timing`. The clock is the wall clock unless the caller passes another:
on one torch thread,
``time.thread_time`` (the CPU seconds of the timing thread, which runs every op
then) does not count the time other processes of a busy host take from it.

``budget_s`` ends the measuring early: once the measured steps have taken that many
seconds on the clock, no further step runs (at least one always does), so a fast
device takes the median of several steps while a slow one, whose one step is long
enough to average out a hiccup, is not kept for minutes. [Note: several timed
steps] One step is not enough on a fast device: a testbed device of 0.84 cores timed
gpt-mini's units (16 rows) at 0.134-0.204 s a microbatch over four single-step
requests in a row, the first in a fresh agent the highest, and 0.155-0.165 s with
the median of three (its training run: 0.153 s); a step that takes a second or more
varied by a few percent.

``cpu_clock`` (an agent's timing passes one) splits each step's wall seconds over
the units by the CPU seconds each took on it, rather than by the wall seconds each
region saw. [Note: a stall lands on one unit] Under a CPU quota (the testbed's
cgroups; any throttled container) the device runs its quota, then stalls until the
next period: 139 ms of every 143 ms on the testbed's slowest 30x device. A stall
lands on whichever unit is running when the quota runs out, so a unit's wall seconds
carry whole stalls at random while the step's sum stays right. On that device, in two
runs of ``bench/hybrid.py``, a stage of vgg11's last two units was priced at 10.1 s
and 4.9 s a step from the device's timings and took 6.5 s and 7.0 s. The CPU seconds
of a unit do not carry the stall. With one torch thread the timing thread's CPU
seconds hold all of the work; with more, the process's do.

A unit's figures are per microbatch: ``fwd_s``, and ``bwd_s`` which includes
its share of the optimizer step (the step's time / ``microbatches``, as the
runtime steps once per batch) and, for the last unit, the loss. Their sum over
units times ``microbatches`` is one single-device step's compute. Inter-stage
transfers are not included: a plan's links price those.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from edge.models.datasets import build_dataset
from edge.models.zoo import ModelSpec
from edge.runtime.data import EpochSampler, load_batch
from edge.runtime.stage import build_optimizer, loss_fn
from edge.wire.messages import OptimizerSpec

__all__ = ["Timing", "UnitTime", "cpu_seconds_clock", "measure_unit_times"]


@dataclass(frozen=True)
class UnitTime:
    """Median seconds per microbatch of one unit in a training step."""

    name: str
    fwd_s: float
    bwd_s: float
    """Backward, plus the loss (last unit) and its share of the optimizer step."""


@dataclass(frozen=True)
class Timing:
    """How :func:`measure_unit_times` measures: its steps, its clocks and its budget."""

    steps: int = 5
    """Measured steps (fewer once ``budget_s`` is spent)."""
    warmup: int = 2
    """Steps run before the measured ones, not measured."""
    clock: Callable[[], float] = time.perf_counter
    """The clock every region is timed on (the wall clock unless told otherwise)."""
    cpu_clock: Callable[[], float] | None = None
    """Split each step's seconds on ``clock`` over its regions by their seconds on this
    clock ([Note: a stall lands on one unit]); an agent's timing passes
    :func:`cpu_seconds_clock`."""
    timed_microbatches: int | None = None
    """Run only that many of each step's microbatches (their rows as many as a whole
    step's); the optimizer step is still shared by all of them. What a slow device can
    afford: a step of vgg11 at 64 rows a microbatch is minutes on a Pi, one microbatch
    is a quarter of that. ``None``: every microbatch."""
    budget_s: float | None = None
    """Measure no further step once the measured ones took this long on ``clock`` (at
    least one runs); ``None``: every step."""
    cpu_alone: bool = False
    """With ``cpu_clock``: each region's CPU seconds as they are, not scaled to the
    step's wall seconds. For a device whose compute the throttle stretches to its CPU
    seconds (the testbed's scalar method, [Note: two speeds of a device] in
    :mod:`coordinator.testbed.sizing`): a stall its quota made is not its compute's,
    and the throttle's factor is applied once, by the caller."""


def measure_unit_times(
    spec: ModelSpec,
    batch_size: int,
    microbatches: int,
    *,
    timing: Timing = Timing(),
    optimizer: OptimizerSpec | None = None,
    seed: int = 0,
) -> list[UnitTime]:
    """Time every unit of ``spec`` in a training step at ``batch_size`` rows in
    ``microbatches``, as ``timing`` says (see the module docstring)."""
    steps, warmup, budget_s = timing.steps, timing.warmup, timing.budget_s
    if batch_size < microbatches or microbatches < 1 or steps < 1:
        raise ValueError("need steps >= 1 and batch_size >= microbatches >= 1")
    timed = microbatches if timing.timed_microbatches is None else timing.timed_microbatches
    if not 1 <= timed <= microbatches:
        raise ValueError("need 1 <= timed_microbatches <= microbatches")
    if budget_s is not None and budget_s <= 0:
        raise ValueError("need budget_s > 0")
    units = [spec.build_segment(i, i + 1).train() for i in range(spec.num_units)]
    opt_spec = optimizer or OptimizerSpec()
    optimizers = [build_optimizer(opt_spec, u.parameters()) for u in units]
    dataset = build_dataset(spec.dataset, "train", **spec.dataset_options)
    sampler = EpochSampler(len(dataset), batch_size, seed)  # type: ignore[arg-type]
    n = len(units)
    fwd: list[list[float]] = [[] for _ in range(n)]
    bwd: list[list[float]] = [[] for _ in range(n)]
    measured = 0.0
    for step in range(warmup + steps):
        if budget_s is not None and step > warmup and measured >= budget_s:
            break
        x, y = load_batch(dataset, sampler, step)
        times = _StepTimes(n, timing.clock, timing.cpu_clock)
        pairs = list(zip(x.chunk(microbatches), y.chunk(microbatches), strict=True))
        for xs, ys in pairs[:timed]:
            inputs, outputs = [], []
            inp = xs
            for i, unit in enumerate(units):
                if i > 0 and inp.is_floating_point():
                    inp = inp.detach().requires_grad_()
                inputs.append(inp)
                with times.region("fwd", i):
                    out = unit(inp)
                    if i == n - 1:
                        out = loss_fn(out, ys) / microbatches
                outputs.append(out)
                inp = out
            grad: torch.Tensor | None = None
            for i in reversed(range(n)):
                with times.region("bwd", i):
                    if outputs[i].requires_grad:
                        outputs[i].backward(grad)
                grad = inputs[i].grad if inputs[i].is_floating_point() else None
        for i, opt in enumerate(optimizers):
            with times.region("opt", i):
                if opt is not None:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        f_step, b_step, opt_s = times.seconds(scale_to_wall=not timing.cpu_alone)
        if step >= warmup:
            measured += sum(f_step) + sum(b_step)
            for i in range(n):  # the optimizer's time is shared by all microbatches
                fwd[i].append(f_step[i] / timed)
                bwd[i].append((b_step[i] - opt_s[i]) / timed + opt_s[i] / microbatches)
    return [
        UnitTime(spec.units[i].name, statistics.median(fwd[i]), statistics.median(bwd[i]))
        for i in range(n)
    ]


_Kind = Literal["fwd", "bwd", "opt"]


class _StepTimes:
    """One step's seconds of each unit's forward, backward and optimizer step, on the
    wall ``clock`` and, given one, on ``cpu_clock`` too."""

    def __init__(
        self, n: int, clock: Callable[[], float], cpu_clock: Callable[[], float] | None
    ) -> None:
        self.clock, self.cpu_clock = clock, cpu_clock
        self.wall: dict[_Kind, list[float]] = {k: [0.0] * n for k in ("fwd", "bwd", "opt")}
        self.cpu: dict[_Kind, list[float]] = {k: [0.0] * n for k in ("fwd", "bwd", "opt")}

    @contextlib.contextmanager
    def region(self, kind: _Kind, i: int) -> Iterator[None]:
        cpu = self.cpu_clock
        t0, c0 = self.clock(), cpu() if cpu is not None else 0.0
        yield
        if cpu is not None:
            self.cpu[kind][i] += cpu() - c0
        self.wall[kind][i] += self.clock() - t0

    def seconds(
        self, *, scale_to_wall: bool = True
    ) -> tuple[list[float], list[float], list[float]]:
        """Forward, backward with the optimizer, and optimizer seconds of each unit: the
        wall seconds, or with a CPU clock the CPU seconds scaled to the wall's sum
        (unless ``scale_to_wall`` is off: as they are)."""
        wall_total = sum(sum(v) for v in self.wall.values())
        cpu_total = sum(sum(v) for v in self.cpu.values())
        by = self.cpu if self.cpu_clock is not None and cpu_total > 0 else self.wall
        k = wall_total / cpu_total if by is self.cpu and scale_to_wall else 1.0
        return (
            [t * k for t in by["fwd"]],
            [(b + o) * k for b, o in zip(by["bwd"], by["opt"], strict=True)],
            [t * k for t in by["opt"]],
        )


def cpu_seconds_clock() -> Callable[[], float]:
    """The CPU clock that holds all of a timing's work: this thread's with one torch
    thread, else the process's (the intra-op threads compute too)."""
    return time.thread_time if torch.get_num_threads() == 1 else time.process_time
