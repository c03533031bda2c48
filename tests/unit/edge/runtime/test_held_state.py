"""What a stage stopped with ``hold`` can hand over: the state of the step it is in and,
with ``handover``, of the step before ([Note: a group member dies])."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from support.reference import one_thread

from coordinator.engine.assignments import make_assignments
from coordinator.engine.spec import JobSpec
from coordinator.planner.score import Plan
from edge.runtime.checkpoint import read_state
from edge.runtime.stage import StageRuntime
from edge.transport.inprocess import InProcessTransport
from edge.wire.messages import StageAssignment


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    with one_thread():
        yield


def _stage(steps: int, handover: bool) -> StageRuntime:
    spec = JobSpec(model="mlp", steps=steps, batch_size=8, microbatches=2, seed=5)
    (a,) = make_assignments("held", spec, Plan.of(("d0", 0, 3)))
    a = StageAssignment.model_validate(a.model_dump() | {"handover": handover})
    return StageRuntime(a, InProcessTransport())


def _same(a: bytes, b: bytes) -> bool:
    """Two state blobs hold the same step, weights and optimizer state, exactly."""
    x, y = read_state(a), read_state(b)
    return (
        x.step == y.step
        and x.weights.keys() == y.weights.keys()
        and all(torch.equal(x.weights[k], y.weights[k]) for k in x.weights)
        and x.optim.keys() == y.optim.keys()
        and all(_equal(x.optim[k][n], y.optim[k][n]) for k in x.optim for n in x.optim[k])
    )


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def test_a_held_stage_gives_its_live_state_and_the_one_before() -> None:
    kept = _stage(6, handover=True)
    kept.run(first_step=0)
    # It finished step 5: it holds step 6 live, and step 5 as kept before its last update.
    assert kept.finished == 5
    stopped = _stage(5, handover=False)
    stopped.run(first_step=0)
    assert stopped.finished == 4
    # The kept state of step 5 is exactly that of a stage that stopped after step 4.
    assert _same(kept.state_at(5), stopped.state_at(5))
    assert not _same(kept.state_at(6), stopped.state_at(5))
    assert read_state(kept.state_at(6)).step == 6
    with pytest.raises(ValueError, match=r"^no state for step 4: this stage holds steps \[6, 5\]$"):
        kept.state_at(4)


def test_without_handover_only_the_live_state_is_held() -> None:
    stage = _stage(3, handover=False)
    stage.run(first_step=0)
    assert read_state(stage.state_at(3)).step == 3
    with pytest.raises(ValueError, match=r"^no state for step 2: this stage holds steps \[3\]$"):
        stage.state_at(2)
