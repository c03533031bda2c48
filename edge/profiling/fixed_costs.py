"""The fixed costs of training on this device: per microbatch, per step and per frame.

A FLOP count prices the work of a layer, not the cost of running it: the stage
loop, the frames, the report and the flush cost the same whatever the model.
This module measures them where the agent runs and carries them in the announced
profile's ``details["fixed_costs"]`` (a planning problem's device keeps its spec
fields; the score ignores ``details``):

- ``microbatch_s`` and ``step_s``: a one-stage job of a tiny model run through
  the real stage runtime (:class:`~edge.runtime.stage.StageRuntime`, in-process
  transport) with 1 and :data:`PROBE_MICROBATCHES` microbatches, under the
  agent's software slowdown; what a step takes beyond its compute at full speed
  times the slowdown (data, the loop, and on an emulated device the throttle's
  own cost: a block that runs after a sleep takes more CPU, which the throttle
  stretches too) is fitted as ``step_s + M * microbatch_s`` over the medians;
- ``frame_s``: what one tensor frame costs its sender beyond the link's latency:
  encoding and decoding a small activation frame, plus the publish call of a QoS 1
  message on the device's own connection (``details["publish_ms"]``): the broker
  probe's (:func:`~edge.profiling.device.measure_broker_link`), or, for an agent,
  its own transport's, timed once connected (:func:`time_publish`,
  :func:`with_publish_cost`; TLS and the client's network thread are in it). The
  latency itself stays the link's ``latency_ms``. Every step's report is one
  such publish too;
- ``byte_s``: what each byte of a large tensor costs the device's CPU on its way
  through the transport, sender and receiver sides together: encoding a 4 MiB
  frame, its bytes through a local socket pair (the kernel's copies each way),
  decoding it and adding it into a sum, as a group's gradient sum does. On a slow
  device that is not small beside its link: an emulated Pi at 0.16 of a core
  moved a group's gradients at a quarter of its link's rate. Neither TLS nor the
  client library's own copies are in it, so it is a lower bound. An agent
  replaces it, once connected, by the same bytes through its own transport
  (:func:`measure_transport_byte_s`, :func:`with_transport_byte_cost`): frames of
  a group sum's largest piece (a large sum's; a sum of chunks up to 2 MiB goes in
  smaller pieces, which cost more a byte: [Note: pieces of a chunk] in
  :mod:`edge.runtime.group_sum`) published to itself through the broker on its
  private topic (:func:`~edge.wire.topics.device_probe`), filed in an inbox and
  taken and added from there, a vector flattened before and copied back after, as
  the sum does; the CPU time of the whole process (TLS, the client's network
  thread and copies included; the link's time excluded, which the link's own
  terms price) over the bytes, over the share of a core it runs with (a CPU
  quota's: [Note: the transport probe's share of a core]);
  ``details["transport_byte_ms_per_mib"]`` says it was measured so.

:func:`fixed_costs_of` reads them back from a device; ``None`` for a device
that did not measure them (a catalogue entry, a problem file).

Tested in tests/unit/edge/profiling/test_transport_byte_cost.py and
tests/integration/test_agent_fixed_costs.py (the costs real agents announce).
"""

from __future__ import annotations

import socket
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch

from edge.errors import UserError
from edge.problem import DeviceSpec
from edge.runtime.group_sum import PIECE_BYTES
from edge.runtime.stage import StageRuntime
from edge.transport.inbox import Expected, Inbox
from edge.transport.inprocess import InProcessTransport
from edge.wire.frames import Codec, Kind, decode_frame, encode_frame
from edge.wire.messages import StageAssignment

__all__ = [
    "PROBE_BLOCKS",
    "PROBE_MICROBATCHES",
    "TRANSPORT_PROBE_BYTES",
    "TRANSPORT_PROBE_ROUNDS",
    "FixedCosts",
    "Loopback",
    "cpu_quota_of",
    "fixed_costs_of",
    "measure_fixed_costs",
    "measure_transport_byte_s",
    "time_publish",
    "with_publish_cost",
    "with_transport_byte_cost",
]

PROBE_MICROBATCHES = 4
"""The probe's larger microbatch count (the smaller is 1)."""

PROBE_BLOCKS = 3
"""Compute blocks of each of the probe's microbatches (forward, loss, backward): the
throttle's cost is per block, and a stage without the loss runs two."""

_PROBE_MODEL: dict[str, Any] = {"model": "mlp", "model_options": {}}
"""A model whose compute is negligible (about 27k parameters): what the probe times is the
machinery around it. Its default options, because any other options are sized on the
``meta`` device (:func:`edge.models.zoo.model_size`), whose first forward in a process
costs more than a second of imports, which every agent would pay at start-up."""


@dataclass(frozen=True)
class FixedCosts:
    """Seconds one device spends per microbatch, per step and per frame, beyond compute."""

    microbatch_s: float
    step_s: float
    frame_s: float
    byte_s: float = 0.0
    """CPU seconds per byte of a tensor through the transport (both sides); 0 unmeasured."""

    def to_json(self) -> dict[str, float]:
        return asdict(self)


def fixed_costs_of(device: DeviceSpec) -> FixedCosts | None:
    """The fixed costs ``device`` announced (``details["fixed_costs"]``), if any."""
    got = (device.details or {}).get("fixed_costs")
    if not isinstance(got, dict):
        return None
    try:
        return FixedCosts(
            **{
                k: max(0.0, float(got[k] if k in got or k != "byte_s" else 0.0))
                for k in FixedCosts.__annotations__
            }
        )
    except (KeyError, TypeError, ValueError):
        return None


def _probe_stage(microbatches: int, steps: int, slowdown: float) -> StageRuntime:
    """The one-stage tiny job the probe times."""
    assignment = StageAssignment(
        **_PROBE_MODEL,
        job="fixed-costs",
        stage=0,
        num_stages=1,
        start=0,
        end=2,
        dataset="digits",
        steps=steps,
        batch_size=PROBE_MICROBATCHES,
        microbatches=microbatches,
    )
    return StageRuntime(assignment, InProcessTransport(), slowdown=slowdown)


def prepare_fixed_costs() -> None:
    """Build the probe's stage once, untimed, so that what only its first build does is
    done: loading the dataset, and torch's compiler front end, which torch imports at
    a process's first optimizer (1.3 CPU-seconds here, more than the timing itself).
    Agents that share a machine call it before they take turns to measure (``edgetrain
    agent --measure-lock``), so that they load side by side and hold the lock only to
    time."""
    _probe_stage(1, 3, 1.0)


def _probe(microbatches: int, steps: int, slowdown: float) -> tuple[float, float]:
    """The least ``step_s`` and ``compute_s`` of a one-stage tiny job with ``microbatches``
    over ``steps`` steps (after two to warm up).

    Least, not median: agents starting beside each other measure while the others load
    torch, and a throttled probe (it sleeps between blocks) pays every such busy moment
    in full; the least is the cost of the machinery itself, as a device's best matmul
    rate is its speed."""
    stage = _probe_stage(microbatches, steps, slowdown)
    reports = [stage.run_step(step) for step in range(steps)][2:]  # the first warm up
    return (
        min(r.step_s for r in reports),
        min(r.compute_s for r in reports),
    )


def _stage_overhead(microbatches: int, steps: int, slowdown: float) -> float:
    """What a step of the tiny job costs beyond its compute stretched by ``slowdown``."""
    step, compute = _probe(microbatches, steps, slowdown)
    if slowdown > 1:  # the throttle's own cost: a block run after a sleep takes more CPU
        compute = _probe(microbatches, steps, 1.0)[1] * slowdown
    return step - compute


def _frame_codec_s(rounds: int = 50) -> float:
    """Median seconds to encode and decode one small activation frame."""
    tensor = torch.randn(8, 64)
    times = []
    for i in range(rounds):
        t0 = time.perf_counter()
        decode_frame(encode_frame(Kind.ACTIVATION, "fixed-costs", i, 0, tensor, Codec.FP32))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


BYTE_PROBE = 4 << 20
"""Bytes of the tensor the per-byte probe moves."""


def _byte_cost(rounds: int = 3) -> float:
    """Median CPU seconds per byte: encode, a socket pair both ways, decode, add."""
    tensor = torch.randn(BYTE_PROBE // 4)
    total = torch.zeros_like(tensor)
    times = []
    for i in range(rounds):
        left, right = socket.socketpair()
        try:
            t0 = time.perf_counter()
            frame = encode_frame(Kind.REDUCE, "fixed-costs", i, 0, tensor, Codec.RAW)
            sender = threading.Thread(target=left.sendall, args=(frame,))
            sender.start()
            got = bytearray(len(frame))
            view, at = memoryview(got), 0
            while at < len(got):
                at += right.recv_into(view[at:])
            sender.join()
            total += decode_frame(got).tensor
            times.append(time.perf_counter() - t0)
        finally:
            left.close()
            right.close()
    return statistics.median(times) / BYTE_PROBE


def measure_fixed_costs(
    *, steps: int = 12, slowdown: float = 1.0, publish_ms: float | None = None
) -> FixedCosts:
    """Measure this device's fixed costs (see the module docstring); about a second.

    ``slowdown`` is the agent's software throttle (it stretches compute, which the
    fit leaves out); ``publish_ms`` the broker probe's publish call, when measured.
    """
    if steps < 3:
        raise ValueError(f"steps must be at least 3 (got {steps})")
    one = _stage_overhead(1, steps, slowdown)
    many = _stage_overhead(PROBE_MICROBATCHES, steps, slowdown)
    per_microbatch = max(0.0, (many - one) / (PROBE_MICROBATCHES - 1))
    frame = _frame_codec_s() + (publish_ms or 0.0) / 1e3
    return FixedCosts(
        microbatch_s=per_microbatch,
        step_s=max(0.0, one - per_microbatch),
        frame_s=frame,
        byte_s=_byte_cost(),
    )


def time_publish(publish: Callable[[], None], rounds: int = 10) -> float:
    """Median seconds of ``rounds`` calls of ``publish`` (one small QoS 1 message)."""
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        publish()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def with_publish_cost(device: DeviceSpec, seconds: float) -> DeviceSpec:
    """``device`` with one publish call of ``seconds`` added to its frame cost, unless its
    profile already counts one (``details["publish_ms"]``) or measured no fixed costs."""
    fixed, details = fixed_costs_of(device), dict(device.details or {})
    if fixed is None or details.get("publish_ms"):
        return device
    frame = fixed.frame_s + seconds
    details["fixed_costs"] = FixedCosts(
        fixed.microbatch_s, fixed.step_s, frame, fixed.byte_s
    ).to_json()
    details["publish_ms"] = seconds * 1e3
    return device.model_copy(update={"details": details})


TRANSPORT_PROBE_BYTES = 2 << 20
"""Bytes of frames an agent sends itself through the broker in one round of timing its
transport."""

TRANSPORT_PROBE_ROUNDS = 3
"""Rounds of :data:`TRANSPORT_PROBE_BYTES` the transport probe times (after one to warm up)."""

_PROBE_JOB = "fixed-costs"
"""The job id the probes' frames name (no job runs under it)."""


class Loopback(Protocol):
    """What the transport probe needs of a connection: an
    :class:`~edge.transport.mqtt.MqttTransport` has it."""

    def publish(
        self, topic: str, payload: bytes | str, qos: int = 1, retain: bool = False
    ) -> None: ...

    def subscribe(
        self, topic: str, callback: Callable[[str, bytes], None], qos: int = 1
    ) -> None: ...

    def unsubscribe(self, topic: str) -> None: ...


def measure_transport_byte_s(
    transport: Loopback,
    topic: str,
    *,
    total_bytes: int = TRANSPORT_PROBE_BYTES,
    piece_bytes: int = PIECE_BYTES,
    rounds: int = TRANSPORT_PROBE_ROUNDS,
    timeout_s: float = 30.0,
    cpu_share: float = 1.0,
    cpu_clock: Callable[[], float] = time.process_time,
) -> float:
    """Seconds per byte a tensor costs this device through ``transport``, both sides: frames
    of ``piece_bytes`` (``total_bytes`` in all, at least one) published to ``topic``, which
    ``transport`` subscribes to, each filed in an inbox as a group's chunk from a peer,
    taken and added into a sum (a vector flattened before, copied back after: what a
    group's sum does with each byte); ``cpu_clock``'s seconds from the first publish
    until the last frame is added, over the bytes sent, over ``cpu_share`` (the cores a
    CPU quota leaves this process: [Note: the transport probe's share of a core]). One
    round warms up (buffers, the first frames' page faults); the cost is the median of
    the next ``rounds``. Frames that are not all back within ``timeout_s`` of a round's
    start (no broker, or one that refuses the topic) raise a one-line :class:`UserError`.

    [Note: the transport probe's share of a core]
    CPU time, which a quota does not change, over the share of a core the device
    will run with, given, not measured: on the testbed a quota is written only once
    the agent is online ([Note: agents start unthrottled] in
    :mod:`coordinator.testbed.testbed`), after this probe, so what the probe sees of
    its share is not what the sum gets: a busy loop read 0.17-0.37 of a core under a
    quota of 0.117, and the wall clock, under one of 0.114, 24-29 ns a byte where the
    sum paid 46. Measured on ``bench/hybrid.py``'s four agents at 0.11-0.13 of a
    core, data parallel, vgg11 and resnet18: a sum's transfer (less the wait for the
    last member's start) took 0.99-1.06 times its process's CPU over the quota, and
    that CPU was 5.1-7.5 ns per byte moved (over half of what it sent and received;
    more on a busier host); this probe read 5.7-7.1 ns a byte on the same agents.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1 (got {rounds})")
    if not cpu_share > 0:
        raise ValueError(f"cpu_share must be positive (got {cpu_share})")
    pieces = max(1, total_bytes // piece_bytes)
    piece = max(1, piece_bytes // 4)
    chunk = piece * pieces
    ranges = tuple((lo, lo + piece) for lo in range(0, chunk, piece))
    grad = torch.randn(chunk)
    # The frames come back into an inbox that expects them as a group's sum's chunk from
    # member 1, and are taken and added from there, as the sum takes its peers' pieces.
    inbox = Inbox(_PROBE_JOB, 0, 0)
    expected = Expected((chunk,), frozenset({torch.float32}), ranges)
    inbox.expect({Kind.REDUCE: expected}, microbatches=1, step=0, members=2)

    def on_frame(_topic: str, payload: bytes) -> None:
        inbox.deliver(payload, "reduce", 1)

    transport.subscribe(topic, on_frame, qos=1)
    times = []
    try:
        for r in range(rounds + 1):
            inbox.forget_before(r)
            t0, sent = cpu_clock(), 0
            vector = torch.zeros(chunk)  # flattened, sent, summed, copied back: as the sum
            torch.cat([grad], out=vector)
            for lo, hi in ranges:
                frame = encode_frame(
                    Kind.REDUCE, _PROBE_JOB, r, 1, vector[lo:hi], Codec.RAW, first=lo
                )
                transport.publish(topic, frame, qos=1)
                sent += len(frame)
            mine = torch.zeros(chunk)
            mine += vector
            for n, (lo, hi) in enumerate(ranges):
                try:
                    mine[lo:hi] += inbox.take(Kind.REDUCE, r, 1, timeout_s, first=lo).tensor
                except TimeoutError:
                    raise UserError(
                        f"transport probe: {n} of {pieces} frames came back on {topic} "
                        f"within {timeout_s:g} s (is the broker there, and does it allow "
                        "the topic?)"
                    ) from None
            grad.copy_(mine)
            elapsed = cpu_clock() - t0
            if r > 0:  # the first round warms up
                times.append(elapsed / sent)
    finally:
        transport.unsubscribe(topic)
        inbox.close()
    return statistics.median(times) / cpu_share


def cpu_quota_of(device: DeviceSpec) -> float | None:
    """The share of a core a CPU quota will hold ``device`` to, as its profile announces
    (``details["cpu_quota"]``: a testbed's emulated device, whose quota is written once its
    agent is online); ``None`` when it announces none, or not a positive number."""
    got = (device.details or {}).get("cpu_quota")
    if isinstance(got, bool) or not isinstance(got, (int, float)) or not got > 0:
        return None
    return float(got)


def with_transport_byte_cost(device: DeviceSpec, seconds: float) -> DeviceSpec:
    """``device`` with its per-byte cost ``seconds`` as measured through its own transport
    (:func:`measure_transport_byte_s`); unchanged for a device that measured no fixed costs."""
    fixed, details = fixed_costs_of(device), dict(device.details or {})
    if fixed is None:
        return device
    details["fixed_costs"] = FixedCosts(
        fixed.microbatch_s, fixed.step_s, fixed.frame_s, seconds
    ).to_json()
    details["transport_byte_ms_per_mib"] = seconds * (1 << 20) * 1e3
    return device.model_copy(update={"details": details})
