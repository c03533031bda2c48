"""Each device's own unit seconds: the model's units timed by the agents, under their limits.

[Note: a device's own unit seconds]
The internal cost model (:mod:`coordinator.planner.predict`) times the model's
units once on this machine and scales them to each device by its matmul rate.
That misses whatever a device does differently unit by unit. Measured on the
testbed, one thread of vgg11 (64 rows) under a CPU quota of 0.077 of a core:
its convolutions cost 2.0-2.9x their unthrottled CPU seconds and its last two
3.7x and 6.0x, a whole step 1.1-1.5x; this is what kept 20 of
``bench/hybrid.py``'s 75 rows below 0.8 of their prediction. On real devices the
same holds for memory-bound layers, which a GFLOP/s figure does not see.
PipeDream profiles each layer on the device that runs it; here each agent times
the units when asked (:class:`~edge.wire.messages.TimeUnits`, answered with
:class:`~edge.wire.messages.UnitTimes` on the device's own ``units`` topic), the
way its stages run them: its threads, its quota, its throttle, at a whole
microbatch's rows and at :func:`~coordinator.planner.predict.small_rows` of them
(:func:`~coordinator.planner.predict.fit_unit_seconds`), one microbatch a step,
as a step of vgg11 at 64 rows a microbatch takes a Pi minutes.

Every answer is checked before it is used: it came on the topic of a device that
was asked, it names this request and that device, it lists the model's units by
name and in order at both row counts, and its values are bounded
(:func:`~edge.wire.messages.parse_unit_times`). A device whose answer fails, says
why it could not time, or does not come in time keeps the scaled seconds, as does
a device too small to hold the whole model, which is not asked (timing builds
every unit; a split model's stages would each need timing on their own inputs,
which is not done); the result says which and why.

Tested in tests/integration/test_agent_unit_times.py (real agents answer; a busy,
refused, unchecked or too small device keeps the scaled seconds).
"""

from __future__ import annotations

import functools
import logging
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from coordinator.engine.assignments import planning_start
from coordinator.engine.spec import JobSpec, microbatches_of
from coordinator.planner.predict import UnitSeconds, device_speed, fit_unit_seconds, small_rows
from coordinator.planner.score import Plan, score_plan
from edge.models.zoo import get_model
from edge.problem import DeviceSpec, PlanningProblem
from edge.runtime.unit_times import UnitTime
from edge.transport.mqtt import MqttTransport
from edge.wire.messages import (
    MAX_TIMED_STEPS,
    MessageError,
    TimeUnits,
    UnitTimes,
    UnitTiming,
    parse_unit_times,
)
from edge.wire.topics import device_cmd, device_units

__all__ = ["DeviceUnitSeconds", "time_units_on_devices", "timing_request", "whole_model_bytes"]

log = logging.getLogger(__name__)


@dataclass
class DeviceUnitSeconds:
    """What :func:`time_units_on_devices` got: each device's own unit seconds, and why
    each device that has none has none."""

    seconds: dict[str, UnitSeconds] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)
    took_s: float = 0.0


TIMING_BUDGET_S = 3.0
"""Seconds of measured steps after which a device times no further step, at each row
count: a fast device takes the median of up to
:data:`~edge.wire.messages.MAX_TIMED_STEPS`, a Pi's one step of
a big model is a minute ([Note: several timed steps] in :mod:`edge.runtime.unit_times`)."""


def timing_request(
    spec: JobSpec, *, steps: int = MAX_TIMED_STEPS, budget_s: float | None = TIMING_BUDGET_S
) -> TimeUnits:
    """The command that times ``spec``'s model at its batch shape: a whole microbatch's
    rows and :func:`small_rows` of them, one microbatch a step after one warm-up, up to
    ``steps`` steps or ``budget_s`` seconds of them, whichever ends first."""
    m = microbatches_of(planning_start(spec))  # "auto": the shape planning starts from
    rows = spec.batch_size // m
    few = small_rows(rows)
    return TimeUnits(
        request="u" + secrets.token_hex(6),
        model=spec.model,
        model_options=spec.model_options,
        optimizer=spec.optimizer,
        batch_size=spec.batch_size,
        microbatches=m,
        small_batch_size=few * m if few < rows else None,
        timed_microbatches=1,
        steps=steps,
        warmup=1,
        budget_s=budget_s,
    )


def time_units_on_devices(
    control: MqttTransport,
    devices: Sequence[DeviceSpec],
    request: TimeUnits,
    *,
    timeout_s: float = 900.0,
    one_at_a_time: bool = False,
    needs_bytes: float = 0.0,
) -> DeviceUnitSeconds:
    """Ask each of ``devices`` to time ``request``'s units and wait, at most ``timeout_s``
    in all, for their checked answers (see the module docstring). ``one_at_a_time``: ask
    the next device only once the last answered (devices that share one host, such as a
    testbed's, would otherwise time each other's load). ``needs_bytes``: the memory the
    whole model trains in on one device (:func:`whole_model_bytes`); a device with less
    is not asked, as timing builds every unit (the fleet exists because such devices
    cannot hold the model)."""
    names = [u.name for u in get_model(request.model, **request.model_options).units]
    out = DeviceUnitSeconds()
    for d in (d for d in devices if d.memory_bytes < needs_bytes):
        out.missing[d.id] = (
            f"holds {d.memory_bytes / 1e9:.3f} GB; the whole model needs "
            f"{needs_bytes / 1e9:.3f} GB to be timed"
        )
    devices = [d for d in devices if d.memory_bytes >= needs_bytes]
    rows = request.batch_size // request.microbatches
    rows_small = (request.small_batch_size or request.batch_size) // request.microbatches
    answers: dict[str, UnitTimes | str] = {}
    done = threading.Condition()

    def on_answer(topic: str, payload: bytes) -> None:  # on paho's thread: quick
        device = next((d.id for d in devices if device_units(d.id) == topic), None)
        if device is None:
            return
        try:
            got = parse_unit_times(payload)
        except MessageError as exc:
            answer: UnitTimes | str = str(exc)
        else:
            if got.request != request.request:  # an earlier request's late answer
                log.info("ignored unit times of request %s on %s", got.request, topic)
                return
            why = _check(got, device, names, small=request.small_batch_size is not None)
            answer = got if why is None else why
        with done:
            answers.setdefault(device, answer)
            done.notify_all()

    started = time.perf_counter()
    deadline = started + timeout_s
    topics = [device_units(d.id) for d in devices]
    for topic in topics:
        control.subscribe(topic, on_answer)
    try:
        payload = request.model_dump_json()
        batches = [[d.id] for d in devices] if one_at_a_time else [[d.id for d in devices]]
        for batch in batches:
            for device in batch:
                control.publish(device_cmd(device), payload, 1)
            with done:
                done.wait_for(
                    functools.partial(_answered, answers, batch), deadline - time.perf_counter()
                )
    finally:
        for topic in topics:
            control.unsubscribe(topic)
    out.took_s = time.perf_counter() - started
    with done:
        got_all = dict(answers)
    for d in devices:
        answer = got_all.get(d.id, f"no answer in {timeout_s:.0f} s")
        if isinstance(answer, str):
            out.missing[d.id] = answer
            log.warning("%s keeps the scaled unit seconds: %s", d.id, answer)
            continue
        small = _times(answer.small) if answer.small is not None else None
        out.seconds[d.id] = fit_unit_seconds(
            _times(answer.full), small, rows, rows_small, device_speed(d)
        )
    return out


def _check(got: UnitTimes, device: str, names: list[str], *, small: bool) -> str | None:
    """Why ``got`` is not ``device``'s usable answer (listing ``names`` at both row counts,
    or at one without ``small``), or ``None``."""
    if got.device != device:
        return f"names device {got.device} on the topic of {device}"
    if got.error is not None:
        return got.error
    for label, times in (("full", got.full), ("small", got.small)):
        if label == "small" and not small:
            if times is not None:
                return "small-row times that were not asked for"
            continue
        if times is None or [t.name for t in times] != names:
            return f"its {label}-row times do not list the model's {len(names)} units in order"
    return None


def whole_model_bytes(problem: PlanningProblem) -> float:
    """The memory ``problem``'s model trains in on one device, by the spec's 1F1B memory
    model: what a device needs to time every unit."""
    plan = Plan.of((problem.devices[0].id, 0, len(problem.layers)))
    return score_plan(problem, plan).memory_bytes[0]


def _answered(answers: dict[str, UnitTimes | str], devices: list[str]) -> bool:
    return all(d in answers for d in devices)


def _times(timings: Sequence[UnitTiming]) -> list[UnitTime]:
    return [UnitTime(t.name, t.fwd_s, t.bwd_s) for t in timings]
