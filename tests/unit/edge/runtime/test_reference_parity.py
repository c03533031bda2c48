"""Pipelined training equals a plain PyTorch loop: the training contract, checked fast.

Every case runs a 3-stage pipeline as threads over the in-process transport
(edgetrain's runtime, schedules, frames and codecs, without processes) and
compares every step's loss and every final tensor with the independent
reference (:mod:`support.reference`, a plain loop that shares no training code
with edgetrain) within 1e-5, and with edgetrain's own one-stage path. The
cases cover the settings a job trains with: the zoo's small models, 1F1B and
GPipe, several epochs, SGD with momentum and weight decay, AdamW,
GroupNorm, BatchNorm with one microbatch, and the lossy codecs within their
documented tolerance (README, "Pipelined training").

These are the tests ``make mutants`` expects to catch a runtime bug that
changes every stage count alike (the one-stage comparison cannot).
"""

from __future__ import annotations

import statistics
from typing import Any

import pytest
from support.reference import ReferenceRun, assert_matches, train_reference

from coordinator.engine.monitor import JobResult
from coordinator.engine.runners import run_inprocess
from coordinator.engine.spec import JobSpec
from coordinator.planner.score import Plan
from edge.models.zoo import get_model
from edge.runtime.schedules import SCHEDULES

SEED = 3


def _spec(model: str, **fields: Any) -> JobSpec:
    defaults: dict[str, Any] = {"steps": 6, "batch_size": 16, "microbatches": 4, "seed": SEED}
    return JobSpec(model=model, **{**defaults, **fields})


def _stages(spec: JobSpec, count: int) -> Plan:
    """``count`` stages of one unit each, the last taking the rest."""
    n = get_model(spec.model, **spec.model_options).num_units
    cuts = [*range(count), n]
    return Plan.of(*((f"d{s}", cuts[s], cuts[s + 1]) for s in range(count)))


def _run(spec: JobSpec, stages: int) -> JobResult:
    result = run_inprocess(spec, _stages(spec, stages), timeout_s=120)
    assert len(result.plan.stages) == stages
    assert {(r.stage, r.step) for r in result.reports} == {
        (s, t) for s in range(stages) for t in range(spec.steps)
    }
    # The inboxes' step window and plan never refuse a frame the pipeline really sends.
    assert [r.frames_dropped for r in result.reports] == [0] * len(result.reports)
    return result


def _reference(spec: JobSpec) -> ReferenceRun:
    return train_reference(
        spec.model,
        steps=spec.steps,
        batch_size=spec.batch_size,
        seed=spec.seed,
        optimizer=spec.optimizer.model_dump(),
        model_options=spec.model_options,
        dataset=spec.dataset,
        dataset_options=spec.dataset_options,
    )


def _assert_equal_training(spec: JobSpec, stages: int = 3) -> JobResult:
    """The pipeline matches the independent reference and the one-stage path."""
    piped = _run(spec, stages)
    assert_matches(piped.losses, piped.weights, _reference(spec))
    single = _run(spec, 1)
    assert_matches(piped.losses, piped.weights, ReferenceRun(single.losses, single.weights))
    return piped


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("model", ["mlp", "cnn-digits", "gpt-mini"])
def test_three_stages_equal_the_reference(model: str, schedule: str) -> None:
    _assert_equal_training(_spec(model, schedule=schedule, steps=4 if model == "gpt-mini" else 6))


def test_several_epochs_reshuffle_like_the_reference() -> None:
    # 1,437 training digits in batches of 256: 5 a epoch, so 12 steps span three epochs.
    _assert_equal_training(_spec("cnn-digits", steps=12, batch_size=256, microbatches=4))


@pytest.mark.parametrize(
    "optimizer",
    [
        {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3},
        {"name": "adamw", "lr": 3e-3, "weight_decay": 0.05},
        {"name": "adamw", "lr": 1e-3, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.0},
    ],
    ids=["sgd-decay", "adamw-decay", "adamw-betas"],
)
def test_optimizers_and_weight_decay_equal_the_reference(optimizer: dict[str, Any]) -> None:
    _assert_equal_training(_spec("mlp", steps=8, optimizer=optimizer))


def test_group_norm_equals_the_reference() -> None:
    _assert_equal_training(_spec("cnn-digits", model_options={"norm": "group"}))


def test_batch_norm_with_one_microbatch_equals_the_reference() -> None:
    """BatchNorm's batch statistics are the whole batch's only with one microbatch;
    its running statistics (buffers) are compared too."""
    spec = _spec("cnn-digits", model_options={"norm": "batch"}, microbatches=1)
    piped = _assert_equal_training(spec)
    assert any(k.endswith("running_mean") for k in piped.weights)


def test_four_stages_of_a_longer_model() -> None:
    spec = _spec("gpt-mini", steps=3, microbatches=2)
    _assert_equal_training(spec, stages=4)


# Measured here (50 steps of cnn-digits, batch 64, mean loss of the last 25 steps against
# fp32; seed 3): fp16 +0.30%, int8 -0.94%, bf16 +1.77%; over seeds 0-5 at most 1.27%,
# 0.94% and 1.77%. The last 10 steps' mean moved up to 4.5% (fp16) and 8.7% (bf16)
# from seed to seed and machine to machine: too noisy to hold a codec to 2%. The
# tolerances are the README's.
CODEC_TOLERANCE = {"fp16": 0.02, "int8": 0.02, "bf16": 0.10}


@pytest.mark.parametrize("codec", list(CODEC_TOLERANCE))
def test_lossy_codecs_stay_within_their_tolerance(codec: str) -> None:
    spec = _spec("cnn-digits", steps=50, batch_size=64, codec=codec)
    reference = _reference(spec)
    got = _run(spec, 3)
    curve = statistics.mean(got.losses[-25:]) / statistics.mean(reference.losses[-25:]) - 1
    assert abs(curve) < CODEC_TOLERANCE[codec], curve
    assert got.losses != reference.losses  # the codec really changed what crossed the links
    assert got.losses[-1] < 0.5 * got.losses[0]  # and training still learned
