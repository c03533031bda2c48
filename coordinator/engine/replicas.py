"""The coordinator's copy of every stage's replicated state, and what a new stage is given.

Stages publish their state (weights and optimizer state, safetensors; see
:mod:`edge.runtime.checkpoint`) on ``jobs/{job}/replica/{stage}`` every R steps.
:class:`ReplicaStore` keeps them by step and unit range, across the attempts of
one resilient run (:mod:`coordinator.engine.resilient`): after a failure the newest
step whose replicas cover every unit of the model is where training resumes,
and :meth:`ReplicaStore.compose` cuts the state of exactly a new stage's units
out of whichever replicas hold them, so layers can move between devices.

Replicas arrive from the network: a blob that does not parse is logged and
dropped, never trusted. Older steps than the newest complete one are pruned.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

from edge.files import write_atomic
from edge.runtime.checkpoint import StageState, encode_state, read_state, select
from edge.transport.mqtt import MqttTransport
from edge.wire.topics import TOPIC_ROOT

__all__ = ["ReplicaStore"]

log = logging.getLogger(__name__)


class ReplicaStore:
    """Replicas by step, for the attempts (job ids) it was told to accept."""

    def __init__(self, unit_names: list[str], directory: Path | None = None) -> None:
        self.unit_names = list(unit_names)
        self.num_units = len(unit_names)
        self.directory = directory
        """Where replicas are also kept, so a restarted coordinator finds them."""
        self._by_step: dict[int, list[StageState]] = {}
        self._jobs: dict[str, list[tuple[int, int]]] = {}  # attempt -> each stage's units
        self._held: int | None = None  # the step a resume was promised (see newest_complete)
        self._lock = threading.Lock()
        self.received = 0
        self.bytes = 0
        self.rejected = 0
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            for path in sorted(directory.glob("step*.safetensors")):
                try:
                    self.add(path.read_bytes(), keep=False)
                except (OSError, ValueError) as exc:
                    log.warning("ignored the replica %s: %s", path, exc)

    def accept(self, job: str, stages: list[tuple[int, int]]) -> None:
        """Take replicas published by stages of ``job`` (one attempt) from now on; stage
        ``s``'s must hold exactly the units ``stages[s]`` (``[start, end)``)."""
        with self._lock:
            self._jobs[job] = list(stages)

    @contextlib.contextmanager
    def listening(self, control: MqttTransport) -> Iterator[ReplicaStore]:
        topic = f"{TOPIC_ROOT}/jobs/+/replica/+"
        control.subscribe(topic, self._on_replica)
        try:
            yield self
        finally:
            control.unsubscribe(topic)

    def _on_replica(self, topic: str, payload: bytes) -> None:
        job, stage = topic.split("/")[-3], topic.split("/")[-1]
        with self._lock:
            units = self._jobs.get(job)
        if units is None:
            return
        try:
            if not stage.isdigit() or int(stage) >= len(units):
                raise ValueError(f"the plan has no stage {stage}")
            self.add(payload, units=units[int(stage)])
        except ValueError as exc:
            with self._lock:
                self.rejected += 1
            log.warning("dropped a replica on %s: %s", topic, exc)

    def add(
        self, blob: bytes, *, keep: bool = True, units: tuple[int, int] | None = None
    ) -> StageState:
        """Keep one replica (also on disk, with ``keep``); ``ValueError`` for a malformed
        one, or one that does not hold exactly ``units`` (``[start, end)``) when given."""
        state = read_state(blob)
        if units is not None and (state.start, state.end) != tuple(units):
            have = f"units [{state.start}, {state.end})"
            raise ValueError(f"{have}, not the stage's [{units[0]}, {units[1]})")
        if not 0 <= state.start < state.end <= self.num_units:
            where = f"units [{state.start}, {state.end})"
            raise ValueError(f"{where} beyond the model's {self.num_units}")
        with self._lock:
            same = (state.start, state.end)
            kept = [s for s in self._by_step.get(state.step, []) if (s.start, s.end) != same]
            self._by_step[state.step] = [*kept, state]
            self.received += 1
            self.bytes += len(blob)
            self._prune_locked()
        if keep and self.directory is not None:
            name = f"step{state.step:08d}-{state.start}-{state.end}.safetensors"
            write_atomic(self.directory / name, blob)
        return state

    def _covers_locked(self, step: int) -> bool:
        covered = [False] * self.num_units
        for s in self._by_step.get(step, []):
            covered[s.start : s.end] = [True] * (s.end - s.start)
        return all(covered)

    def _prune_locked(self) -> None:
        # Keep the two newest complete steps (and anything newer, still filling up),
        # and the step a resume was promised.
        complete = sorted(s for s in self._by_step if self._covers_locked(s))
        if len(complete) > 2:
            for step in [s for s in self._by_step if s < complete[-2] and s != self._held]:
                del self._by_step[step]
                if self.directory is not None:
                    for path in self.directory.glob(f"step{step:08d}-*.safetensors"):
                        path.unlink(missing_ok=True)

    def newest_complete(self, limit: int, *, hold: bool = False) -> int:
        """The newest step ``<= limit`` whose replicas cover every unit (0: the seeded start).

        ``hold`` keeps that step's replicas, until the next call with ``hold``, for
        :meth:`compose`: replicas of newer steps may still arrive from a cancelled
        attempt (the coordinator reads its messages behind the stages; a slowed run
        got 3 newer complete steps in 0.1 s), and without the hold they pruned it.
        """
        with self._lock:
            steps = [s for s in self._by_step if s <= limit and self._covers_locked(s)]
            newest = max(steps, default=0)
            if hold:
                self._held = newest
        return newest

    def compose(self, step: int, start: int, end: int, job: str, stage: int) -> bytes:
        """The state at ``step`` of units ``[start, end)``, for stage ``stage`` of ``job``."""
        with self._lock:
            states = list(self._by_step.get(step, []))
        if not states:
            raise KeyError(f"no replicas of step {step}")
        # One step's replicas may come from several attempts (plans): all hold the same
        # training state, so they are taken as one job's.
        parts = [dataclasses.replace(s, job=job) for s in states]
        chosen = select(parts, start, end, self.unit_names)
        return encode_state(dataclasses.replace(chosen, stage=stage))
