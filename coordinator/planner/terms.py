"""The spec's cost terms, each written once (``shared/spec/planning.md``, ``planning-v2.md``).

Every figure of the score that more than one module computes is a function here:
a stage's compute time ``T_s`` (and a member's busy seconds), a link's time
``C_s``, a group's all-reduce ``R_s``, a member's 1F1B memory, and the figures a
group shows its links (its speed, its slowest latency, its least bandwidth per
share). :func:`coordinator.planner.score.score_plan` calls them on Python floats,
one stage or link at a time; the search's tables
(:mod:`coordinator.planner.tables`, :mod:`coordinator.planner.group_tables`) call
them on numpy arrays, every range and device pair at once; the lower bound
(:mod:`coordinator.planner.bounds`) and the simulator's memory peaks call them too.

[Note: one formula, two kinds of number]
A search may call a plan feasible only if the score does, and its tables' times
must be the score's, so both must get the same bits. They do when they run the
same function: numpy computes each element of ``a * x / (g * 1e9)`` with the same
IEEE-754 double operations, in the same order, that Python does for one float,
whatever the arrays' shapes. So the order of operations in each body below is
part of the contract (``2 * b * out * 8`` is ``((2 * b) * out) * 8``, not
``16 * b * out``), and a caller passes operands, never a partly computed term.
``tests/unit/coordinator/planner/test_terms.py`` compares the score's values with
the tables' entries with ``==`` over random problems and the edge cases (zero
latency, nothing crossing a cut, a link between identical devices).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypeVar

import numpy as np

from edge.problem import DeviceSpec

__all__ = [
    "Figures",
    "allreduce_s",
    "compute_s",
    "group_bandwidth_mbps",
    "group_gflops",
    "group_latency_ms",
    "link_s",
    "need_bytes",
    "ordered_sum",
]

Figures = TypeVar("Figures", float, np.ndarray)
"""One figure (a Python float, in the score) or an array of them (in the tables)."""


def ordered_sum(values: Iterable[float]) -> float:
    """Left-to-right float sum: what :func:`coordinator.planner.tables.range_sums`
    reproduces exactly.

    ``sum()`` is not used: Python 3.12's compensates rounding, and the search's
    feasibility must agree with the score to the last bit on every version.
    """
    total = 0.0
    for v in values:
        total += v
    return total


def compute_s(samples: float, flops: Figures, gflops: float | Figures) -> Figures:
    """Seconds that ``samples`` samples of ``flops`` FLOPs each take at ``gflops`` GFLOP/s.

    ``T_s`` with ``samples = b`` and the stage's speed (a group's: :func:`group_gflops`);
    a member's busy seconds per step, for the energy, with ``samples = M * w_i * b``
    and its own speed."""
    return samples * flops / (gflops * 1e9)


def link_s(
    b: float,
    out_bytes: Figures,
    send_ms: float | Figures,
    recv_ms: float | Figures,
    send_mbps: float | Figures,
    recv_mbps: float | Figures,
) -> Figures:
    """``C_s``: a microbatch's activation forward and its gradient back, each paying both
    latencies, at the slower end's bandwidth.

    ``out_bytes`` per sample crosses the cut; ``send_*`` and ``recv_*`` are the two ends'
    latency (ms) and bandwidth (Mbit/s): a device's own, or a group's
    (:func:`group_latency_ms`, :func:`group_bandwidth_mbps`)."""
    slower = _least(send_mbps, recv_mbps)
    return 2 * (send_ms + recv_ms) / 1000 + 2 * b * out_bytes * 8 / (slower * 1e6)


def allreduce_s(group: Sequence[DeviceSpec], param_bytes: Figures) -> Figures:
    """``R_s``: the ring all-reduce of ``param_bytes`` of gradients over ``group`` once
    per step, at its slowest latency and least bandwidth; 0 for one device."""
    g = len(group)
    if g == 1:
        return np.zeros_like(param_bytes) if isinstance(param_bytes, np.ndarray) else 0.0
    latency = max(d.latency_ms for d in group)
    slowest = min(d.bandwidth_mbps for d in group)
    return 2 * (g - 1) * latency / 1000 + 2 * (g - 1) / g * param_bytes * 8 / (slowest * 1e6)


def need_bytes(
    k: float, params: Figures, depth: int, share: float, b: float, acts: Figures
) -> Figures:
    """The 1F1B memory of a member with ``share`` of each microbatch (1 alone) holding a
    stage of ``params`` parameter bytes and ``acts`` saved bytes per sample, with
    ``depth`` microbatches in flight (``min(S - s, M)``; a simulated peak)."""
    return k * params + depth * share * b * acts


def group_gflops(group: Sequence[DeviceSpec]) -> float:
    """A group's speed: its members' GFLOP/s summed, left to right."""
    return ordered_sum(d.gflops for d in group)


def group_latency_ms(group: Sequence[DeviceSpec]) -> float:
    """A group's link latency: its slowest member's, in milliseconds."""
    return max(d.latency_ms for d in group)


def group_bandwidth_mbps(group: Sequence[DeviceSpec], shares: Sequence[float]) -> float:
    """A group's link bandwidth for a whole microbatch, Mbit/s: the least ``bw_i / w_i``
    (the member that takes longest to send its share); one device: its own bandwidth."""
    return min(d.bandwidth_mbps / w for d, w in zip(group, shares, strict=True))


def _least(a: float | Figures, b: float | Figures) -> float | Figures:
    """The smaller of two figures, element by element for arrays (exactly one of them)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.minimum(a, b)
    return min(a, b)
