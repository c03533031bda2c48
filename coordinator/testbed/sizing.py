"""How a fleet of devices maps onto this machine: the numbers every testbed method uses.

A device's compute becomes a share of this machine's CPU: the fastest device
gets ``scale`` cores and every other device ``scale x gflops / fastest gflops``,
so the ratios between devices are the catalogue's. Its memory limit is its
``memory_bytes``; its link keeps the profile's bandwidth and latency. What an
emulated agent announces to the planner is the same device with the speed it
really gets here: ``cpus x`` this machine's per-core GFLOP/s.

The default scale gives the whole fleet at most :data:`CPU_BUDGET` of the
machine's cores (the broker, the coordinator and the driver need the rest) and
no device more than one core per torch thread it runs.

Tested in tests/unit/coordinator/testbed/test_testbed_sizing.py and
tests/unit/coordinator/testbed/test_compose_render.py (the limits in a compose file).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from edge.errors import UserError
from edge.problem import DeviceSpec

__all__ = ["CPU_BUDGET", "EmulatedDevice", "default_scale", "emulate"]

CPU_BUDGET = 0.75
"""Fraction of this machine's cores the default scale hands to the emulated devices."""

MIN_CPUS = 0.01
"""The smallest share a cgroup quota can express sensibly (1 ms of a 100 ms period)."""


@dataclass(frozen=True)
class EmulatedDevice:
    """One device of the fleet as this machine emulates it."""

    id: str
    """The agent's device id."""
    source: DeviceSpec
    """The device being emulated, as the catalogue (or a measured file) describes it."""
    cpus: float
    """CPU cores it may use here (cgroup quota, docker ``cpus``)."""
    memory_bytes: int
    bandwidth_mbps: float
    latency_ms: float

    @property
    def threads(self) -> int:
        """torch threads for its agent: enough to use its share, at least one."""
        return max(1, math.ceil(self.cpus - 1e-9))

    @property
    def slowdown(self) -> float:
        """The software throttle's factor: one thread duty-cycled down to ``cpus``."""
        return max(1.0, 1.0 / self.cpus) if self.cpus < 1 else 1.0

    def announced(
        self, core_gflops: float, core_fixed: dict[str, float] | None = None, quota: bool = False
    ) -> DeviceSpec:
        """What its agent announces: the emulated speed it gets here, the profile's link,
        and this machine's fixed costs (``core_fixed``, one free core's): under a CPU
        ``quota`` (the kernel method, which limits every instruction the agent runs)
        they take ``1 / cpus`` as long, and ``details["cpu_quota"]`` says the share (the
        agent prices its own transport probe by it: [Note: the transport probe's share
        of a core] in :mod:`edge.profiling.fixed_costs`), else (the software throttle,
        which stretches compute only) as long as on a free core."""
        details: dict[str, object] = {
            "emulates": self.source.id,
            "emulated_gflops": self.source.gflops,
            "cpus": self.cpus,
            "core_gflops": core_gflops,
        }
        if quota:  # the agent's transport probe runs before it is written
            details["cpu_quota"] = min(1.0, self.cpus)
        if core_fixed:
            stretch = 1 / min(1.0, self.cpus) if quota else 1.0
            details["fixed_costs"] = {k: v * stretch for k, v in core_fixed.items()}
        return DeviceSpec(
            id=self.id,
            gflops=self.cpus * core_gflops,
            memory_bytes=self.memory_bytes,
            bandwidth_mbps=self.bandwidth_mbps,
            latency_ms=self.latency_ms,
            details=details,
        )


def default_scale(devices: list[DeviceSpec], cpus: float | None = None) -> float:
    """Cores for the fastest device so the fleet fits in :data:`CPU_BUDGET` of ``cpus``."""
    cpus = float(cpus or os.cpu_count() or 1)
    fastest = max(d.gflops for d in devices)
    total = sum(d.gflops for d in devices) / fastest  # in units of the fastest device
    return min(1.0, CPU_BUDGET * cpus / total)


def emulate(
    devices: list[DeviceSpec],
    scale: float | None = None,
    *,
    cpus: float | None = None,
    links: dict[str, float] | None = None,
) -> list[EmulatedDevice]:
    """The emulated fleet: ``scale`` cores for the fastest device (default: :func:`default_scale`).

    ``links`` overrides the bandwidth (Mbit/s) of the devices it names, e.g. a cut link.
    Raises :class:`UserError` when a share would be too small to enforce or the
    fleet asks for more cores than this machine has.
    """
    if not devices:
        raise UserError("--devices: no devices given")
    machine = float(cpus or os.cpu_count() or 1)
    scale = default_scale(devices, machine) if scale is None else scale
    if not scale > 0:
        raise UserError(f"--scale must be positive (got {scale})")
    fastest = max(d.gflops for d in devices)
    links = links or {}
    unknown = sorted(set(links) - {d.id for d in devices})
    if unknown:
        raise UserError(f"link override for {unknown[0]!r}: no such device in the fleet")
    out = []
    for d in devices:
        share = scale * d.gflops / fastest
        if share < MIN_CPUS:
            raise UserError(
                f"device {d.id}: {share:.4f} cores is too small to emulate; raise --scale "
                f"(the fleet spans {fastest / d.gflops:.0f}x)"
            )
        bandwidth = links.get(d.id, d.bandwidth_mbps)
        if not bandwidth > 0:
            raise UserError(f"link override for {d.id!r}: bandwidth must be positive")
        out.append(
            EmulatedDevice(
                id=d.id,
                source=d,
                cpus=share,
                memory_bytes=int(d.memory_bytes),
                bandwidth_mbps=bandwidth,
                latency_ms=d.latency_ms,
            )
        )
    total = sum(e.cpus for e in out)
    if total > machine:
        raise UserError(
            f"the fleet needs {total:.2f} cores at --scale {scale:g} and this machine has "
            f"{machine:g}; lower --scale"
        )
    return out
