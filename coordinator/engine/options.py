"""What a run on agents is told, as values.

A *job* is what was submitted; a *run* drives one job's stages on agents: once, or
with fault tolerance as a series of *attempts*, each under a job id of its own
(:mod:`coordinator.engine.resilient`). Its settings travel as three values:

- :class:`RunOptions`: how this coordinator drives any run on agents, whatever the
  job: its timeouts, the broker's ACLs, the server tier and its rendezvous host. A
  :class:`~coordinator.engine.engine.JobEngine` holds one and hands it to every
  :func:`~coordinator.engine.runners.run_on_agents` and
  :class:`~coordinator.engine.resilient.ResilientRun`.
- :class:`Tolerance`: what one job's run is told of fault tolerance beyond its spec:
  how often to replicate, which faults to inject, whether to migrate, and where a
  resumed job starts from. From it and the spec the engine alone decides whether the
  run replicates, and how often (:meth:`~coordinator.engine.engine.JobEngine.replication`).
- :class:`JobHooks`: what the caller hears of the run as it goes.

:class:`JobAccess` is what a :class:`RunOptions` may hold of the broker: the ACLs
each run's devices are granted, and lose when it ends.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from coordinator.engine.engine import PlannedJob
    from coordinator.engine.faults import Fault
    from coordinator.engine.replicas import ReplicaStore
    from coordinator.planner.score import Plan
    from edge.wire.messages import StageAssignment, StepReport

__all__ = ["JobAccess", "JobHooks", "RunOptions", "Tolerance"]


class JobAccess(Protocol):
    """A broker whose ACLs follow the plan (``coordinator.access.BrokerAccounts``)."""

    def grant(self, job: str, stages: list[tuple[str, StageAssignment]]) -> None:
        """Let each ``(device, assignment)`` use that stage's topics, and no other job's."""
        ...

    def release(self, job: str) -> None:
        """Take back every right granted for ``job`` (nothing if none was)."""
        ...


@dataclass(frozen=True)
class RunOptions:
    """How runs on agents are driven, whatever the job (see the module docstring)."""

    ready_timeout_s: float = 120.0
    """How long the stages may take to build their segments and subscribe (``ready``)."""
    timeout_s: float = 3600.0
    """How long a run on agents (one attempt of a resilient run) may take once started."""
    heartbeat_timeout_s: float = 3.0
    """Seconds without a heartbeat before a device of a resilient run is dead (its last
    will is quicker)."""
    access: JobAccess | None = None
    """The broker's ACLs, when the coordinator manages its accounts: each run's devices
    are granted their stages' topics, and lose them when it ends."""
    servers: Mapping[str, str] = field(default_factory=dict)
    """Server-tier devices and their torch device (``cpu``, ``cuda:0``): two or more
    stages on them form one torch.distributed group."""
    store_host: str = "127.0.0.1"
    """Where that group's rendezvous store listens (an address its ranks reach)."""


@dataclass(frozen=True)
class Tolerance:
    """What one job's run is told of fault tolerance beyond its spec."""

    replicate_every: int | None = None
    """Replicate every stage's state every this many steps (0: no fault tolerance;
    negative: as often as the plan's costs allow). ``None``: the spec's, and with
    neither, faults ask for fault tolerance as a negative value does."""
    faults: tuple[Fault, ...] | None = None
    """The faults to inject; ``None``: the spec's."""
    rebalance: bool = True
    """Whether a run with fault tolerance migrates to a faster plan when measured stage
    times drift or a device joins."""
    replicas: ReplicaStore | None = None
    """The stages' replicated states: a resumed job's (on disk); ``None``: new ones."""
    first_step: int = 0
    """The step a resumed job starts at: the newest that its ``replicas`` cover."""


@dataclass(frozen=True)
class JobHooks:
    """What a caller hears of a job as it runs; every hook is optional."""

    on_step: Callable[[StepReport], None] | None = None
    """Every stage's report of every step (paho's thread: quick)."""
    on_plan: Callable[[PlannedJob], None] | None = None
    """Every plan made for the job: the first and each re-plan after a death."""
    on_attempt: Callable[[str, Plan, int], None] | None = None
    """``(attempt job id, plan, first step)`` before each attempt starts."""
    on_fault: Callable[[Fault, dict[str, Any]], None] | None = None
    """A fault fired: what was done (``device``, ``done``) or why not (``error``)."""
    on_join: Callable[[str, bool], None] | None = None
    """A device started by a ``join`` fault came online (``True``) or did not in time."""
