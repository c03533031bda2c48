"""What a stage ran in a step, and what the simulator draws for the same plan.

Two records of what a stage ran, kept apart on purpose:

- the stage's own :class:`~edge.wire.messages.StepReport` (``actions``, ``peak_held``);
- the order of its sends and takes, recorded where frames enter the in-process
  transport and leave an inbox (:class:`WireLog`), and turned into actions: on
  stage ``s`` a forward of microbatch ``m`` takes activation ``m`` (``s > 0``) and sends
  activation ``m`` (``s`` not last); a backward takes gradient ``m`` (``s`` not last) and
  sends gradient ``m`` (``s > 0``).

:func:`drawn` gives the simulator's side (:func:`coordinator.planner.simulator.simulate`):
per stage, its actions in the order it starts them, and the most microbatches it
holds at once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest

from coordinator.planner.score import Plan
from coordinator.planner.simulator import simulate
from edge.problem import PlanningProblem
from edge.transport.base import Channel
from edge.transport.inbox import Inbox
from edge.transport.inprocess import InProcessTransport
from edge.wire.frames import Frame, Kind, read_header

__all__ = ["WireLog", "drawn", "record_wire"]

_ACTION = {Kind.ACTIVATION: "F", Kind.GRADIENT: "B"}


def drawn(problem: PlanningProblem, plan: Plan, schedule: str) -> tuple[list[str], list[int]]:
    """Per stage of ``plan``, the simulated step's actions in order (a schedule row,
    ``"F0 F1 B0 B1"``), and the most microbatches it holds at once."""
    sim = simulate(problem, plan, schedule)
    rows = [
        " ".join(
            f"{e.kind}{e.microbatch}" for e in sim.timeline if e.lane == "stage" and e.index == s
        )
        for s in range(len(plan.stages))
    ]
    return rows, list(sim.peak_microbatches_held)


def framed(row: str) -> str:
    """A schedule row as a stage's frames can tell it: without its weight passes (``W``),
    which neither send nor take a frame."""
    return " ".join(token for token in row.split() if not token.startswith("W"))


@dataclass
class WireLog:
    """Every activation and gradient a stage sent or took, in the order it did."""

    events: list[tuple[int, int, str, int]] = field(default_factory=list)
    """``(stage, step, action, microbatch)``: one per frame sent or taken."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, stage: int, step: int, kind: Kind, microbatch: int) -> None:
        if kind in _ACTION:
            with self.lock:
                self.events.append((stage, step, _ACTION[kind], microbatch))

    def actions(self, stage: int, step: int) -> str:
        """The actions ``stage`` ran in ``step``, as its frames tell them: a schedule row."""
        out: list[str] = []
        for s, t, action, mb in self.events:
            token = f"{action}{mb}"
            if (s, t) == (stage, step) and (not out or out[-1] != token):
                out.append(token)  # a middle stage's take and send are one action
        return " ".join(out)


@contextmanager
def record_wire(monkeypatch: pytest.MonkeyPatch) -> Iterator[WireLog]:
    """Record, for every in-process stage, the frames it sends and takes, as it does.

    The transport and the inbox still do all their own work; the log only watches.
    A frame is the sender's: an activation sent to stage ``d`` comes from ``d - 1``,
    a gradient from ``d + 1``.
    """
    log = WireLog()
    send, take = InProcessTransport.send, Inbox.take

    def sending(
        self: InProcessTransport,
        job: str,
        stage: int,
        channel: Channel,
        frame: bytes,
        member: int = 0,
        *,
        sender: int | None = None,
    ) -> None:
        head = read_header(frame)
        source = stage - 1 if head.kind is Kind.ACTIVATION else stage + 1
        log.add(source, head.step, head.kind, head.microbatch)
        send(self, job, stage, channel, frame, member, sender=sender)

    def taking(
        self: Inbox, kind: Kind, step: int, mb: int, timeout: float | None = None, *, first: int = 0
    ) -> Frame:
        frame = take(self, kind, step, mb, timeout, first=first)
        log.add(self.stage, step, kind, mb)
        return frame

    monkeypatch.setattr(InProcessTransport, "send", sending)
    monkeypatch.setattr(Inbox, "take", taking)
    yield log
