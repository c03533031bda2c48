"""Per-unit training-step times (edge/runtime/unit_times.py) and the software throttle."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from coordinator.engine.assignments import make_assignments
from coordinator.engine.spec import JobSpec
from coordinator.engine.unit_profiles import timing_request
from coordinator.planner.score import Plan, Stage
from edge.models.zoo import get_model
from edge.runtime.stage import StageRuntime
from edge.runtime.unit_times import Timing, measure_unit_times
from edge.transport.inprocess import InProcessTransport
from edge.wire.messages import MAX_TIMING_BUDGET_S, MessageError, parse_command


@pytest.mark.parametrize("model", ["cnn-digits", "gpt-mini"])
def test_every_unit_is_timed_in_order(model: str) -> None:
    spec = get_model(model)
    times = measure_unit_times(spec, 8, 2, timing=Timing(steps=2, warmup=1))
    assert [t.name for t in times] == [u.name for u in spec.units]
    assert all(t.fwd_s > 0 and t.bwd_s >= 0 for t in times)
    # The last unit's backward holds the loss's backward and its optimizer share.
    assert times[-1].bwd_s > 0


def test_training_state_is_not_touched_by_measuring() -> None:
    spec = get_model("mlp", seed=3)
    before = {k: v.clone() for k, v in spec.build_segment(0, spec.num_units).state_dict().items()}
    measure_unit_times(spec, 8, 2, timing=Timing(steps=1, warmup=0))
    after = spec.build_segment(0, spec.num_units).state_dict()
    assert all((after[k] == v).all() for k, v in before.items())


def test_timing_some_microbatches_still_shares_the_optimizer_over_all() -> None:
    """Each timed region on a clock that ticks once a call takes exactly 1 s: a unit's
    forward 1 s a microbatch, its backward 1 s plus a quarter of the optimizer's 1 s,
    whether one or all four microbatches of the step run."""
    calls = iter(range(1_000_000))
    spec = get_model("mlp")
    for timed in (1, 4):
        timing = Timing(
            steps=1, warmup=0, clock=lambda: float(next(calls)), timed_microbatches=timed
        )
        times = measure_unit_times(spec, 8, 4, timing=timing)
        assert [(t.fwd_s, t.bwd_s) for t in times] == [(1.0, 1.25)] * spec.num_units


def test_a_stall_is_spread_over_the_units_by_their_cpu_seconds() -> None:
    """A quota's stall lands on whichever unit runs when the quota is spent ([Note: a
    stall lands on one unit]). Here every region takes 1 s of CPU and 1 s of wall time,
    but the second unit's first forward also waits 10 s. On the wall clock alone that
    unit carries the 10 s; with the CPU clock each unit takes its CPU share of the
    step's wall seconds, and the step's sum is still every second the wall saw."""
    spec = get_model("mlp")
    n = spec.num_units
    regions = 5 * n  # 2 microbatches x (forward + backward) + the optimizer, per unit
    stall = 10.0

    def clocks() -> tuple[Callable[[], float], Callable[[], float]]:
        wall_calls, cpu_calls = iter(range(1_000_000)), iter(range(1_000_000))

        def wall() -> float:
            k = next(wall_calls)  # region r starts at call 2r and ends at call 2r + 1
            return float(k) + (stall if k >= 3 else 0.0)  # region 1 ends late

        return wall, lambda: float(next(cpu_calls))

    def times(with_cpu: bool) -> list[tuple[float, float]]:
        wall, cpu = clocks()
        timing = Timing(steps=1, warmup=0, clock=wall, cpu_clock=cpu if with_cpu else None)
        got = measure_unit_times(spec, 8, 2, timing=timing)
        return [(t.fwd_s, t.bwd_s) for t in got]

    plain = times(False)
    assert plain[1] == (1.0 + stall / 2, 1.5) and plain[0] == plain[2] == (1.0, 1.5)
    k = (regions + stall) / regions
    spread = times(True)
    assert spread == [pytest.approx((k, 1.5 * k))] * n
    assert sum(2 * (f + b) for f, b in spread) == pytest.approx(regions + stall)


def test_a_budget_ends_the_measured_steps_after_at_least_one() -> None:
    """On a clock that ticks once a call, a step is as many clock calls as it has timed
    regions: the budget stops the steps once the measured ones exceed it, never before
    the first measured step, and without it every step runs."""
    spec = get_model("mlp")
    ticks = 0

    def clock() -> float:
        nonlocal ticks
        ticks += 1
        return float(ticks)

    def calls(steps: int, warmup: int, budget_s: float | None) -> int:
        nonlocal ticks
        ticks = 0
        timing = Timing(steps=steps, warmup=warmup, clock=clock, budget_s=budget_s)
        measure_unit_times(spec, 8, 2, timing=timing)
        return ticks

    one = calls(1, 0, None)
    step_s = one / 2  # each timed region: two calls, one second
    assert calls(5, 0, None) == 5 * one
    assert calls(5, 0, 0.5) == one  # the first measured step always runs
    assert calls(5, 1, 0.5) == 2 * one  # the warm-up does not count
    assert calls(5, 0, 2 * step_s) == 2 * one
    assert calls(5, 0, 2 * step_s + 1) == 3 * one
    with pytest.raises(ValueError, match="budget_s"):
        measure_unit_times(spec, 8, 2, timing=Timing(budget_s=0))


@pytest.mark.parametrize("budget", [0, -1, MAX_TIMING_BUDGET_S * 2])
def test_a_timing_command_with_a_budget_out_of_bounds_is_refused(budget: float) -> None:
    request = timing_request(JobSpec(model="mlp", steps=1, batch_size=8, microbatches=2))
    assert parse_command(request.model_dump_json()) == request
    with pytest.raises(MessageError, match="budget_s"):
        parse_command(request.model_copy(update={"budget_s": budget}).model_dump_json())


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="microbatches"):
        measure_unit_times(get_model("mlp"), 2, 4)
    with pytest.raises(ValueError, match="timed_microbatches"):
        measure_unit_times(get_model("mlp"), 8, 4, timing=Timing(timed_microbatches=5))


def _runtime(slowdown: float) -> StageRuntime:
    spec = JobSpec(model="mlp", steps=1, batch_size=8, microbatches=1)
    (assignment,) = make_assignments("jthrottle", spec, Plan.of(("d", 0, 3)))
    return StageRuntime(assignment, InProcessTransport(), slowdown=slowdown)


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The throttle counts this thread's CPU time only when torch runs one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_throttle_stretches_cpu_time_by_the_slowdown(one_thread: None) -> None:
    rt = _runtime(3.0)
    t0 = rt._start()
    _burn(0.02)
    took = rt._throttle(t0)
    assert took >= 3.0 * 0.02 * 0.99  # sleeps until slowdown x the CPU time spent


def test_throttle_does_not_multiply_time_spent_off_the_cpu(one_thread: None) -> None:
    rt = _runtime(3.0)
    t0 = rt._start()
    time.sleep(0.05)  # off the CPU: as if another process held it
    took = rt._throttle(t0)
    assert took < 0.05 + 0.04  # not 3 x 0.05


def test_with_several_threads_wall_time_is_stretched() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rt = _runtime(3.0)
        t0 = rt._start()
        time.sleep(0.02)
        took = rt._throttle(t0)
        assert took >= 3.0 * 0.02 * 0.99
        assert rt._own_s == took  # the device's own seconds are the stretched wall time
    finally:
        torch.set_num_threads(threads)


def test_no_throttle_at_slowdown_one() -> None:
    rt = _runtime(1.0)
    t0 = rt._start()
    _burn(0.01)
    assert rt._throttle(t0) < 0.01 + 0.04


# [Note: a device's own compute seconds] in edge/runtime/stage.py: what a step report's
# own_compute_s sums, block by block.


def test_time_another_process_takes_is_not_the_devices_own(one_thread: None) -> None:
    rt = _runtime(1.0)
    if not rt._cpu_is_own:
        pytest.skip("this machine holds the tests under a CPU quota: its stalls are the device's")
    t0 = rt._start()
    _burn(0.01)
    time.sleep(0.05)  # off the CPU: as if another process held it
    took = rt._throttle(t0)
    assert took >= 0.06
    assert 0.01 <= rt._own_s < 0.01 + 0.01  # the CPU seconds only


def test_a_throttled_devices_own_seconds_are_its_cpu_seconds_times_the_slowdown(
    one_thread: None,
) -> None:
    rt = _runtime(3.0)
    if not rt._cpu_is_own:
        pytest.skip("this machine holds the tests under a CPU quota: its stalls are the device's")
    t0 = rt._start()
    _burn(0.02)
    time.sleep(0.05)  # as if the host were busy: the throttle's sleep absorbs it
    rt._throttle(t0)
    assert 3.0 * 0.02 <= rt._own_s < 3.0 * (0.02 + 0.01)  # not the 0.07 s of wall time


def test_a_sums_early_sends_are_neither_compute_nor_stretched(one_thread: None) -> None:
    """[Note: a block's own seconds]: a group member's last backward sends its sum's first
    pieces from the gradients' hooks; those sends (each made to cost 20 ms of CPU here) are
    left out of the block the throttle stretches and out of its compute, and counted in
    the sum's seconds instead."""
    spec = JobSpec(model="mlp", steps=1, batch_size=8, microbatches=1)
    plan = Plan((Stage.group(["d", "e"], 0, 3),))
    assignment = make_assignments("jsends", spec, plan)[0]
    transport = InProcessTransport()
    send = transport.send

    def dear(*args: Any, **kwargs: Any) -> None:
        _burn(0.02)
        send(*args, **kwargs)

    transport.send = dear  # type: ignore[method-assign]
    rt = StageRuntime(assignment, transport, slowdown=10.0)
    assert rt.group_sum is not None
    x = torch.randn(4, *get_model("mlp").input_shape)
    t0 = rt._start()
    loss = rt.forward(x).square().sum()
    rt.group_sum.arm(0, 1.0)  # one stage: the loss goes in the sum too
    loss.backward()
    took = rt._throttle(t0)
    pieces = len(rt.group_sum.pieces)  # to the one other member
    assert rt.group_sum.early_bytes > 0 and pieces >= 1
    assert rt.group_sum.early_cpu_s >= 0.02 * pieces * 0.99
    assert rt.group_sum.early_s >= rt.group_sum.early_cpu_s * 0.99
    assert took < 10 * 0.02 * pieces  # the sends were not stretched tenfold
    rt.group_sum.disarm()
    transport.close()


def test_a_throttled_devices_timing_keeps_its_cpu_seconds_as_they_are() -> None:
    """A unit that ran 0.01 s of CPU in 0.15 s of wall (a quota's stall landed on it): by
    default its CPU seconds are scaled to the wall's ([Note: a stall lands on one unit]);
    a throttled device's (``Timing.cpu_alone``) stay 0.01 s, which its answer then prices
    at its slowdown once ([Note: two speeds of a device])."""
    from edge.runtime.unit_times import _StepTimes

    ticks = iter([0.0, 0.15, 0.15, 0.20])  # wall: forward 0.15 s, backward 0.05 s
    cpu = iter([0.0, 0.01, 0.01, 0.06])  # CPU: forward 0.01 s, backward 0.05 s
    times = _StepTimes(1, lambda: next(ticks), lambda: next(cpu))
    with times.region("fwd", 0):
        pass
    with times.region("bwd", 0):
        pass
    scaled = times.seconds()
    assert scaled[0] == pytest.approx([0.01 * 0.2 / 0.06]) and sum(scaled[0] + scaled[1]) == (
        pytest.approx(0.2)
    )
    alone = times.seconds(scale_to_wall=False)
    assert alone[0] == pytest.approx([0.01]) and alone[1] == pytest.approx([0.05])
