"""How the testbed enforces limits on this machine, and the cgroups of the kernel method.

Three methods, with the same interface to the rest of the testbed:

- **kernel**: root, a usable cpu and memory cgroup controller, ``ip netns`` and
  ``tc`` with the ``tbf`` qdisc. Each agent runs in a cgroup of its own (CPU
  quota and memory limit) and a network namespace whose veth is shaped with
  ``tbf`` (:mod:`coordinator.testbed.netns`); latency comes from the delay
  proxy (:mod:`coordinator.testbed.proxy`), since this kernel has no netem. The
  quota is the device's FLOP share, so *everything* the agent runs (its Python,
  framing, MQTT client) is slowed by the FLOP ratio.
- **scalar**: what the kernel method needs, but the quota is the device's
  *scalar* share (its single-core speed on general code, the catalogue's
  ``scalar`` score, against the fastest device's), and the agent duty-cycles its
  compute blocks on down to the FLOP share (``--slowdown``): Python, framing and
  messaging run at the real scalar ratio, compute at the FLOP ratio ([Note: two
  speeds of a device] in :mod:`coordinator.testbed.sizing`).
- **software**: otherwise. The agent duty-cycles its compute (``--slowdown``)
  and shapes its own MQTT link (``--link-mbps``, ``--link-latency-ms``).

Cgroups are detected, not assumed: each controller is looked up in
``/proc/self/mountinfo``, as a cgroup v1 hierarchy mounted with that controller,
else in the cgroup v2 mount's ``cgroup.controllers`` (a hybrid machine may mix
them). v1 limits are ``cpu.cfs_period_us``/``cpu.cfs_quota_us`` and
``memory.limit_in_bytes``; v2 limits are ``cpu.max`` and ``memory.max``.
Every testbed's cgroups live under ``edgetrain-testbed-<id>`` in each hierarchy.

Tested in tests/unit/coordinator/testbed/test_testbed_limits.py (detection from
mountinfo, the limits written) and tests/integration/test_agent_memory.py (an agent in a
real cgroup, as root).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = [
    "CFS_PERIOD_US",
    "METHODS",
    "Controller",
    "Detection",
    "Method",
    "MethodChoice",
    "cgroup_limits",
    "cgroup_parent",
    "cgroup_tasks",
    "cpu_unlimited",
    "detect",
    "find_controllers",
    "lift_cpu_quota",
    "make_cgroup",
    "most_faithful",
    "remove_cgroup",
    "write_limits",
]

Method = Literal["kernel", "scalar", "software"]
MethodChoice = Literal["auto", "kernel", "scalar", "software"]
METHODS: tuple[str, ...] = ("auto", "kernel", "scalar", "software")
"""What ``--method`` takes: ``auto`` is the kernel method where it works, else software."""
CFS_PERIOD_US = 20_000
"""The CPU quota's period in microseconds, unless a share needs a longer one (see
[Note: CFS period])."""
MIN_QUOTA_US = 4_000
"""The smallest quota used: one scheduler tick at HZ=250, the granularity at which the
kernel notices a quota is spent (the kernel itself accepts 1 ms)."""


@dataclass(frozen=True)
class Controller:
    """Where one cgroup controller (``cpu`` or ``memory``) can be used."""

    name: str
    version: Literal["v1", "v2"]
    root: Path
    """The hierarchy's mount point."""


@dataclass(frozen=True)
class Detection:
    """The method in force and why, in one line each."""

    method: Method
    reason: str
    cpu: Controller | None = None
    memory: Controller | None = None

    @property
    def line(self) -> str:
        """What ``testbed up`` prints about the limits."""
        if self.method in ("kernel", "scalar"):
            assert self.cpu is not None and self.memory is not None
            versions = sorted({self.cpu.version, self.memory.version})
            how = f"cgroup {'+'.join(versions)}, netns + tc tbf, delay proxy"
            if self.method == "scalar":
                return f"scalar ({how}; quota at the scalar speed, compute throttled to FLOPs)"
            return f"kernel ({how}; quota at the FLOP speed)"
        return "software (duty-cycled compute, token bucket in the agent transport): " + self.reason


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def find_controllers(
    mountinfo: str, read: Callable[[str], str] = _read_text
) -> dict[str, Controller]:
    """The usable ``cpu`` and ``memory`` controllers named by ``mountinfo`` text.

    ``read(path)`` reads a file (``cgroup.controllers`` of the v2 mount); a v1
    hierarchy with the controller wins over v2, where the controller is then
    unavailable anyway (a controller is bound to one hierarchy).
    """
    v1: dict[str, Path] = {}
    v2: list[Path] = []
    for line in mountinfo.splitlines():
        pre, sep, post = line.partition(" - ")
        fields, tail = pre.split(), post.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        mount = Path(fields[4].replace("\\040", " "))
        if tail[0] == "cgroup":
            for opt in tail[2].split(","):
                if opt in ("cpu", "memory") and opt not in v1:
                    v1[opt] = mount
        elif tail[0] == "cgroup2":
            v2.append(mount)
    found = {name: Controller(name, "v1", root) for name, root in v1.items()}
    for root in v2:
        available = read(str(root / "cgroup.controllers")).split()
        for name in ("cpu", "memory"):
            if name in available and name not in found:
                found[name] = Controller(name, "v2", root)
    return found


def _run_ok(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _probe_netns_tbf() -> str | None:
    """Why namespaces + tbf cannot be used (``None``: they work), tried on a scratch namespace."""
    if shutil.which("ip") is None:
        return "no 'ip' command (iproute2)"
    if shutil.which("tc") is None:
        return "no 'tc' command (iproute2)"
    name = f"et-probe-{os.getpid()}"
    if not _run_ok(["ip", "netns", "add", name]):
        return "'ip netns add' failed"
    try:
        tbf = [
            "ip",
            "netns",
            "exec",
            name,
            "tc",
            "qdisc",
            "add",
            "dev",
            "lo",
            "root",
            "tbf",
            "rate",
            "1mbit",
            "burst",
            "32kbit",
            "latency",
            "400ms",
        ]
        if not _run_ok(tbf):
            return "the kernel has no tbf qdisc (tc qdisc add ... tbf failed)"
    finally:
        _run_ok(["ip", "netns", "delete", name])
    return None


def detect(requested: MethodChoice = "auto") -> Detection:
    """The method to use: ``requested`` (``kernel`` for ``auto``) when everything the
    kernel's limits need works here, else ``software``.

    ``requested="kernel"`` or ``"scalar"`` returns a software detection whose reason
    says what is missing where they do not work; the caller refuses it.
    """
    if requested == "software":
        return Detection("software", "requested (--method software)")
    if os.geteuid() != 0:
        return Detection("software", "not root (cgroups and network namespaces need root)")
    controllers = find_controllers(_read_text("/proc/self/mountinfo"))
    missing = [name for name in ("cpu", "memory") if name not in controllers]
    if missing:
        return Detection("software", f"no usable cgroup {' or '.join(missing)} controller")
    why = _probe_netns_tbf()
    if why is not None:
        return Detection("software", why)
    cpu, memory = controllers["cpu"], controllers["memory"]
    method: Method = "scalar" if requested == "scalar" else "kernel"
    return Detection(
        method=method, reason="root with cgroups, netns and tc tbf", cpu=cpu, memory=memory
    )


def most_faithful() -> Method:
    """The method that emulates a device most faithfully here: ``scalar`` where the
    kernel's limits work, else ``software`` (the benchmarks' default)."""
    return "scalar" if detect("scalar").method == "scalar" else "software"


def cgroup_parent(controller: Controller, testbed: str) -> Path:
    """The testbed's own cgroup in ``controller``'s hierarchy."""
    return controller.root / f"edgetrain-testbed-{testbed}"


def cfs_period_us(cpus: float) -> int:
    """The quota's period for a share of ``cpus``: :data:`CFS_PERIOD_US`, longer for tiny shares.

    [Note: CFS period] The quota caps CPU time per period, so a burst of compute
    shorter than the quota runs at full speed after an idle spell, and only the
    average over many periods is slowed to the share. Pipeline stages compute in
    bursts (one microbatch's forward or backward) and wait in between: under the
    usual 100 ms period a 0.5-core stage with 20 ms bursts was not slowed at all
    (measured). A 20 ms period slows every burst longer than a few milliseconds;
    the quota stays at least :data:`MIN_QUOTA_US`, so tiny shares get a longer
    period. Bursts much shorter than the quota are still not slowed: the software
    method, which stretches each burst, is exact there.
    """
    return max(CFS_PERIOD_US, math.ceil(MIN_QUOTA_US / cpus))


def cgroup_limits(controller: Controller, cpus: float, memory_bytes: int) -> dict[str, str]:
    """The files to write in an agent's cgroup of ``controller``, and their contents."""
    if controller.name == "cpu":
        period = cfs_period_us(cpus)
        quota = max(MIN_QUOTA_US, round(cpus * period))
        if controller.version == "v1":
            return {"cpu.cfs_period_us": str(period), "cpu.cfs_quota_us": str(quota)}
        return {"cpu.max": f"{quota} {period}"}
    if controller.version == "v1":
        return {"memory.limit_in_bytes": str(int(memory_bytes))}
    return {"memory.max": str(int(memory_bytes))}


def cpu_unlimited(controller: Controller) -> dict[str, str]:
    """The cpu files that lift the quota.

    See [Note: agents start unthrottled] in :mod:`coordinator.testbed.testbed`.
    """
    if controller.version == "v1":
        return {"cpu.cfs_period_us": str(CFS_PERIOD_US), "cpu.cfs_quota_us": "-1"}
    return {"cpu.max": f"max {CFS_PERIOD_US}"}


def write_limits(path: Path, limits: dict[str, str]) -> None:
    """Write ``limits`` (file name -> content) into the cgroup ``path``."""
    for name, value in limits.items():
        (path / name).write_text(value)


def lift_cpu_quota(path: Path) -> None:
    """Lift the CPU quota of the cgroup ``path`` if it has one (v1 or v2); else nothing."""
    for name, value in (("cpu.cfs_quota_us", "-1"), ("cpu.max", "max")):
        with contextlib.suppress(OSError):
            if (path / name).exists():
                (path / name).write_text(value)


def _enable_v2(directory: Path, name: str) -> None:
    """v2: a child may use ``name`` only when its parent delegates it (``subtree_control``)."""
    control = directory / "cgroup.subtree_control"
    if name not in control.read_text().split():
        control.write_text(f"+{name}")


def make_cgroup(controller: Controller, path: Path, limits: dict[str, str]) -> None:
    """Create ``path`` (and its parent) in ``controller``'s hierarchy and write ``limits``."""
    if controller.version == "v2":
        _enable_v2(controller.root, controller.name)
    path.parent.mkdir(exist_ok=True)
    if controller.version == "v2":
        _enable_v2(path.parent, controller.name)
    path.mkdir(exist_ok=True)
    write_limits(path, limits)


def cgroup_tasks(path: Path) -> list[int]:
    """Pids in the cgroup ``path`` (none when it does not exist)."""
    try:
        return [int(p) for p in (path / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def remove_cgroup(path: Path, timeout_s: float = 5.0) -> bool:
    """Remove the cgroup directory ``path`` once it is empty; whether it existed.

    Its tasks must have been ended first (they are the testbed's own agents); a
    cgroup stays busy for a moment after its last task exits, hence the retries.
    """
    if not path.exists():
        return False
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
