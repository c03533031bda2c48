"""What an emulated device announces (:meth:`EmulatedDevice.announced`): under the kernel
method's quota its fixed costs take ``1 / cpus`` as long and it says its share
(``details["cpu_quota"]``, which its agent prices its transport probe by: [Note: the
transport probe's share of a core]); under the software throttle neither."""

from __future__ import annotations

import pytest

from coordinator.planner.build import parse_fleet
from coordinator.testbed.sizing import emulate
from edge.profiling.fixed_costs import FixedCosts, cpu_quota_of, fixed_costs_of

CORE = {"microbatch_s": 0.001, "step_s": 0.002, "frame_s": 0.0001, "byte_s": 4e-9}


def test_a_quota_is_announced_with_the_fixed_costs_it_stretches() -> None:
    (dev,) = emulate(parse_fleet("rpi4-4gb:1"), scale=0.25, cpus=2)
    under = dev.announced(100.0, CORE, quota=True)
    assert cpu_quota_of(under) == 0.25 and under.gflops == pytest.approx(25.0)
    assert fixed_costs_of(under) == FixedCosts(**{k: v * 4 for k, v in CORE.items()})
    throttled = dev.announced(100.0, CORE, quota=False)
    assert cpu_quota_of(throttled) is None
    assert fixed_costs_of(throttled) == FixedCosts(**CORE)
