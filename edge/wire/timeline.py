"""A step's waits and sends as a step report carries them: when each began and ended.

A stage's step report (:class:`~edge.wire.messages.StepReport`) says what its step cost
in totals; its ``timeline`` says when, so that the coordinator can tell, across
stages, a wait for a neighbour still computing from one for a tensor on the wire
(:mod:`coordinator.planner.anatomy`). It is text, like the report's ``actions``, one
entry per blocking wait or send, separated by spaces::

    wA3@12.345+0.678    waited for microbatch 3's activation from 12.345 ms after the
                        step started, for 0.678 ms
    sG3@13.100+0.050    sent microbatch 3's input gradient (encoding and publishing)

``w`` is a wait, ``s`` a send; ``A``, ``G`` and ``L`` are activations, gradients and
labels. Offsets and durations are milliseconds from the report's ``started_at``, to
the microsecond, each at most nine digits before the point (11 days) and the
microbatch at most four (the job's at most 1024): whatever a device writes parses
to finite numbers. A group member's entry covers the whole block it took or sent, all
of its pieces.

Tested in tests/unit/edge/wire/test_timeline.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

__all__ = ["TIMELINE_PATTERN", "Interval", "Op", "What", "format_timeline", "parse_timeline"]

_ONE = r"[ws][AGL]\d{1,4}@\d{1,9}(\.\d{1,3})?\+\d{1,9}(\.\d{1,3})?"
TIMELINE_PATTERN = rf"^({_ONE}( {_ONE})*)?$"
"""What a step report's ``timeline`` may hold (empty: an agent that does not say)."""

_ENTRY = re.compile(r"([ws])([AGL])(\d+)@(\d+(?:\.\d+)?)\+(\d+(?:\.\d+)?)")  # within _ONE

Op = Literal["w", "s"]
What = Literal["A", "G", "L"]


@dataclass(frozen=True)
class Interval:
    """One blocking wait or send of a step; times in seconds from the step's start."""

    op: Op
    what: What
    microbatch: int
    start_s: float
    end_s: float

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s


def format_timeline(intervals: list[Interval]) -> str:
    """``intervals`` as a report's ``timeline`` text."""
    return " ".join(
        f"{i.op}{i.what}{i.microbatch}@{i.start_s * 1e3:.3f}+{max(0.0, i.seconds) * 1e3:.3f}"
        for i in intervals
    )


def parse_timeline(text: str) -> list[Interval]:
    """The intervals of a report's ``timeline`` (``ValueError`` for text it cannot hold)."""
    if not re.fullmatch(TIMELINE_PATTERN, text):
        raise ValueError(f"not a step timeline: {text[:80]!r}")
    out = []
    for op, what, mb, start, took in _ENTRY.findall(text):
        begin = float(start) / 1e3
        out.append(Interval(op, what, int(mb), begin, begin + float(took) / 1e3))
    return out
