"""Pipeline schedules as plain data: per stage, the ordered forward and backward actions.

A schedule for ``S`` stages and ``M`` microbatches is a list of ``S`` lists of
:class:`Action`; stage ``s`` executes its list in order, one action at a time,
each action waiting for its input (see :mod:`coordinator.planner.simulator`).
Its text form is one line per stage, actions separated by spaces::

    F0 F1 B0 F2 B1 F3 B2 B3
    F0 B0 F1 B1 F2 B2 F3 B3

This module owns only the order. The simulator reads it to predict a step, the
stage runtime will read it to run one, and neither may add an action of its own:
an action the schedule does not list does not happen.

Every schedule here is synchronous: every stage steps its optimizer after its
last backward (the flush), so a step equals single-device training.

[Note: zero bubble]
A schedule may split each backward in two ([Note: where the graph is cut] in
:mod:`edge.runtime.split_backward`): ``B`` computes only the gradient of the stage's
input, which the stage before is waiting for, and ``W`` the weights' gradients, which
nobody waits for. A split schedule lists a ``W`` for every microbatch on every stage,
after its ``B``; a schedule without ``W`` runs each backward whole at its ``B``. The
zero-bubble schedule ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024)
is 1F1B with the backward split, and stage ``s`` putting off its first ``s`` weight
passes: its ``W`` of microbatch ``i`` runs right after its ``B`` of microbatch
``i + s``, and the last ``s`` run at the end. Every stage holds at most ``min(S, M)``
microbatches (from a forward to its ``W``): what stage 0 holds under 1F1B, but on
every stage, so the later stages need more memory than under 1F1B (the job's
memory check simulates the schedule it runs). The last stages, which 1F1B leaves
idle while the gradients travel back up, spend that time on the weight passes they
put off. On ``S`` equal stages whose ``F``, ``B`` and ``W`` take equal times, with
free links and ``M >= S``, the step takes ``3 M + S - 1`` of them, against 1F1B's
``3 (M + S - 1)``: the bubble is a third of 1F1B's.

Tested in tests/unit/coordinator/planner/test_simulator.py::test_one_f_one_b_text_form,
::test_schedules_round_trip_and_are_complete and ::test_malformed_schedules_are_refused;
a stage running each in tests/unit/edge/runtime/test_schedule_run.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "SCHEDULES",
    "Action",
    "Schedule",
    "format_schedule",
    "gpipe",
    "is_split",
    "make_schedule",
    "one_f_one_b",
    "parse_schedule",
    "splits_backward",
    "validate_schedule",
    "zb_h1",
]

Kind = Literal["F", "B", "W"]
_TOKEN = re.compile(r"([FBW])(\d+)")


@dataclass(frozen=True)
class Action:
    """One forward (``F``), backward (``B``) or weight pass (``W``, [Note: zero bubble])
    of one microbatch on one stage."""

    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, token: str) -> Action:
        """``"F3"`` -> ``Action("F", 3)``."""
        match = _TOKEN.fullmatch(token.strip())
        if match is None:
            raise ValueError(f"not an action: {token!r} (expected F<n>, B<n> or W<n>)")
        kind: Kind = "F" if match[1] == "F" else "B" if match[1] == "B" else "W"
        return cls(kind, int(match[2]))


Schedule = list[list[Action]]
"""Per stage, its actions in execution order."""


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """PipeDream-Flush (1F1B): stage ``s`` runs ``w = min(S - s, M)`` forwards, then
    alternates one backward and one forward, then drains the remaining backwards.

    At most ``w`` microbatches' activations are held at once on stage ``s``: the
    spec's ``min(S - s, M)`` memory factor.
    """
    _check_sizes(num_stages, num_microbatches)
    out = []
    for s in range(num_stages):
        warmup = min(num_stages - s, num_microbatches)
        actions = [Action("F", i) for i in range(warmup)]
        for i in range(num_microbatches - warmup):
            actions += [Action("B", i), Action("F", warmup + i)]
        actions += [Action("B", i) for i in range(num_microbatches - warmup, num_microbatches)]
        out.append(actions)
    return out


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: every stage runs all ``M`` forwards, then all ``M`` backwards.

    Backwards run in forward order ``B0 B1 ...``, as ``torch.distributed.pipelining``'s
    ``ScheduleGPipe`` does; every stage holds all ``M`` microbatches' activations
    at its peak.
    """
    _check_sizes(num_stages, num_microbatches)
    one = [Action("F", i) for i in range(num_microbatches)]
    one += [Action("B", i) for i in range(num_microbatches)]
    return [list(one) for _ in range(num_stages)]


def zb_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1 ([Note: zero bubble]): 1F1B's forwards and input backwards, stage ``s``
    putting its weight passes ``s`` backwards behind."""
    _check_sizes(num_stages, num_microbatches)
    out = []
    for s, row in enumerate(one_f_one_b(num_stages, num_microbatches)):
        actions: list[Action] = []
        for a in row:
            actions.append(a)
            if a.kind == "B" and a.microbatch >= s:
                actions.append(Action("W", a.microbatch - s))
        start = max(0, num_microbatches - s)
        actions += [Action("W", i) for i in range(start, num_microbatches)]
        out.append(actions)
    return out


def is_split(actions: Sequence[Action]) -> bool:
    """Whether a stage's row splits its backwards ([Note: zero bubble]): it has a ``W``."""
    return any(a.kind == "W" for a in actions)


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {
    "1f1b": one_f_one_b,
    "gpipe": gpipe,
    "zb-h1": zb_h1,
}
"""Schedules by the name a job file uses."""


def splits_backward(name: str) -> bool:
    """Whether schedule ``name`` splits backwards into ``B`` and ``W`` (on two stages,
    two microbatches: where any of the schedules here that splits, does)."""
    return any(is_split(row) for row in make_schedule(name, 2, 2))


def make_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """The schedule called ``name`` (a key of :data:`SCHEDULES`)."""
    try:
        build = SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r} (known: {', '.join(SCHEDULES)})") from None
    return build(num_stages, num_microbatches)


def format_schedule(schedule: Sequence[Sequence[Action]]) -> str:
    """One line per stage, e.g. ``"F0 F1 B0 B1\\nF0 B0 F1 B1"``."""
    return "\n".join(" ".join(str(a) for a in actions) for actions in schedule)


def parse_schedule(text: str) -> Schedule:
    """The inverse of :func:`format_schedule`; blank lines and ``#`` comments are skipped."""
    out = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append([Action.parse(token) for token in line.split()])
    return out


def validate_schedule(
    schedule: Sequence[Sequence[Action]], num_stages: int, num_microbatches: int
) -> None:
    """Raise ``ValueError`` unless every stage runs each microbatch's ``F`` and ``B``
    exactly once, and either no ``W`` or each microbatch's ``W`` once, after its ``B``.
    Any other order is not checked here: a bad order is a deadlock, which only running
    (or simulating) the schedule finds."""
    if len(schedule) != num_stages:
        raise ValueError(f"schedule has {len(schedule)} stages, the plan {num_stages}")
    kinds = "BFW" if any(is_split(actions) for actions in schedule) else "BF"
    want = sorted((kind, i) for kind in kinds for i in range(num_microbatches))
    for s, actions in enumerate(schedule):
        have = sorted((a.kind, a.microbatch) for a in actions)
        if have != want:
            missing = sorted(set(want) - set(have))
            extra = [x for x in have if have.count(x) > 1 or x not in want]
            detail = f"missing {_names(missing)}" if missing else f"extra {_names(extra)}"
            raise ValueError(
                f"stage {s}: must run {'F, B and W' if kinds == 'BFW' else 'F and B'} of "
                f"microbatches 0..{num_microbatches - 1} exactly once each; {detail}"
            )
        done = {(a.kind, a.microbatch): i for i, a in enumerate(actions)}
        late = [
            i for i in range(num_microbatches) if kinds == "BFW" and done["W", i] < done["B", i]
        ]
        if late:
            raise ValueError(f"stage {s}: W{late[0]} runs before B{late[0]}")


def _names(items: Sequence[tuple[str, int]]) -> str:
    return " ".join(f"{k}{i}" for k, i in sorted(set(items), key=lambda x: (x[1], x[0])))


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(
            f"need at least one stage and one microbatch, got {num_stages} and {num_microbatches}"
        )
