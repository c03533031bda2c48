"""How a fleet of devices maps onto this machine: the numbers every testbed method uses.

A device's compute becomes a share of this machine's CPU: the fastest device
gets ``scale`` cores and every other device ``scale x gflops / fastest gflops``,
so the ratios between devices are the catalogue's. Its memory limit is its
``memory_bytes``; its link keeps the profile's bandwidth and latency. What an
emulated agent announces to the planner is the same device with the speed it
really gets here: ``cpus x`` this machine's per-core GFLOP/s.

[Note: two speeds of a device]
A device has two speeds that differ between devices by different ratios: its
training FLOP rate (the catalogue's ``training.sustained_gflops``, what its compute
kernels reach with SIMD and every core) and its *scalar* speed (one core on general
code: the interpreter, framing, the MQTT client; the catalogue's ``scalar.score``, a
published single-core benchmark). A Raspberry Pi 4 trains at 1/29 of the laptop's
FLOP rate but runs scalar code at about 1/7 of its speed. Emulating both:
``cpus`` is the FLOP share (compute runs at ``cpus`` of a core) and ``scalar_cpus``
the share of a core at which everything else runs: ``scale`` times the device's
scalar score over the fastest device's (the device that gets ``scale`` cores), at
least ``cpus``. The scalar method gives the agent a CPU quota of ``scalar_cpus`` and
duty-cycles its compute blocks on down to ``cpus`` (the throttle stretches a block to
``1 / cpus`` of its CPU seconds, which the quota does not change); the kernel method
gives it a quota of ``cpus`` for everything, so a Pi's Python runs 29x slower than the
laptop's, not 7x. A device whose profile has no scalar score (a measured file) keeps
``scalar_cpus == cpus``: it is emulated as under the kernel method.

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

__all__ = ["CPU_BUDGET", "EmulatedDevice", "default_scale", "emulate", "scalar_score"]

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
    scalar_cpus: float = 0.0
    """The share of a core it runs general code at under the scalar method ([Note: two
    speeds of a device]); 0: as ``cpus``."""

    @property
    def general_cpus(self) -> float:
        """The share of a core its code other than compute gets: ``scalar_cpus`` if set."""
        return self.scalar_cpus or self.cpus

    @property
    def threads(self) -> int:
        """torch threads for its agent: enough to use its share, at least one."""
        return max(1, math.ceil(self.cpus - 1e-9))

    @property
    def slowdown(self) -> float:
        """The software throttle's factor: one thread duty-cycled down to ``cpus``."""
        return max(1.0, 1.0 / self.cpus) if self.cpus < 1 else 1.0

    def quota_cpus(self, method: str) -> float | None:
        """The CPU quota its agent runs under with ``method``: the FLOP share (kernel),
        the scalar share (scalar), none (software)."""
        if method == "kernel":
            return self.cpus
        if method == "scalar":
            return self.general_cpus
        return None

    def announced(
        self,
        core_gflops: float,
        core_fixed: dict[str, float] | None = None,
        quota: float | None = None,
    ) -> DeviceSpec:
        """What its agent announces: the emulated speed it gets here, the profile's link,
        and this machine's fixed costs (``core_fixed``, one free core's): under a CPU
        ``quota`` (cores: the kernel and scalar methods, which limit every instruction
        the agent runs) they take ``1 / quota`` as long, and ``details["cpu_quota"]``
        says the share (the agent prices its own transport probe by it: [Note: the
        transport probe's share of a core] in :mod:`edge.profiling.fixed_costs`), else
        (the software throttle, which stretches compute only) as long as on a free
        core."""
        details: dict[str, object] = {
            "emulates": self.source.id,
            "emulated_gflops": self.source.gflops,
            "cpus": self.cpus,
            "core_gflops": core_gflops,
        }
        if quota is not None:  # the agent's transport probe runs before it is written
            details["cpu_quota"] = min(1.0, quota)
        if core_fixed:
            stretch = 1 / min(1.0, quota) if quota is not None else 1.0
            details["fixed_costs"] = {k: v * stretch for k, v in core_fixed.items()}
        return DeviceSpec(
            id=self.id,
            gflops=self.cpus * core_gflops,
            memory_bytes=self.memory_bytes,
            bandwidth_mbps=self.bandwidth_mbps,
            latency_ms=self.latency_ms,
            details=details,
        )


def scalar_score(device: DeviceSpec) -> float | None:
    """``device``'s single-core score on scalar code (the catalogue's ``scalar.score``,
    carried in ``details["scalar_score"]``), if its profile has one."""
    score = (device.details or {}).get("scalar_score")
    if isinstance(score, int | float) and not isinstance(score, bool) and score > 0:
        return float(score)
    return None


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
    reference = max(devices, key=lambda d: d.gflops)
    fastest = reference.gflops
    reference_score = scalar_score(reference)
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
        score = scalar_score(d)
        scalar = share
        if score is not None and reference_score is not None:
            scalar = max(share, min(max(1.0, share), scale * score / reference_score))
        out.append(
            EmulatedDevice(
                id=d.id,
                source=d,
                cpus=share,
                memory_bytes=int(d.memory_bytes),
                bandwidth_mbps=bandwidth,
                latency_ms=d.latency_ms,
                scalar_cpus=scalar,
            )
        )
    total = sum(e.cpus for e in out)
    if total > machine:
        raise UserError(
            f"the fleet needs {total:.2f} cores at --scale {scale:g} and this machine has "
            f"{machine:g}; lower --scale"
        )
    return out
