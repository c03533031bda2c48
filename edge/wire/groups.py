"""The wire contract of a stage trained data-parallel by a group of devices.

A stage may run on a group of ``g`` devices (its *members*, in plan order; a
one-device stage is a group of one). Each member runs the stage's whole segment
on its own block of every microbatch, and once per step the group combines its
gradients, so a step equals single-device training on the whole batch.

[Note: groups on the wire]
- **Samples.** A microbatch of ``n`` samples is split by the members' shares
  (their speed, :func:`coordinator.planner.score.shares_of`) into sample counts
  that add up to ``n``: :func:`split_samples`, largest remainder, the only
  rounding used anywhere. Member ``i`` of a stage holds the contiguous block
  ``[lo_i, hi_i)`` (:func:`blocks`), in member order; every member gets at
  least one sample.
- **Frames.** Every frame carries the rows ``[lo, hi)`` of its microbatch it
  holds (the ``samples`` of :func:`edge.wire.frames.encode_frame`); a whole
  tensor carries ``[0, rows)``. Member ``i`` of stage ``s`` sends member ``j``
  of stage ``s + 1`` the rows in both their blocks, the intersection
  (:func:`overlap`), as one activation frame; the gradient of those rows comes
  back the same way. Stage 0's member ``i`` sends the last stage's member ``j``
  the labels of the rows in both their blocks (unless the labels stay home:
  [Note: labels stay home] in :mod:`edge.runtime.stage`). A receiver gathers the pieces
  covering its block in order (:func:`pieces`) and concatenates them; its inbox
  keeps only the pieces its plan implies, each of its own range's shape.
- **Loss.** Member ``i`` of the last stage scales its microbatch loss (the mean
  over its own samples, divided by the microbatches ``M``) by ``n_i / n``, so
  the members' losses, and their gradients, add up to the whole microbatch's.
- **Gradients, once per step.** After its last backward each member flattens
  its gradients, in parameter order, followed on the last stage by its share
  of the step's loss, zero-pads the vector to ``g`` equal chunks
  (:func:`chunk_size`) and runs a reduce-scatter then an all-gather: member
  ``i`` sends chunk ``k`` to member ``k`` (a ``REDUCE`` frame on the
  transport's ``reduce`` channel of member ``k``), member ``k`` adds the ``g``
  contributions in member order and publishes the sum once for every other
  member (a ``GATHER`` frame on its ``gather`` channel, one topic the others all
  read, the broker fanning it out: [Note: the all-gather is one publish] in
  :mod:`edge.runtime.group_sum`). In both, the frame's ``microbatch`` field
  names the sending member, and so does the topic it travels on (member
  ``i``'s own, ``.../reduce/{i}`` or ``.../gather/{i}``): a receiver drops a
  chunk whose claim differs from its topic's (``wrong-sender``), and a
  ``REDUCE`` frame on ``gather`` or a ``GATHER`` frame on ``reduce``
  (``wrong-kind``), so a member cannot pass its chunk off as another's.
  A chunk travels in pieces of at most 256 KiB, each frame's
  rows its element range in the chunk (so a broker forwards one piece while the
  next is on its way: [Note: pieces of a chunk] in :mod:`edge.runtime.group_sum`).
  Every member then holds the same summed gradients (the whole batch's) and the
  whole step's loss, steps the same optimizer and keeps the same weights. Each
  member publishes ``g`` chunks per step, the vector's size, and receives
  ``2 (g - 1)``, ``2 (g - 1) / g`` of it (:func:`sum_traffic`). A vector of at
  most 64 KiB skips the reduce-scatter: each member publishes it whole, unpadded, as
  one ``GATHER`` frame, and adds all ``g`` in member order ([Note: a small sum goes
  whole] in :mod:`edge.runtime.group_sum`); no ``REDUCE`` frame is expected then. Each member's step
  report says when its sum started (``allreduce_started``) and the CPU it cost
  (``allreduce_cpu_s``): a sum waits for the last member to start
  (:func:`sum_waits`), and the rest of ``allreduce_s`` is the transfer.
  Over torch.distributed (:mod:`edge.transport.dist`) the same sum is one bucketed
  all-reduce over the members' process group instead
  (:meth:`edge.server.data_parallel.DataParallel.sum_gradients`), with no frames.
- **Topics and rights.** Member ``m`` of stage ``s`` receives on
  :func:`edge.wire.topics.stage_topic` ``(job, s, channel, m)`` and on every
  other member ``i``'s ``stage_topic(job, s, "gather", sender=i)``; the broker
  lets a member publish only to the members of its neighbour stages (and, as
  stage 0, to the last stage's), and, of its own stage's ``reduce`` and
  ``gather`` topics, to those naming it as sender (a ``reduce`` topic to each
  other member, its one ``gather`` topic) (:func:`edge.wire.topics.stage_access`):
  only member ``i`` may publish a chunk from ``i``.

Tested in tests/unit/edge/wire/test_group_contract.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = [
    "blocks",
    "chunk_size",
    "overlap",
    "pieces",
    "split_samples",
    "sum_traffic",
    "sum_waits",
]

Block = tuple[int, int]
"""Rows ``[lo, hi)`` of a microbatch."""


_TIE = 1e-9
"""Samples within this of a whole number count as that number (rounding errors)."""


def split_samples(n: int, shares: Sequence[float]) -> list[int]:
    """``n`` samples split by ``shares`` (largest remainder; ties to the earlier member).

    Raises ``ValueError`` if a member would get no sample, or for a bad share.
    """
    if not shares or any(not math.isfinite(s) or s <= 0 for s in shares):
        raise ValueError(f"shares must be positive numbers, got {list(shares)}")
    total = math.fsum(shares)
    exact = [n * s / total for s in shares]
    counts = [math.floor(x + _TIE) for x in exact]
    # Remainders within rounding of each other tie, and ties go to the earlier member:
    # the same counts from speeds as from those speeds over their sum (the planner checks
    # a group with the one, the runtime splits by the other).
    order = sorted(range(len(shares)), key=lambda i: (-round(exact[i] - counts[i], 9), i))
    for i in order[: n - sum(counts)]:
        counts[i] += 1
    if min(counts) < 1:
        raise ValueError(
            f"a microbatch of {n} samples split by shares "
            f"{[round(s / total, 3) for s in shares]} leaves a member without samples"
        )
    return counts


def blocks(counts: Sequence[int]) -> list[Block]:
    """The contiguous rows of each member, in member order."""
    out, lo = [], 0
    for c in counts:
        out.append((lo, lo + c))
        lo += c
    return out


def overlap(a: Block, b: Block) -> Block | None:
    """The rows in both ``a`` and ``b``, or ``None``."""
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def pieces(senders: Sequence[int], block: Block) -> list[tuple[int, Block]]:
    """``(member, rows)`` of every sender whose block meets ``block``, in row order.

    ``senders`` are the sending stage's sample counts; the receiver of ``block``
    takes these pieces and concatenates them.
    """
    out = []
    for member, theirs in enumerate(blocks(senders)):
        rows = overlap(theirs, block)
        if rows is not None:
            out.append((member, rows))
    return out


def chunk_size(numel: int, members: int) -> int:
    """Elements of each of the ``members`` equal chunks a flat gradient is padded to."""
    return max(1, -(-numel // members))


def sum_traffic(members: int) -> tuple[float, float]:
    """The fractions of the flat gradient vector one member of a group of ``members``
    publishes and receives in a step's sum: ``g - 1`` chunks out in the reduce-scatter
    and its summed chunk once in the all-gather (``g / g``), ``2 (g - 1)`` chunks in;
    ``(0, 0)`` for a group of one."""
    if members <= 1:
        return (0.0, 0.0)
    return (1.0, 2 * (members - 1) / members)


def sum_waits(started: Sequence[float]) -> list[float]:
    """Each member's wait, in a step's sum, for the last member to start its own: the
    latest of the members' start times (their reports' ``allreduce_started``, one clock)
    less its own. A member's ``allreduce_s`` less its wait is the transfer proper."""
    if not started:
        raise ValueError("sum_waits: no members' start times")
    last = max(started)
    return [last - t for t in started]
