"""What a stage expects on its links (edge/runtime/links.py), from its assignment alone.

The shapes asserted here are the ones the pipeline really sends (the parity
tests run every zoo model with no frame dropped); these pin them down per
setting: microbatch size, replicas, cuts, dataset options, precision.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from edge.models.zoo import get_model
from edge.runtime.links import expected_frames, microbatch_size
from edge.runtime.stage import StageRuntime
from edge.transport.inbox import Expected
from edge.transport.inprocess import InProcessTransport
from edge.wire.frames import Codec, Kind, encode_frame
from edge.wire.messages import StageAssignment

F32 = frozenset({torch.float32})
I64 = frozenset({torch.int64})


def assignment(model: str, stage: int, cuts: list[int], **fields: Any) -> StageAssignment:
    spec = get_model(model)
    settings: dict[str, Any] = {
        "job": "links",
        "model": model,
        "dataset": spec.dataset,
        "dataset_options": spec.dataset_options,
        "steps": 2,
        "batch_size": 16,
        "microbatches": 4,
    }
    return StageAssignment.model_validate(
        settings
        | fields
        | {
            "stage": stage,
            "num_stages": len(cuts) - 1,
            "start": cuts[stage],
            "end": cuts[stage + 1],
        }
    )


def expected(a: StageAssignment) -> dict[Kind, Expected | None]:
    return expected_frames(a, get_model(a.model, **a.model_options))


def test_each_stage_of_a_cnn_expects_its_neighbours_tensors() -> None:
    cuts = [0, 1, 3, 4]
    assert expected(assignment("cnn-digits", 0, cuts)) == {
        Kind.GRADIENT: Expected((4, 16, 8, 8), F32)
    }
    assert expected(assignment("cnn-digits", 1, cuts)) == {
        Kind.ACTIVATION: Expected((4, 16, 8, 8), F32),
        Kind.GRADIENT: Expected((4, 64), F32),
    }
    assert expected(assignment("cnn-digits", 2, cuts)) == {
        Kind.ACTIVATION: Expected((4, 64), F32),
        Kind.LABELS: Expected((4,), I64),
    }


def test_a_language_model_expects_a_label_per_token() -> None:
    cuts = [0, 1, 6]
    assert expected(assignment("gpt-mini", 1, cuts)) == {
        Kind.ACTIVATION: Expected((4, 64, 128), F32),
        Kind.LABELS: Expected((4, 64), I64),
    }


def test_the_microbatch_is_the_batch_over_microbatches_and_replicas() -> None:
    a = assignment("mlp", 1, [0, 1, 3], batch_size=24, microbatches=3, replicas=2, replica=1)
    assert microbatch_size(a) == 4
    assert expected(a)[Kind.ACTIVATION] == Expected((4, 128), F32)
    assert expected(a)[Kind.LABELS] == Expected((4,), I64)


def test_shapes_follow_the_data_stage_0_reads_not_the_models_default() -> None:
    a = assignment("resnet18", 1, [0, 1, 10], dataset_options={"shape": [3, 16, 16]})
    assert expected(a)[Kind.ACTIVATION] == Expected((4, 64, 16, 16), F32)


def test_bf16_links_accept_either_float_dtype_and_labels_stay_exact() -> None:
    got = expected(assignment("mlp", 1, [0, 1, 3], precision="bf16"))
    assert got[Kind.ACTIVATION] == Expected((4, 128), frozenset({torch.float32, torch.bfloat16}))
    assert got[Kind.LABELS] == Expected((4,), I64)


def test_a_single_stage_expects_nothing() -> None:
    assert expected(assignment("mlp", 0, [0, 3])) == {}


def test_labels_are_unchecked_when_the_dataset_cannot_be_built_here(
    caplog: pytest.LogCaptureFixture,
) -> None:
    a = assignment("mlp", 1, [0, 1, 3], dataset="no_such_package.data:build")
    with caplog.at_level(logging.WARNING, "edge.runtime.links"):
        got = expected(a)
    # The activation is traced from the model's own input shape instead.
    assert got == {Kind.ACTIVATION: Expected((4, 128), F32), Kind.LABELS: None}
    assert "cannot read a sample of dataset no_such_package.data:build" in caplog.text


def test_a_stage_tells_its_inbox_the_plan_and_its_first_step() -> None:
    transport = InProcessTransport()
    a = assignment("cnn-digits", 2, [0, 1, 3, 4], first_step=1, steps=3)
    rt = StageRuntime(a, transport)
    inbox = rt.inbox
    assert rt.expected == expected(a)
    assert inbox.max_frames == 2 * 4 * 2
    assert inbox.max_frame_bytes == Expected((4, 64), F32).max_nbytes
    # Step 0 is before the stage starts, step 3 two ahead of it: both refused.
    for step, reason in ((0, "late"), (3, "ahead")):
        frame = encode_frame(Kind.ACTIVATION, "links", step, 0, torch.ones(4, 64), Codec.FP32)
        assert not inbox.deliver(frame, "fwd")
        assert inbox.dropped[reason] == 1
    transport.close()
