"""A device's answer to a ``time-units`` request: its model's units timed here.

The coordinator asks each device for the seconds each unit of a model takes on it (the
planner's per-device unit seconds: :mod:`coordinator.engine.unit_profiles`), with a
:class:`~edge.wire.messages.TimeUnits` on the device's ``cmd`` topic.
:func:`answer_time_units` times the units in a training step under the device's own
limits (:func:`edge.runtime.unit_times.measure_unit_times`, which owns how), at the
request's batch and, if it asks, at its small batch too, on the CPU seconds of the
timing ([Note: a stall lands on one unit]), and prices them at the device's throttle:
each time times ``slowdown``, as the throttle sleeps that much longer than it computes.
A throttled device's CPU seconds are taken as they are, not scaled to the step's wall
seconds: under the scalar method's quota ([Note: two speeds of a device] in
:mod:`coordinator.testbed.sizing`) the wall carries the quota's stalls, which the
throttle's stretch covers, and scaling both would count the slowdown twice (a
0.065-core Pi holder timed cnn-digits at 16 s a microbatch, 15x its run).

An answer without times says why instead: the device is busy with a job, the model is
not allowed or cannot be built, or the timing failed. Any failure is the answer, never
the caller's end.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence

from edge.models.user_code import CodeAllowance
from edge.models.zoo import get_model
from edge.runtime.unit_times import Timing, UnitTime, cpu_seconds_clock, measure_unit_times
from edge.wire.messages import TimeUnits, UnitTimes, UnitTiming

__all__ = ["answer_time_units"]

log = logging.getLogger("edgetrain.agent")  # the daemon's records, whichever part writes them


def answer_time_units(
    cmd: TimeUnits,
    *,
    device: str,
    allow_code: CodeAllowance,
    slowdown: float,
    busy_job: str | None = None,
) -> UnitTimes:
    """``device``'s answer to ``cmd`` (see the module docstring); with ``busy_job``, the
    job it is busy with, none: it times nothing then."""
    started = time.perf_counter()
    full: list[UnitTiming] = []
    small: list[UnitTiming] | None = None
    error = None
    if busy_job is not None:
        error = f"busy with job {busy_job}"
    else:
        try:
            spec = get_model(cmd.model, allow_code=allow_code, **cmd.model_options)
            timing = Timing(
                steps=cmd.steps,
                warmup=cmd.warmup,
                cpu_clock=cpu_seconds_clock(),  # [Note: a stall lands on one unit]
                timed_microbatches=cmd.timed_microbatches,
                budget_s=cmd.budget_s,
                # Throttled, its compute lasts slowdown x its CPU seconds, whatever a
                # quota stalled: priced once, below.
                cpu_alone=slowdown > 1,
            )
            timed = functools.partial(
                measure_unit_times,
                microbatches=cmd.microbatches,
                timing=timing,
                optimizer=cmd.optimizer,
            )
            full = _timings(timed(spec, cmd.batch_size), slowdown)
            if cmd.small_batch_size is not None:
                small = _timings(timed(spec, cmd.small_batch_size), slowdown)
        except Exception as exc:  # any failure is the answer, never the daemon's end
            error = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
            full, small = [], None
    answer = UnitTimes(request=cmd.request, device=device, full=full, small=small, error=error)
    if error is None:
        log.info(
            "timed the units of %s at batch %d in %.1f s",
            cmd.model,
            cmd.batch_size,
            time.perf_counter() - started,
        )
    else:
        log.warning("could not time the units of %s: %s", cmd.model, error)
    return answer


def _timings(times: Sequence[UnitTime], slowdown: float) -> list[UnitTiming]:
    """``times`` on the wire, at ``slowdown``."""
    k = slowdown
    return [UnitTiming(name=t.name, fwd_s=t.fwd_s * k, bwd_s=t.bwd_s * k) for t in times]
