"""What an agent announces of its device (its compute, memory and link), and the link
its tensor frames are shaped to.

An agent (:mod:`edge.agent`) announces one of:

- **this machine, measured** (:func:`edge.profiling.device.profile_device`: compute,
  memory, link, fixed costs) on the CPU, or on a GPU in fp32 or bf16; a server-tier
  agent's ``details`` say so (``server``, ``torch_device``). A shaped link (software
  shaping of its frames, ``link_mbps`` and ``link_latency_ms``) is announced as
  shaped: the real link's rate capped, its latency added;
- **a catalogue device, emulated** (``emulate`` with ``slowdown``): this machine
  measured, announcing the speed it really gets slowed (its measured rate over
  ``slowdown``), the catalogue device's memory and power, and the catalogue device's
  link, which its frames are shaped to unless the options name another; ``details``
  name what it emulates. The planner then predicts what the device measures;
- **a catalogue profile or a device file, given** (``profile``: a name, or a JSON file
  as ``edgetrain profile --json`` writes it), announced as it is under the agent's id.

:func:`resolve_announcement` settles which before the agent connects, so a bad option,
name or file fails with one line (:class:`~edge.errors.UserError`) first;
:meth:`Announcement.measure` measures when the agent starts. Agents sharing a machine
may take turns to measure (``measure_lock``), so that none measures the others.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from edge.errors import UserError
from edge.problem import DeviceSpec
from edge.profiling.catalog import load_device_file, resolve
from edge.profiling.matmul import Precision
from edge.transport.settings import MqttSettings

__all__ = ["AnnounceOptions", "Announcement", "emulating", "resolve_announcement"]


class AnnounceOptions(BaseModel):
    """How an agent finds what it announces (``edgetrain agent``'s options of the same
    names); each is checked here, with a one-line :class:`~edge.errors.UserError`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    link_mbps: float | None = None
    """Shape tensor frames to this many Mbit/s each way (software shaping)."""
    link_latency_ms: float = 0.0
    """Add this one-way latency to tensor frames, each way (software shaping)."""
    device: str = "cpu"
    """Where stages compute and what is measured: ``cpu``, ``cuda`` or ``cuda:N``."""
    precision: Precision = "fp32"
    """On a GPU, the matmul rate announced: fp32, or bf16 (autocast)."""
    server: bool = False
    """A server-tier agent, which may join torch.distributed groups (implied by a GPU)."""
    profile: str | None = None
    """A catalogue name, or a device file (``.json``, or any file that exists), to announce
    instead of measuring."""
    emulate: str | None = None
    """A catalogue device to emulate at ``slowdown``."""
    slowdown: float = 1.0
    """How many times slower than this machine the agent computes."""
    measure_seconds: float = 1.0
    """How long to time matmuls when measuring."""
    measure_lock: Path | None = None
    """A file to hold an exclusive lock on while measuring."""

    @field_validator("link_mbps")
    @classmethod
    def _positive_rate(cls, value: float | None) -> float | None:
        if value is not None and not (math.isfinite(value) and value > 0):
            raise UserError(f"--link-mbps: must be a positive number (got {value:g})")
        return value

    @field_validator("link_latency_ms")
    @classmethod
    def _latency_in_range(cls, value: float) -> float:
        if not (math.isfinite(value) and 0 <= value <= 60_000):
            raise UserError(f"--link-latency-ms: must be 0 to 60000 (got {value:g})")
        return value

    @field_validator("device")
    @classmethod
    def _device_here(cls, value: str) -> str:
        if value != "cpu" and not value.startswith("cuda"):
            raise UserError(f"--device: {value!r} is not cpu, cuda or cuda:N")
        if value.startswith("cuda") and not torch.cuda.is_available():
            raise UserError(f"--device {value}: torch sees no CUDA GPU on this machine")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> AnnounceOptions:
        if self.emulate is not None and self.profile is not None:
            raise UserError("--emulate and --profile: give one")
        return self

    @property
    def tier(self) -> dict[str, Any]:
        """What a server-tier device adds to its measured ``details`` (nothing elsewhere)."""
        if self.server or self.device != "cpu":
            return {"server": True, "torch_device": self.device}
        return {}


@dataclass(frozen=True)
class Announcement:
    """What one agent announces, settled before it connects (see the module docstring)."""

    device_id: str
    options: AnnounceOptions
    given: DeviceSpec | None
    """The catalogue profile or device file announced as it is; ``None``: measure."""
    link_mbps: float | None
    """The rate tensor frames are shaped to (the emulated device's unless the options
    name one); ``None``: not shaped."""
    link_latency_ms: float
    """The one-way latency added to tensor frames (likewise)."""

    def shaped(self, settings: MqttSettings) -> MqttSettings:
        """``settings`` with tensor frames shaped to this announcement's link."""
        link = {"link_mbps": self.link_mbps, "link_latency_ms": self.link_latency_ms}
        return settings.model_copy(update=link)

    def measure(self) -> DeviceSpec:
        """Measure this machine (unless a profile was given; while holding the options'
        ``measure_lock``, if any) and return what the agent announces of it."""
        o = self.options
        if self.given is None and o.measure_lock is not None:
            from edge.profiling.fixed_costs import prepare_fixed_costs

            prepare_fixed_costs()  # loading, not timing: beside the others, not in turn
        with _exclusive(o.measure_lock if self.given is None else None):
            spec = self.given or _measured(self.device_id, o)
        return self.announced(spec)

    def announced(self, spec: DeviceSpec) -> DeviceSpec:
        """What the agent announces of ``spec``: the given profile, or this machine as
        measured (see the module docstring)."""
        o = self.options
        if o.emulate is not None:
            spec = emulating(spec, o.emulate, o.slowdown)
            link = {"bandwidth_mbps": self.link_mbps, "latency_ms": self.link_latency_ms}
            return spec.model_copy(update=link)
        if o.tier:
            spec = spec.model_copy(update={"details": {**(spec.details or {}), **o.tier}})
        if self.given is not None or (self.link_mbps is None and not self.link_latency_ms):
            return spec
        # Shaping caps the rate of the real link and adds to its latency.
        bandwidth = min(spec.bandwidth_mbps, self.link_mbps or math.inf)
        latency = spec.latency_ms + self.link_latency_ms
        return spec.model_copy(update={"bandwidth_mbps": bandwidth, "latency_ms": latency})


def resolve_announcement(device_id: str, options: AnnounceOptions) -> Announcement:
    """What agent ``device_id`` will announce with ``options``: the profile it gives read
    (from the catalogue or its file), the emulated device looked up and its link taken.
    An unknown name or a bad file is a one-line :class:`~edge.errors.UserError`."""
    link_mbps, link_latency_ms = options.link_mbps, options.link_latency_ms
    if options.emulate is not None:
        source = resolve(options.emulate).to_device_spec()  # an unknown name fails here
        # Its link too: frames are shaped to the device's, which it then announces.
        link_mbps = link_mbps or source.bandwidth_mbps
        link_latency_ms = link_latency_ms or source.latency_ms
    given: DeviceSpec | None = None
    profile = options.profile
    if profile is not None and (profile.endswith(".json") or Path(profile).is_file()):
        given = load_device_file(Path(profile), device_id)
    elif profile is not None:
        given = resolve(profile).to_device_spec(device_id, power=True)
    return Announcement(device_id, options, given, link_mbps, link_latency_ms)


def emulating(measured: DeviceSpec, name: str, slowdown: float) -> DeviceSpec:
    """What an agent emulating catalogue device ``name`` announces: the speed it really
    gets here (this machine's measured rate over ``slowdown``), the device's memory and
    power, this machine's link and fixed costs; ``details`` name what it emulates."""
    source = resolve(name).to_device_spec(power=True)
    details = {
        **(measured.details or {}),
        "emulates": name,
        "emulated_gflops": source.gflops,
        "measured_gflops": measured.gflops,
        "slowdown": slowdown,
    }
    return measured.model_copy(
        update={
            "gflops": measured.gflops / slowdown,
            "memory_bytes": min(measured.memory_bytes, source.memory_bytes),
            "watts_busy": source.watts_busy,
            "watts_idle": source.watts_idle,
            "details": details,
        }
    )


def _measured(device_id: str, o: AnnounceOptions) -> DeviceSpec:
    from edge.profiling.device import profile_device

    if o.device == "cpu":  # the CPU's fp32 rate, whatever the precision
        return profile_device(
            device_id, seconds=o.measure_seconds, slowdown=o.slowdown
        ).to_device_spec()
    return profile_device(
        device_id,
        seconds=o.measure_seconds,
        device=o.device,
        precision=o.precision,
        slowdown=o.slowdown,
    ).to_device_spec()


@contextlib.contextmanager
def _exclusive(path: Path | None) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (nothing without one, or where there is
    no ``fcntl``)."""
    try:
        import fcntl
    except ImportError:  # Windows: measure without the lock
        path = None
    if path is None:
        yield
        return
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
