"""Fault injection for users and tests: ``--fault kill:STAGE@STEP`` and friends.

A :class:`Fault` names what happens (``kill``: SIGKILL the agent; ``slow``: its
compute becomes FACTOR times slower, through the software throttle; ``join``: a new
agent with a catalogue profile starts), to which stage of the plan in force at the
time (so ``kill:1@3`` then ``kill:1@7`` kills whichever device runs stage 1 after
the first recovery; ``kill:1.2@3``, member 2 of stage 1's group), and when: as soon
as any stage reports step ``STEP`` done, so faults of the same step fire together
(``kill:1@5 kill:2@5`` kills two devices at once). :class:`FaultInjector` watches
step reports and fires each fault once, through a callback that does the deed
(``LocalFleet.kill`` sends SIGKILL to the agent's process), and records when it did,
for the job's events. A ``kill`` or ``slow`` fault naming a stage that the job's
first plan does not have would never fire: :func:`check_fault_stages` refuses it
once that plan is known, before anything runs.

In the coordinator service the deed is done by a :class:`FaultActuator`: a plain
coordinator has a :class:`ThrottleActuator`, which can slow any device (a
``Throttle`` command on its ``cmd`` topic) but neither kill nor start agents;
one that runs a testbed (``--testbed-state``) has
:class:`~coordinator.testbed.actuator.TestbedActuator`, which also kills the
testbed's agent processes and starts new ones.

A job names its faults as :data:`FaultText`: one of the forms above, bounded, checked
where the job's fields are (:class:`~coordinator.engine.spec.JobBase`).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Literal, Protocol

from pydantic import AfterValidator, Field

from edge.errors import UserError
from edge.wire.messages import StepReport, Throttle
from edge.wire.topics import device_cmd

if TYPE_CHECKING:
    from edge.transport.mqtt import MqttTransport

__all__ = [
    "Fault",
    "FaultActuator",
    "FaultInjector",
    "FaultText",
    "ThrottleActuator",
    "check_fault_stages",
    "parse_fault",
]

_FAULT = re.compile(r"^(kill|slow):(\d+)(?:\.(\d+))?@(\d+)(?::(\d+(?:\.\d+)?))?$")
_JOIN = re.compile(r"^join:([A-Za-z0-9][A-Za-z0-9._-]{0,63})@(\d+)$")
_FORMS = (
    "kill:STAGE[.MEMBER]@STEP, slow:STAGE[.MEMBER]@STEP:FACTOR or join:PROFILE@STEP "
    "(e.g. kill:1@5, kill:0.1@5, slow:0@4:4, join:laptop@6)"
)


@dataclass(frozen=True)
class Fault:
    kind: Literal["kill", "slow", "join"]
    stage: int
    step: int
    factor: float = 1.0
    """``slow``: how many times slower the device computes from then on."""
    profile: str | None = None
    """``join``: the catalogue profile of the device that joins (``stage`` is unused)."""
    member: int = 0
    """Which member of the stage's group (0 for a stage of one device)."""

    def __str__(self) -> str:
        if self.kind == "join":
            return f"join:{self.profile}@{self.step}"
        tail = f":{self.factor:g}" if self.kind == "slow" else ""
        where = f"{self.stage}.{self.member}" if self.member else f"{self.stage}"
        return f"{self.kind}:{where}@{self.step}{tail}"


def parse_fault(text: str, label: str = "--fault") -> Fault:
    """``kill:STAGE@STEP``, ``slow:STAGE@STEP:FACTOR`` or ``join:PROFILE@STEP``; else a
    one-line :class:`UserError` that starts with ``label`` and the text."""
    joined = _JOIN.match(text.strip())
    if joined is not None:
        return Fault("join", 0, int(joined.group(2)), profile=joined.group(1))
    m = _FAULT.match(text.strip())
    if m is None or (m.group(1) == "slow") != (m.group(5) is not None):
        raise UserError(f"{label} {text!r}: expected {_FORMS}")
    factor = float(m.group(5) or 1.0)
    if m.group(1) == "slow" and not 1.0 <= factor <= 1000.0:
        raise UserError(f"{label} {text!r}: FACTOR must be between 1 and 1000")
    return Fault(
        kind=m.group(1),  # type: ignore[arg-type]
        stage=int(m.group(2)),
        step=int(m.group(4)),
        factor=factor,
        member=int(m.group(3) or 0),
    )


def _fault_form(text: str) -> str:
    try:
        parse_fault(text, "fault")
    except UserError as exc:
        raise ValueError(exc.message) from None
    return text


FaultText = Annotated[str, Field(max_length=100), AfterValidator(_fault_form)]
"""A fault as a job names it: one of the forms of :func:`parse_fault`, kept as given."""


def check_fault_stages(
    faults: Iterable[Fault], stages: int | Sequence[int], label: str = "--fault"
) -> None:
    """A one-line :class:`UserError` (starting with ``label`` and the fault) for the first
    ``kill`` or ``slow`` fault that names a stage (or a member of its group) the plan does
    not have: it would never fire. ``stages`` is the plan's stage count, or its group
    sizes in stage order. Checked once the job is planned, before it runs."""
    sizes = [1] * stages if isinstance(stages, int) else list(stages)
    n = len(sizes)
    for fault in faults:
        if fault.kind == "join":
            continue
        if fault.stage >= n:
            have = "stage 0" if n == 1 else f"stages 0-{n - 1}"
            raise UserError(
                f"{label} {fault}: the plan has {n} stage{'s' if n > 1 else ''} "
                f"({have}), no stage {fault.stage}"
            )
        if fault.member >= sizes[fault.stage]:
            raise UserError(
                f"{label} {fault}: stage {fault.stage} runs on {sizes[fault.stage]} "
                f"device{'s' if sizes[fault.stage] > 1 else ''}, no member {fault.member}"
            )


@dataclass
class FaultInjector:
    """Fires each fault once, at its step, on the device of its stage (and member) in the
    current plan."""

    faults: list[Fault]
    act: Callable[[Fault, str], object]
    """``act(fault, device)``: do it to ``device`` (the one running the stage now)."""
    fired: list[tuple[Fault, str, float]] = field(default_factory=list)
    _pending: list[Fault] = field(default_factory=list)
    _devices: list[tuple[str, ...]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._pending = sorted(self.faults, key=lambda f: f.step)

    def use_plan(self, devices: Sequence[str | Sequence[str]]) -> None:
        """The devices of each stage of the plan now in force (a device, or a group's)."""
        with self._lock:
            self._devices = [(d,) if isinstance(d, str) else tuple(d) for d in devices]

    def on_step(self, report: StepReport) -> list[tuple[Fault, str]]:
        """Fire the faults due at ``report``'s step; the ``(fault, device)`` pairs fired."""
        due = []
        with self._lock:
            for fault in list(self._pending):
                if report.step < fault.step or fault.stage >= len(self._devices):
                    continue
                group = self._devices[fault.stage]
                if fault.member < len(group):  # else a group that shrank: not yet
                    self._pending.remove(fault)
                    due.append((fault, group[fault.member]))
        for fault, device in due:
            self.fired.append((fault, device, time.time()))
            self.act(fault, device)
        return due

    @property
    def pending(self) -> list[Fault]:
        with self._lock:
            return list(self._pending)


class FaultActuator(Protocol):
    """What the coordinator service does to a device when a fault fires."""

    def refusal(self, fault: Fault) -> str | None:
        """Why ``fault`` cannot be done by this coordinator (one line), or ``None``."""
        ...

    def kill(self, device: str) -> str:
        """End ``device``'s agent abruptly (no goodbye); what was done, in words."""
        ...

    def slow(self, device: str, factor: float) -> str:
        """Make ``device`` compute ``factor`` times slower from now on; what was done."""
        ...

    def join(self, profile: str) -> str:
        """Start one more agent with the catalogue ``profile``; its device id (it comes
        online later)."""
        ...


_NEEDS_TESTBED = (
    "{kind} faults need a testbed coordinator, one that can {can} (started by "
    "'edgetrain testbed up', or 'edgetrain coordinator --testbed-state DIR'); "
    "this coordinator can only inject slow faults"
)


class ThrottleActuator:
    """Any fleet: ``slow`` is a :class:`~edge.wire.messages.Throttle` command on the device's
    ``cmd`` topic; ``kill`` and ``join`` are refused (no agent process is ours)."""

    def __init__(self, control: MqttTransport) -> None:
        self.control = control

    def refusal(self, fault: Fault) -> str | None:
        if fault.kind == "kill":
            return _NEEDS_TESTBED.format(kind="kill", can="kill its agents' processes")
        if fault.kind == "join":
            return _NEEDS_TESTBED.format(kind="join", can="start agents")
        return None

    def slow(self, device: str, factor: float) -> str:
        self.control.publish(device_cmd(device), Throttle(slowdown=factor).model_dump_json(), 1)
        return f"{device} computes {factor:g}x slower"

    def kill(self, device: str) -> str:
        raise UserError(self.refusal(Fault("kill", 0, 0)) or "")

    def join(self, profile: str) -> str:
        raise UserError(self.refusal(Fault("join", 0, 0, profile=profile)) or "")
