"""Data that stays home: stage 0's group is the devices that hold the data, each on its
own samples, and the run equals single-device training on the union of their data.

The holders register zoo shards as agents do (``--data digits=digits:shard=K/N``,
:func:`edge.models.local_data.register`); each reads ``n_m`` samples of every
microbatch from its own shard with its own sampler, and microbatch ``j`` of the job
is the holders' rows, holder after holder (the order the module docstring of
:mod:`edge.runtime.stage` defines). The reference rebuilds those batches from the
shards with its own sampler and trains a plain PyTorch loop on them. As in the
reference parity tests, no stage may have dropped a frame: the runtime drops a frame
its plan does not expect, which training cannot show.
"""

from __future__ import annotations

from typing import Literal

import pytest
import torch
from support.diloco import train_diloco_reference
from support.reference import assert_matches, one_thread, train_on_batches, union_batches

from coordinator.engine.runners import run_inprocess
from coordinator.engine.spec import DataPlacement, JobSpec
from coordinator.planner.score import Plan, Stage
from edge.config import DiLoCo
from edge.models.local_data import register
from edge.models.user_code import ZOO_ONLY
from edge.models.zoo import get_model
from edge.wire.groups import split_samples

STEPS = 6


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize(
    ("shards", "shares"),
    [
        (["1/3", "2/3", "3/3"], (1 / 3, 1 / 3, 1 / 3)),
        (["1/2", "2/2"], (0.75, 0.25)),  # unequal: 3 and 1 samples of each microbatch
    ],
)
def test_holders_as_stage_0_equal_one_device_on_the_union(
    schedule: Literal["1f1b", "gpipe"], shards: list[str], shares: tuple[float, ...]
) -> None:
    spec = JobSpec(
        model="cnn-digits",
        steps=STEPS,
        batch_size=4 * 4 * len(shards) // (2 if len(shards) == 2 else 1),
        microbatches=4,
        seed=3,
        schedule=schedule,
        data=DataPlacement(name="digits"),
    )
    n = spec.batch_size // spec.microbatches
    counts = split_samples(n, list(shares))
    held = [register([f"digits=digits:shard={k}"], ZOO_ONLY) for k in shards]
    holders = [f"holder{i}" for i in range(len(shards))]
    units = get_model(spec.model).num_units
    plan = Plan((Stage.group(holders, 0, 1), Stage.group(["helper"], 1, units)))
    with one_thread():
        got = run_inprocess(
            spec,
            plan,
            shares=[list(shares), [1.0]],
            local=dict(zip(holders, held, strict=True)),
        )
    # Nothing a stage sent was refused: a frame the plan does not expect (labels from
    # a head that keeps them home) would be dropped and counted, not trained on.
    assert [r.frames_dropped for r in got.reports] == [0] * len(got.reports)
    # Every holder computed its own samples of every microbatch.
    for holder, count in zip(holders, counts, strict=True):
        samples = {r.samples for r in got.reports if r.device == holder}
        assert samples == {count * spec.microbatches}
    reference = train_on_batches(
        spec.model,
        union_batches(held, "digits", counts, spec.microbatches, spec.seed),
        steps=STEPS,
        seed=spec.seed,
        optimizer=spec.optimizer.model_dump(),
        microbatches=spec.microbatches,
    )
    assert_matches(got.losses, got.weights, reference)


AVERAGED = DiLoCo(every=2, outer_lr=1.0, outer_momentum=0.0)
"""Federated averaging as DiLoCo writes it: each holder steps on its own samples, and
every 2 steps the holders take their weights averaged by share."""


@pytest.mark.parametrize("helper", [False, True], ids=["holders alone", "ahead of a helper"])
def test_holders_that_average_train_as_the_diloco_loop_on_their_own_samples(
    helper: bool,
) -> None:
    """The non-exact holders ([Note: DiLoCo in a group] in :mod:`edge.runtime.outer_sync`):
    each of two unequal holders steps on its own samples of every microbatch, and they
    average every 2 steps; the independent loop on the same local batches says what
    that trains. The exact job on the same holders does not, so the test tells them
    apart."""
    spec = JobSpec(
        model="cnn-digits",
        steps=5,
        batch_size=16,
        microbatches=2,
        seed=3,
        diloco=AVERAGED,
        data=DataPlacement(name="digits"),
    )
    shares = (0.75, 0.25)  # 6 and 2 samples of each microbatch
    counts = split_samples(spec.batch_size // spec.microbatches, list(shares))
    held = [register([f"digits=digits:shard={k}"], ZOO_ONLY) for k in ("1/2", "2/2")]
    holders = ["holder0", "holder1"]
    units = get_model(spec.model).num_units
    cut = 2 if helper else units
    stages = [Stage.group(holders, 0, cut)] + ([Stage("helper", cut, units)] if helper else [])
    plan = Plan(tuple(stages))
    run_shares = [list(shares)] + [[1.0]] * (len(stages) - 1)
    local = dict(zip(holders, held, strict=True))
    with one_thread():
        got = run_inprocess(spec, plan, shares=run_shares, local=local)
        exact = run_inprocess(
            spec.model_copy(update={"diloco": None}), plan, shares=run_shares, local=local
        )
    assert [r.frames_dropped for r in got.reports] == [0] * len(got.reports)
    reference = train_diloco_reference(
        spec.model,
        steps=spec.steps,
        batch_size=spec.batch_size,
        microbatches=spec.microbatches,
        group=(0, cut),
        rows=counts,
        diloco=AVERAGED.model_dump(),
        seed=spec.seed,
        batch=union_batches(held, "digits", counts, spec.microbatches, spec.seed),
    )
    assert_matches(got.losses, got.weights, reference)
    assert not all(
        torch.allclose(exact.weights[k], v, rtol=1e-5, atol=1e-7) for k, v in got.weights.items()
    ), "the exact job trained the same weights: the test cannot tell the modes apart"


def test_a_device_without_the_data_refuses_stage_0() -> None:
    spec = JobSpec(
        model="cnn-digits",
        steps=1,
        batch_size=8,
        microbatches=2,
        seed=3,
        data=DataPlacement(name="digits"),
    )
    plan = Plan((Stage.group(["a", "b"], 0, 1), Stage.group(["c"], 1, 4)))
    only_a = {"a": register(["digits=digits:shard=1/2"], ZOO_ONLY)}
    with pytest.raises(ValueError, match=r"^local dataset 'digits': this device holds none$"):
        run_inprocess(spec, plan, local=only_a)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_labels_that_stay_home_equal_one_device_on_the_union(
    schedule: Literal["1f1b", "gpipe"],
) -> None:
    """A U: three holders run the first unit, a helper the middle, and the same holders the
    last unit and the loss on their own samples with their own labels."""
    shards = ["1/3", "2/3", "3/3"]
    spec = JobSpec(
        model="cnn-digits",
        steps=STEPS,
        batch_size=48,
        microbatches=4,
        seed=3,
        schedule=schedule,
        data=DataPlacement(name="digits", labels="local"),
    )
    shares = [0.5, 0.25, 0.25]  # unequal: 6, 3 and 3 samples of each microbatch
    counts = split_samples(spec.batch_size // spec.microbatches, shares)
    held = [register([f"digits=digits:shard={k}"], ZOO_ONLY) for k in shards]
    holders = [f"holder{i}" for i in range(len(shards))]
    units = get_model(spec.model).num_units
    plan = Plan(
        (
            Stage.group(holders, 0, 1),
            Stage.group(["helper"], 1, units - 1),
            Stage.group(holders, units - 1, units),
        ),
        u_shaped=True,
    )
    with one_thread():
        got = run_inprocess(
            spec,
            plan,
            shares=[shares, [1.0], shares],
            local=dict(zip(holders, held, strict=True)),
        )
    # Nothing a stage sent was refused: labels the head still sent, though they stay
    # home, would reach the tail's inbox and be dropped there, silently for training.
    assert [r.frames_dropped for r in got.reports] == [0] * len(got.reports)
    # Each holder ran both ends, on its own samples, and reported the loss of its rows.
    for holder, count in zip(holders, counts, strict=True):
        mine = {(r.stage, r.samples) for r in got.reports if r.device == holder}
        assert mine == {(0, count * spec.microbatches), (2, count * spec.microbatches)}
    reference = train_on_batches(
        spec.model,
        union_batches(held, "digits", counts, spec.microbatches, spec.seed),
        steps=STEPS,
        seed=spec.seed,
        optimizer=spec.optimizer.model_dump(),
        microbatches=spec.microbatches,
    )
    assert_matches(got.losses, got.weights, reference)
