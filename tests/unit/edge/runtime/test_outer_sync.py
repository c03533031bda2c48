"""A group with ``diloco`` trains as the independent DiLoCo loop says ([Note: DiLoCo in a
group] in :mod:`edge.runtime.outer_sync`), and sums only when it syncs.

Pipelines of the mlp run in process with a group of two members at unequal shares (six
rows and two of every microbatch): ahead of a single last stage, and as the whole model
alone. Every step's loss and the final weights must equal
:func:`support.diloco.train_diloco_reference` within the parity tests' 1e-5. The same
job without ``diloco`` must not, so the comparison tells the modes apart. The group's
members report a sum's bytes on the sync steps, and on no other.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.diloco import train_diloco_reference
from support.reference import assert_matches

from coordinator.engine.runners import run_inprocess
from coordinator.engine.spec import JobSpec
from coordinator.planner.score import Plan, Stage
from edge.config import DiLoCo
from edge.runtime.outer_sync import OuterSync

STEPS, BATCH, MICROBATCHES, EVERY = 5, 16, 2, 2
ROWS = (6, 2)
DILOCO = {"every": EVERY, "outer_lr": 0.7, "outer_momentum": 0.9}
PLANS = {
    "ahead of the last stage": Plan((Stage.group(["a", "b"], 0, 2), Stage("c", 2, 3))),
    "the whole model": Plan((Stage.group(["a", "b"], 0, 3),)),
}


def _spec(**fields: Any) -> JobSpec:
    return JobSpec.model_validate(
        {
            "model": "mlp",
            "steps": STEPS,
            "batch_size": BATCH,
            "microbatches": MICROBATCHES,
            "seed": 3,
            **fields,
        }
    )


@pytest.mark.parametrize("where", list(PLANS))
def test_a_diloco_group_trains_as_the_reference_loop(where: str) -> None:
    plan = PLANS[where]
    shares = [[0.75, 0.25]] + [[1.0]] * (len(plan.stages) - 1)
    result = run_inprocess(_spec(diloco=DILOCO), plan, shares=shares, timeout_s=120)
    group = plan.stages[0]
    reference = train_diloco_reference(
        "mlp",
        steps=STEPS,
        batch_size=BATCH,
        microbatches=MICROBATCHES,
        group=(group.start, group.end),
        rows=ROWS,
        diloco=DILOCO,
        seed=3,
    )
    assert_matches(result.losses, result.weights, reference)
    synced = {t for t in range(STEPS) if (t + 1) % EVERY == 0 or t == STEPS - 1}
    for r in result.reports:
        if r.stage == 0:
            assert r.samples == ROWS[r.member] * MICROBATCHES
            assert (r.allreduce_bytes > 0) == (r.step in synced), (r.step, r.member)
    exact = run_inprocess(_spec(), plan, shares=shares, timeout_s=120)
    assert not all(
        torch.allclose(exact.weights[k], v, rtol=1e-5, atol=1e-7) for k, v in result.weights.items()
    ), "the exact job trained the same weights: the test cannot tell the modes apart"


def test_diloco_refuses_fault_tolerance_and_labels_that_stay_home() -> None:
    with pytest.raises(ValueError, match="diloco cannot be combined with fault tolerance yet"):
        _spec(diloco=DILOCO, replicate_every=2)
    with pytest.raises(ValueError, match='diloco cannot be combined with labels "local" yet'):
        _spec(diloco=DILOCO, data={"name": "digits", "labels": "local"})
    assert _spec(diloco=DILOCO, data={"name": "digits"}).training.startswith("non-exact")
    with pytest.raises(ValueError, match="every"):
        _spec(diloco={"every": 1})


def test_an_outer_step_of_one_without_momentum_averages_the_members() -> None:
    """``outer_lr`` 1 and no momentum: after a sync each member holds its group's weights
    averaged by share (local SGD), whatever it held before."""
    torch.manual_seed(0)
    spec = DiLoCo(every=2, outer_lr=1.0, outer_momentum=0.0)
    layers = [torch.nn.Linear(3, 2) for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    syncs = [
        OuterSync(list(m.parameters()), spec, share)
        for m, share in zip(layers, (0.75, 0.25), strict=True)
    ]
    with torch.no_grad():  # the members move apart, as their own steps would move them
        for m in layers:
            for p in m.parameters():
                p.add_(torch.randn_like(p))
    want = [
        0.75 * a.detach() + 0.25 * b.detach()
        for a, b in zip(*(m.parameters() for m in layers), strict=True)
    ]
    for sync in syncs:
        sync.outer_gradients()
    for a, b in zip(
        *(m.parameters() for m in layers), strict=True
    ):  # the group's sum, as GroupSum gives it
        total = a.grad + b.grad
        a.grad, b.grad = total.clone(), total.clone()
    for sync in syncs:
        sync.step()
    for m in layers:
        for p, w in zip(m.parameters(), want, strict=True):
            torch.testing.assert_close(p.detach(), w, rtol=1e-6, atol=1e-6)
    assert syncs[0].due(1, 10) and not syncs[0].due(2, 10) and syncs[0].due(2, 3)


def test_members_that_run_apart_between_syncs_still_sync() -> None:
    """Between syncs nothing holds a DiLoCo group's members together: a member ten times
    slower is steps behind when the faster one sends its chunks of the next sum. Its
    inbox keeps them ([Note: bounded inboxes] in :mod:`edge.transport.inbox`), and the
    group trains as the reference loop (four Pis at 10 Mbit/s timed out on exactly
    this, a member's chunk dropped as ``ahead``)."""
    every, steps = 4, 8
    diloco = {**DILOCO, "every": every}
    plan = Plan((Stage.group(["a", "b"], 0, 3),))
    result = run_inprocess(
        _spec(diloco=diloco, steps=steps),
        plan,
        shares=[[0.5, 0.5]],
        timeout_s=120,
        slowdowns={"a": 10.0},
    )
    by = {(r.member, r.step): r for r in result.reports}
    assert by[1, every - 1].allreduce_started < by[0, every - 2].started_at, (
        "the fast member was not two steps ahead: the test shows nothing"
    )
    reference = train_diloco_reference(
        "mlp",
        steps=steps,
        batch_size=BATCH,
        microbatches=MICROBATCHES,
        group=(0, 3),
        rows=(BATCH // MICROBATCHES // 2,) * 2,
        diloco=diloco,
        seed=3,
    )
    assert_matches(result.losses, result.weights, reference)
