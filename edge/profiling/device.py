"""Measure this device: compute, usable memory, CPU share and its link to the broker.

This module owns device self-profiling, the numbers behind ``edgetrain profile``
and the profile an agent publishes: a sustained fp32 matmul rate, memory usable
for training (psutil, capped by the process's cgroup, v1 or v2), the effective
CPU count (affinity and CPU quota), and the link (round trip and bandwidth
measured through an MQTT broker, else the default interface's speed, else a
documented default). The result converts to :class:`edge.problem.DeviceSpec`.
A model's units timed on this device (``edgetrain profile --model``) join its
details as :func:`profile_unit_times` gives them.

On a GPU server (``device="cuda"`` or ``"cuda:N"``) compute and memory are the
GPU's instead (:func:`edge.profiling.matmul.gpu_profile`): sustained fp32 and
bf16 matmul TFLOP/s and free GPU memory; the planner gets the rate of the
precision the device will train in, and ``details["gpu"]`` keeps both rates and
the GPU's name.
"""

from __future__ import annotations

import os
import queue
import secrets
import socket
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import paho.mqtt.client as mqtt
import psutil
import torch

from edge.errors import UserError
from edge.models.unit_costs import profile_model
from edge.models.zoo import get_model
from edge.problem import DeviceSpec
from edge.profiling.fixed_costs import measure_fixed_costs
from edge.profiling.matmul import (
    PRECISIONS,
    GpuProfile,
    Precision,
    gpu_profile,
    matmul_benchmark,
    resolve_device,
)
from edge.transport import mqtt as transport_mqtt

__all__ = [
    "CgroupLimits",
    "LinkMeasurement",
    "MeasuredProfile",
    "cgroup_limits",
    "default_link",
    "effective_cpu_count",
    "measure_broker_link",
    "parse_broker_url",
    "profile_device",
    "profile_unit_times",
    "usable_memory_bytes",
]

DEFAULT_BANDWIDTH_MBPS = 100.0  # when neither a broker nor the interface tells (Fast Ethernet)
DEFAULT_LATENCY_MS = 1.0  # one-way, without a broker measurement (a switched LAN)

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
_V1_UNLIMITED = 1 << 62  # v1 reports "no limit" as a page-rounded 2**63 - 1
_MEMORY_FILES = {  # limit, usage, and the reclaimable cache in memory.stat
    "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
    "v2": ("memory.max", "memory.current", "inactive_file"),
}


@dataclass(frozen=True)
class CgroupLimits:
    """Limits of this process's cgroups; ``None`` where no limit applies."""

    memory_version: Literal["v1", "v2"] | None = None
    memory_limit_bytes: int | None = None
    memory_headroom_bytes: int | None = None  # tightest limit - usage over the ancestors
    cpu_version: Literal["v1", "v2"] | None = None
    cpu_quota_cores: float | None = None
    cpu_hidden: bool = False
    """This process is in a CPU cgroup below the root whose files are out of sight (as
    under ``ip netns exec``, which mounts a sysfs of its own over ``/sys``): a quota
    may apply that cannot be read."""


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _int(path: Path, key: str | None = None) -> int | None:
    """The integer in a cgroup file, or after ``key`` in a flat-keyed one (memory.stat)."""
    for fields in map(str.split, (_read(path) or "").splitlines()):
        if fields and (key is None or fields[0] == key):
            return int(fields[-1]) if fields[-1].lstrip("-").isdigit() else None
    return None


def _levels(mount: Path, cg_path: str) -> list[Path]:
    """This cgroup's directory and its ancestors up to ``mount``, leaf first; in a
    container the mount may hold only the path's tail, so leading parts may be dropped."""
    parts = [p for p in cg_path.split("/") if p]
    for skip in range(len(parts) + 1):
        leaf = mount.joinpath(*parts[skip:])
        if leaf.is_dir():
            return [leaf, *[p for p in leaf.parents if p.is_relative_to(mount)]]
    return []


def cgroup_limits(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> CgroupLimits:
    """Read memory and CPU limits for the cgroups named in ``proc_cgroup``.

    The version is detected per controller, not assumed: a controller named on
    a v1 line (``ID:controllers:path``) whose hierarchy is mounted under ``root``
    is read the v1 way (``memory.limit_in_bytes`` minus ``memory.usage_in_bytes``,
    ``cpu.cfs_quota_us / cpu.cfs_period_us``); otherwise the ``0::path`` line is
    read in the v2 hierarchy at ``root`` (``root/unified`` on hybrid hosts:
    ``memory.max`` minus ``memory.current``, ``cpu.max``). Reclaimable page cache
    (``inactive_file`` in ``memory.stat``) is not counted as used, as the kubelet
    does. Ancestors' limits count too; the tightest wins.
    """
    v1: dict[str, tuple[str, str]] = {}  # controller -> (hierarchy directory, path)
    v2: str | None = None
    for line in (_read(proc_cgroup) or "").splitlines():
        hid, controllers, path = [*line.split(":", 2), "", ""][:3]
        if hid == "0" and not controllers:
            v2 = path
        for name in filter(None, controllers.split(",")):
            v1[name] = (controllers.removeprefix("name="), path)
    v2_mount = root if (root / "cgroup.controllers").exists() else root / "unified"

    def find(ctrl: str) -> tuple[Literal["v1", "v2"] | None, list[Path]]:
        if ctrl in v1:
            dirname, path = v1[ctrl]
            for mount in (root / dirname, root / ctrl):
                if mount.is_dir() and (levels := _levels(mount, path)):
                    return "v1", levels
        if v2 is not None and (levels := _levels(v2_mount, v2)):
            return "v2", levels
        return None, []

    mem_version, levels = find("memory")
    limit_f, usage_f, cache_key = _MEMORY_FILES[mem_version or "v2"]
    mem: list[tuple[int, int]] = []  # (limit, usage) of each limited level
    for d in levels:
        lim = _int(d / limit_f)  # v2 "max" reads as None
        if lim is not None and lim < _V1_UNLIMITED:
            use = (_int(d / usage_f) or 0) - (_int(d / "memory.stat", cache_key) or 0)
            mem.append((lim, max(0, use)))
    lim, use = min(mem, key=lambda lu: lu[0] - lu[1], default=(None, 0))

    cpu_version, levels = find("cpu")
    cpu_path = v1["cpu"][1] if "cpu" in v1 else v2
    hidden = cpu_version is None and cpu_path not in (None, "", "/")
    quotas: list[float] = []
    for d in levels:
        if cpu_version == "v1":  # quota -1 means none, like v2's "max"
            text = f"{_read(d / 'cpu.cfs_quota_us')} {_read(d / 'cpu.cfs_period_us')}"
        else:
            text = _read(d / "cpu.max") or ""
        fields = text.split()
        if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit():
            quotas.append(int(fields[0]) / max(1, int(fields[1])))
    return CgroupLimits(
        memory_version=mem_version,
        memory_limit_bytes=lim,
        memory_headroom_bytes=None if lim is None else max(0, lim - use),
        cpu_version=cpu_version,
        cpu_quota_cores=min(quotas, default=None),
        cpu_hidden=hidden,
    )


def usable_memory_bytes(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """psutil's available memory, never more than the cgroup's remaining headroom."""
    available = int(psutil.virtual_memory().available)
    headroom = cgroup_limits(root, proc_cgroup).memory_headroom_bytes
    return available if headroom is None else min(available, headroom)


def effective_cpu_count(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float:
    """CPUs this process may use: its affinity mask, capped by a cgroup CPU quota."""
    affinity = getattr(os, "sched_getaffinity", None)  # absent on macOS and Windows
    cpus = float(len(affinity(0)) if affinity else os.cpu_count() or 1)
    quota = cgroup_limits(root, proc_cgroup).cpu_quota_cores
    return cpus if quota is None else min(cpus, quota)


@dataclass(frozen=True)
class LinkMeasurement:
    rtt_ms: float
    latency_ms: float  # half the round trip: the one-way latency the planner uses
    bandwidth_mbps: float
    rounds: int
    payloads: int
    payload_bytes: int
    publish_ms: float = 0.0
    """Median time of the publish call of a small QoS 1 message: what sending a frame
    costs the sender beyond the latency (see :mod:`edge.profiling.fixed_costs`)."""


def parse_broker_url(url: str) -> tuple[str, int]:
    """``mqtt://host[:port]`` (port 1883 by default) to ``(host, port)``; no TLS here."""
    scheme, host, port = transport_mqtt.parse_broker_url(url)
    if scheme != "mqtt":
        raise UserError(f"broker {url!r}: the link probe speaks plain MQTT (mqtt://host:port)")
    return host, port


def measure_broker_link(
    broker_url: str,
    *,
    payload_bytes: int = 1_000_000,
    rounds: int = 20,
    payloads: int = 4,
    timeout_s: float = 10.0,
    username: str | None = None,
    password: str | None = None,
) -> LinkMeasurement:
    """Round trip and bandwidth to a broker, by publishing to ourselves.

    The round trip is the median over ``rounds`` small messages at QoS 0 (at
    most 30% of ``timeout_s``). Not QoS 1: there each small message follows an
    acknowledgement written just before it (ours of the previous message, the
    broker's of this one), and with Nagle's algorithm on (paho and Mosquitto
    leave it on) the message waits for the TCP ACK of that acknowledgement; over
    a 10 ms delay each way the probe read 42 ms, not 20 (measured).
    Then ``payloads`` messages of ``payload_bytes`` are published
    back to back: the broker stores and forwards, so on a full-duplex link the
    last of ``k`` arrives after ``rtt + (k + 1) * T``; ``T`` gives the each-way
    rate of message bytes (through ``tc tbf`` at 20 Mbit/s it read 16-18: headers
    and TCP's start); whatever arrived by the deadline counts. Failing to connect or to get
    a message back raises a one-line :class:`UserError`. Always disconnects.
    """
    host, port = parse_broker_url(broker_url)
    deadline = (start := time.monotonic()) + timeout_s
    token = secrets.token_hex(8)
    topic = f"edgetrain/v1/probe/{token}"
    inbox: queue.Queue[tuple[str, bytes, float]] = queue.Queue()  # (topic or event, body, when)
    version = mqtt.CallbackAPIVersion.VERSION2
    client = mqtt.Client(callback_api_version=version, client_id=f"edgetrain-probe-{token}")
    client.on_connect = lambda _c, _u, _f, rc, _p: inbox.put(
        ("$connect", str(rc).encode() if rc.is_failure else b"", 0.0)
    )
    client.on_subscribe = lambda *_: inbox.put(("$subscribe", b"", 0.0))
    client.on_message = lambda _c, _u, m: inbox.put(
        (m.topic, bytes(m.payload), time.perf_counter())
    )
    client.connect_timeout = max(0.1, min(timeout_s, 5.0))
    if username is not None:
        client.username_pw_set(username, password)

    def wait(name: str, until: float, payload: bytes | None = None) -> tuple[bytes, float] | None:
        while (left := until - time.monotonic()) > 0:
            try:
                got, body, at = inbox.get(timeout=left)
            except queue.Empty:
                return None
            if got == name and payload in (None, body):
                return body, at
        return None

    def fail(why: str, within: str = f" within {timeout_s:g} s") -> UserError:
        return UserError(f"broker {broker_url}: {why}{within}")

    try:
        try:
            client.connect(host, port, keepalive=max(10, int(timeout_s) + 5))
        except (OSError, ValueError) as exc:
            raise UserError(f"broker {broker_url}: cannot connect: {exc}") from None
        client.loop_start()
        if (ack := wait("$connect", deadline)) is None:
            raise fail("no MQTT answer")
        if ack[0]:
            raise fail(f"refused the connection: {ack[0].decode()}", "")
        client.subscribe(f"{topic}/#", qos=1)
        if wait("$subscribe", deadline) is None:
            raise fail("no answer to a subscription")
        rtts: list[float] = []
        for i in range(rounds):
            t0 = time.perf_counter()
            client.publish(f"{topic}/rtt", b"%d" % i, qos=0)
            until = min(deadline, start + 0.3 * timeout_s) if rtts else deadline
            if (got := wait(f"{topic}/rtt", until, b"%d" % i)) is None:
                break
            rtts.append(got[1] - t0)
        if not rtts:
            raise fail("no probe message came back")
        rtt = statistics.median(rtts)
        publish = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            client.publish(f"{topic}/frame", bytes(1024), qos=1)
            publish.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(payloads):
            client.publish(f"{topic}/bulk", bytes(payload_bytes), qos=1)
        arrived = [g[1] for _ in range(payloads) if (g := wait(f"{topic}/bulk", deadline))]
        if not arrived:
            raise fail(f"no {payload_bytes}-byte payload came back")
        span = arrived[-1] - t0
        per_payload = (span - rtt if span > rtt else span) / (len(arrived) + 1)
        mbps = payload_bytes * 8 / max(per_payload, 1e-9) / 1e6
        return LinkMeasurement(
            rtt_ms=rtt * 1e3,
            latency_ms=rtt * 500,
            bandwidth_mbps=mbps,
            rounds=len(rtts),
            payloads=len(arrived),
            payload_bytes=payload_bytes,
            publish_ms=statistics.median(publish) * 1e3,
        )
    finally:
        client.disconnect()
        client.loop_stop()


def default_link(route_file: Path = Path("/proc/net/route")) -> tuple[float, float, dict[str, Any]]:
    """``(bandwidth_mbps, latency_ms, details)`` without a broker.

    Bandwidth: psutil's speed of the default route's interface when it knows one
    (``link_source`` ``"interface-speed"``), else ``DEFAULT_BANDWIDTH_MBPS``
    (``"default"``); latency is always ``DEFAULT_LATENCY_MS`` (no interface knows it).
    """
    rows = [line.split() for line in (_read(route_file) or "").splitlines()[1:]]
    iface = next((r[0] for r in rows if len(r) > 2 and r[1] == "00000000"), None)
    stats = psutil.net_if_stats().get(iface) if iface else None
    detail = {"link_source": "default", "interface": iface}
    if stats is None or stats.speed <= 0:
        return DEFAULT_BANDWIDTH_MBPS, DEFAULT_LATENCY_MS, detail
    return float(stats.speed), DEFAULT_LATENCY_MS, {**detail, "link_source": "interface-speed"}


@dataclass
class MeasuredProfile:
    """A measured device; :meth:`to_device_spec` gives what the planner reads.

    Everything beyond the planner's five figures lives in ``details`` (free-form
    in :class:`~edge.problem.DeviceSpec`), so the JSON stays a valid device of a
    planning problem; :attr:`gpu` reads a GPU's figures back from it.
    """

    id: str
    gflops: float
    memory_bytes: int
    bandwidth_mbps: float
    latency_ms: float
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def gpu(self) -> GpuProfile | None:
        """The GPU's measurement when this device was profiled on one."""
        gpu = self.details.get("gpu")
        return GpuProfile(**gpu) if gpu else None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def to_device_spec(self) -> DeviceSpec:
        return DeviceSpec.model_validate(self.to_json())


def profile_device(
    device_id: str | None = None,
    broker_url: str | None = None,
    seconds: float = 2.0,
    *,
    device: str = "cpu",
    precision: Precision = "fp32",
    slowdown: float = 1.0,
) -> MeasuredProfile:
    """Measure this device as a planning-problem device.

    On ``device="cpu"``, ``gflops`` is the measured matmul rate in ``precision``
    (:func:`matmul_benchmark`; fp32 by default) and ``memory_bytes`` is
    :func:`usable_memory_bytes`. On ``"cuda"`` or ``"cuda:N"`` both are the
    GPU's (:func:`gpu_profile`): the sustained matmul rate of ``precision``
    (``"bf16"`` for an agent that trains under bf16 autocast, ``"fp32"``
    otherwise, TF32 off) and the free GPU memory; ``details["gpu"]`` holds the
    GPU's name and both rates. A device that is not there is a one-line
    :class:`UserError` before anything is measured. Either rate is an upper
    bound for training, which also runs element-wise ops and the optimizer; the
    planner's measured per-unit times refine it. The link is measured through
    ``broker_url`` when given (first, so a bad broker fails fast), otherwise
    see :func:`default_link`; ``details["link_source"]`` says which.
    ``details["fixed_costs"]`` holds the device's fixed costs per microbatch, step
    and frame (:func:`~edge.profiling.fixed_costs.measure_fixed_costs`, run under
    the agent's software ``slowdown``).
    """
    if precision not in PRECISIONS:
        raise UserError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    dev = resolve_device(device)
    host = socket.gethostname()
    if broker_url is not None:
        link = measure_broker_link(broker_url)
        bw, lat = link.bandwidth_mbps, link.latency_ms
        link_details = {"link_source": "measured-broker", "broker": broker_url, **asdict(link)}
    else:
        bw, lat, link_details = default_link()
    gpu: GpuProfile | None = None
    if dev.type == "cuda":
        gpu = gpu_profile(dev, seconds)
        gflops, memory = gpu.tflops(precision) * 1e3, gpu.memory_free_bytes
        size, rounds = (
            (gpu.bf16_size, gpu.bf16_rounds)
            if precision == "bf16"
            else (gpu.fp32_size, gpu.fp32_rounds)
        )
        dtype = "torch.bfloat16" if precision == "bf16" else "torch.float32"
        matmul = {"dtype": dtype, "size": size, "repeats": rounds}
        threads = torch.get_num_threads()
    else:
        mm = matmul_benchmark(torch.bfloat16 if precision == "bf16" else torch.float32, seconds)
        gflops, memory, threads = mm.gflops, usable_memory_bytes(), mm.threads
        matmul = {
            "dtype": mm.dtype,
            "size": mm.size,
            "repeats": mm.repeats,
            "best_gflops": mm.best_gflops,
        }
    publish_ms = link_details.get("publish_ms")
    fixed = measure_fixed_costs(slowdown=slowdown, publish_ms=publish_ms)
    details: dict[str, Any] = {
        **link_details,
        "fixed_costs": fixed.to_json(),
        "hostname": host,
        "cores_logical": psutil.cpu_count(logical=True),
        "cores_effective": effective_cpu_count(),
        "torch_version": torch.__version__,
        "torch_threads": threads,
        "device": str(dev),
        "precision": precision,
        "matmul": matmul,
        "cgroup": asdict(cgroup_limits()),
        "memory_total_bytes": int(psutil.virtual_memory().total),
    }
    if gpu is not None:
        details["gpu"] = asdict(gpu)
    return MeasuredProfile(
        id=device_id or host,
        gflops=gflops,
        memory_bytes=memory,
        bandwidth_mbps=bw,
        latency_ms=lat,
        details=details,
    )


def profile_unit_times(model: str, batch_size: int) -> dict[str, Any]:
    """A profile's ``details["units"]``: the forward and backward seconds per batch of
    ``batch_size`` of every unit of ``model`` (a zoo name or ``package.module:function``),
    each timed alone on this CPU (:func:`~edge.models.unit_costs.profile_model`). The CPU
    only: the units are timed on the host clock with no CUDA synchronisation, which on a
    GPU measures kernel launches, not kernels."""
    prof = profile_model(get_model(model), batch_size)
    return {
        "model": model,
        "batch_size": batch_size,
        "times": [
            {"name": u.name, "fwd_time_s": u.fwd_time_s, "bwd_time_s": u.bwd_time_s}
            for u in prof.units
        ],
    }
