"""The clock of one step of a stage: what it waited and sent, in totals and as a timeline.

A stage's step (:meth:`edge.runtime.stage.StageRuntime.run_step`) times each blocking
wait for a tensor and each send of one through :class:`StepClock`, which sums them
for the report's ``wait_s`` and ``send_s`` and keeps when each began and ended for its
``timeline`` (:mod:`edge.wire.timeline`), from the step's start, ``started_at``.

Tested in tests/unit/edge/wire/test_timeline.py and, in a running pipeline,
tests/integration/test_step_anatomy.py.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from edge.wire.timeline import Interval, Op, What, format_timeline

__all__ = ["StepClock"]


class StepClock:
    """Started with the step: its Unix start, and its waits and sends as they happen."""

    def __init__(self) -> None:
        self.started_at = time.time()
        self._t0 = time.perf_counter()
        self.wait_s = 0.0
        self.send_s = 0.0
        self._intervals: list[Interval] = []

    def elapsed(self) -> float:
        """Seconds since the step started."""
        return time.perf_counter() - self._t0

    @contextlib.contextmanager
    def waiting(self, what: What, microbatch: int) -> Iterator[None]:
        """Time the body as a wait for microbatch ``microbatch``'s ``what``."""
        with self._timed("w", what, microbatch):
            yield

    @contextlib.contextmanager
    def sending(self, what: What, microbatch: int) -> Iterator[None]:
        """Time the body as the send of microbatch ``microbatch``'s ``what``."""
        with self._timed("s", what, microbatch):
            yield

    def timeline(self) -> str:
        """The waits and sends so far, as a report's ``timeline``."""
        return format_timeline(self._intervals)

    @contextlib.contextmanager
    def _timed(self, op: Op, what: What, microbatch: int) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            if op == "w":
                self.wait_s += end - start
            else:
                self.send_s += end - start
            begin = start - self._t0
            self._intervals.append(Interval(op, what, microbatch, begin, begin + end - start))
