"""What an emulated device announces (:meth:`EmulatedDevice.announced`): under a quota
(the kernel and scalar methods) its fixed costs take ``1 / quota`` as long and it says
its share (``details["cpu_quota"]``, which its agent prices its transport probe by:
[Note: the transport probe's share of a core]); under the software throttle neither.
And the two speeds of a device ([Note: two speeds of a device]): the FLOP share its
compute runs at, the scalar share everything else runs at under the scalar method."""

from __future__ import annotations

import pytest

from coordinator.planner.build import parse_fleet
from coordinator.testbed.sizing import emulate
from edge.profiling.fixed_costs import FixedCosts, cpu_quota_of, fixed_costs_of

CORE = {"microbatch_s": 0.001, "step_s": 0.002, "frame_s": 0.0001, "byte_s": 4e-9}


def test_a_quota_is_announced_with_the_fixed_costs_it_stretches() -> None:
    (dev,) = emulate(parse_fleet("rpi4-4gb:1"), scale=0.25, cpus=2)
    under = dev.announced(100.0, CORE, quota=dev.quota_cpus("kernel"))
    assert cpu_quota_of(under) == 0.25 and under.gflops == pytest.approx(25.0)
    assert fixed_costs_of(under) == FixedCosts(**{k: v * 4 for k, v in CORE.items()})
    throttled = dev.announced(100.0, CORE, quota=dev.quota_cpus("software"))
    assert cpu_quota_of(throttled) is None
    assert fixed_costs_of(throttled) == FixedCosts(**CORE)


def test_the_scalar_method_runs_a_pis_code_at_its_scalar_share_and_compute_at_its_flops() -> None:
    fleet = parse_fleet("rpi4-4gb,laptop")
    pi, laptop = emulate(fleet, scale=0.5, cpus=2)
    flops = 0.5 * fleet[0].gflops / fleet[1].gflops
    scores = [d.details["scalar_score"] for d in fleet if d.details]
    scalar = 0.5 * scores[0] / scores[1]
    assert pi.cpus == pytest.approx(flops) and pi.scalar_cpus == pytest.approx(scalar)
    assert flops * 3 < scalar < 0.5  # a Pi's Python is not slowed by its FLOP ratio
    assert laptop.cpus == laptop.scalar_cpus == 0.5  # the fastest device: one share
    assert pi.quota_cpus("kernel") == pi.cpus
    assert pi.quota_cpus("scalar") == pi.scalar_cpus
    assert pi.quota_cpus("software") is None
    assert pi.slowdown == pytest.approx(1 / flops)  # compute is throttled on to its FLOPs
    under = pi.announced(100.0, CORE, quota=pi.quota_cpus("scalar"))
    assert cpu_quota_of(under) == pytest.approx(scalar)
    assert under.gflops == pytest.approx(100.0 * flops)
    got = fixed_costs_of(under)
    assert got is not None
    assert vars(got) == pytest.approx({k: v / scalar for k, v in CORE.items()})


def test_a_device_without_a_scalar_score_keeps_its_flop_share() -> None:
    fleet = [d.model_copy(update={"details": None}) for d in parse_fleet("rpi4-4gb,laptop")]
    pi, _ = emulate(fleet, scale=0.5, cpus=2)
    assert pi.scalar_cpus == pi.cpus == pi.quota_cpus("scalar")
