"""Options are data ([Note: options are data] in edge.models.options): checked against the
builder's signature in every shape a job takes, before anything is built.

Every zoo model and built-in dataset is covered by name, so a new builder is checked
too: its reserved names are refused, an unknown name lists what it takes, and each of
its parameters refuses a value of another JSON type.
"""

from __future__ import annotations

import inspect
import json
import typing
from typing import Any

import pytest
from pydantic import ValidationError

from edge.config import TrainConfig
from edge.errors import UserError
from edge.models.datasets import DATASETS, build_dataset, check_dataset_options
from edge.models.options import DATASET_RESERVED, MODEL_RESERVED
from edge.models.zoo import MODELS, check_model_options, get_model
from edge.runtime.data import ORDER_BYTES, check_data_fits, data_bytes
from edge.wire.messages import MessageError, parse_command, refused_assignment

ASSIGNMENT = {
    "type": "assign",
    "job": "j1",
    "stage": 1,
    "member": 0,
    "num_stages": 2,
    "start": 0,
    "end": 2,
    "model": "mlp",
    "dataset": "digits",
    "steps": 1,
    "batch_size": 8,
}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("name", list(MODEL_RESERVED))
def test_a_models_reserved_names_are_refused_by_name(model: str, name: str) -> None:
    why = f"model {model}: model_options may not set {name!r}: {MODEL_RESERVED[name]}"
    with pytest.raises(UserError) as refused:
        check_model_options(model, {name: 1})
    assert refused.value.message == why
    with pytest.raises(ValidationError) as invalid:  # every shape: a job file, the API
        TrainConfig(model=model, model_options={name: 1}, steps=1, batch_size=4)
    ((error),) = invalid.value.errors()
    assert (error["loc"], error["msg"]) == (("model_options",), why)


@pytest.mark.parametrize("dataset", list(DATASETS))
@pytest.mark.parametrize("name", list(DATASET_RESERVED))
def test_a_datasets_reserved_names_are_refused_by_name(dataset: str, name: str) -> None:
    why = f"dataset {dataset!r}: dataset_options may not set {name!r}: {DATASET_RESERVED[name]}"
    with pytest.raises(UserError) as refused:
        check_dataset_options(dataset, {name: "x"})
    assert refused.value.message == why
    with pytest.raises(ValidationError) as invalid:
        TrainConfig(model="mlp", dataset=dataset, dataset_options={name: 1}, steps=1, batch_size=4)
    ((error),) = invalid.value.errors()
    assert (error["loc"], error["msg"]) == (("dataset_options",), why)
    # Without a dataset named, the model's own one's options still may not hold them.
    with pytest.raises(ValidationError, match=f"may not set {name!r}"):
        TrainConfig(model="mlp", dataset_options={name: 1}, steps=1, batch_size=4)


def _parameters(builder: Any, reserved: dict[str, str]) -> dict[str, Any]:
    """The builder's parameters an option may set, with their types."""
    hints = typing.get_type_hints(builder.__init__ if inspect.isclass(builder) else builder)
    return {p: hints[p] for p in inspect.signature(builder).parameters if p not in reserved}


def _wrong_value(hint: Any) -> object:
    """A JSON value that is not of type ``hint``."""
    if hint is str:
        return 7
    return "7"  # not an int, a tuple of ints, nor an optional int


@pytest.mark.parametrize(
    ("check", "name", "builder", "reserved"),
    [(check_model_options, n, b, MODEL_RESERVED) for n, b in MODELS.items()]
    + [(check_dataset_options, n, e.builder, DATASET_RESERVED) for n, e in DATASETS.items()],
)
def test_every_option_is_checked_against_its_builder(
    check: Any, name: str, builder: Any, reserved: dict[str, str]
) -> None:
    params = _parameters(builder, reserved)
    with pytest.raises(UserError, match=r"unknown option 'colour' \(takes: "):
        check(name, {"colour": 1})
    for param, hint in params.items():
        with pytest.raises(UserError, match=f"option {param}: input should be a valid"):
            check(name, {param: _wrong_value(hint)})
        with pytest.raises(UserError, match="not finite"):
            check(name, {param: float("nan")})


def test_user_code_options_are_checked_for_reserved_names_and_data_only() -> None:
    check_model_options("pkg.mod:build", {"anything": [1, {"x": None}]})
    check_dataset_options("pkg.mod:data", {"anything": "goes"})
    with pytest.raises(UserError, match="may not set 'allow_code'"):
        check_model_options("pkg.mod:build", {"allow_code": ["os"]})
    with pytest.raises(UserError, match="may not set 'split'"):
        check_dataset_options("pkg.mod:data", {"split": "test"})
    with pytest.raises(UserError, match="not JSON data"):
        check_model_options("pkg.mod:build", {"x": object()})


def test_good_options_pass_unchanged_and_build() -> None:
    options = {"shape": [1, 8, 8], "num_classes": 10, "size": 64, "seed": 3}
    check_dataset_options("synthetic-images", options)
    assert len(build_dataset("synthetic-images", **options)) == 64
    check_model_options("gpt-mini", {"n_layer": 2, "d_model": 64})
    assert get_model("gpt-mini", n_layer=2, d_model=64).num_units == 4
    check_dataset_options("text", {"block_size": 32, "stride": None})


def test_an_assignment_with_bad_options_is_refused_and_still_answerable() -> None:
    payload = {**ASSIGNMENT, "stage": 1, "model_options": {"seed": 3}}
    text = json.dumps(payload)
    with pytest.raises(MessageError, match="model_options may not set 'seed'"):
        parse_command(text)
    assert refused_assignment(text) == ("j1", 1, 0)
    assert refused_assignment(json.dumps({**payload, "job": "bad job!"})) is None
    assert refused_assignment(json.dumps({**payload, "type": "start"})) is None
    assert refused_assignment(b"not json") is None


def test_the_data_a_stage_holds_is_its_order_and_what_the_dataset_keeps() -> None:
    digits = build_dataset("digits")
    assert data_bytes(digits) == ORDER_BYTES * len(digits) + len(digits) * (64 * 4 + 8)
    synthetic = build_dataset("synthetic-images", shape=[1, 8, 8], num_classes=10, size=2**31)
    assert data_bytes(synthetic) == 8 * 2**31 + 10 * 64 * 8  # prototypes in float64
    check_data_fits(synthetic, "synthetic-images", data_bytes(synthetic))  # exactly fits
    with pytest.raises(UserError) as refused:
        check_data_fits(synthetic, "synthetic-images", 4 * 10**9)
    assert refused.value.message == (
        "dataset 'synthetic-images': reading it takes 17,179,874,304 bytes (the order of "
        "2,147,483,648 samples at 8 bytes each, and its resident data), more than the "
        "4,000,000,000 bytes this device has free"
    )
