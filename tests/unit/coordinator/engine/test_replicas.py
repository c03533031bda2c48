"""The coordinator's replica store: which step a job resumes from, and that it stays there."""

from __future__ import annotations

import pytest
import torch

from coordinator.engine.replicas import ReplicaStore
from edge.runtime.checkpoint import StageState, encode_state, read_state

UNITS = ["u0", "u1", "u2"]


def _replica(step: int, start: int, end: int, job: str = "j1") -> bytes:
    weights = {f"{UNITS[u]}.w": torch.full((2,), float(step * 10 + u)) for u in range(start, end)}
    state = StageState(step, job, start, start, end, UNITS[start:end], weights)
    return encode_state(state)


def _complete(store: ReplicaStore, step: int) -> None:
    store.add(_replica(step, 0, 2))
    store.add(_replica(step, 2, 3))


def test_resume_at_the_newest_step_whose_replicas_cover_every_unit() -> None:
    store = ReplicaStore(UNITS)
    assert store.newest_complete(10) == 0  # the seeded start needs no replica
    _complete(store, 2)
    store.add(_replica(4, 0, 2))  # step 4 lacks unit 2
    assert store.newest_complete(10) == 2
    assert store.newest_complete(1) == 0
    blob = store.compose(2, 1, 3, "j2", 0)
    state = read_state(blob)
    assert (state.step, state.job, state.start, state.end) == (2, "j2", 1, 3)
    assert state.weights["u1.w"].tolist() == [21.0, 21.0]


def test_the_step_a_resume_was_promised_is_not_pruned() -> None:
    """Replicas of newer steps from a cancelled attempt may arrive between choosing the
    resume step and composing its state; the store keeps only two complete steps."""
    store = ReplicaStore(UNITS)
    _complete(store, 3)
    assert store.newest_complete(4, hold=True) == 3
    for step in (6, 9, 12):
        _complete(store, step)
    assert read_state(store.compose(3, 0, 3, "j2", 0)).step == 3
    assert store.newest_complete(12, hold=True) == 12
    _complete(store, 15)  # 3 is no longer held: pruned now
    with pytest.raises(KeyError, match="no replicas of step 3"):
        store.compose(3, 0, 3, "j2", 0)
