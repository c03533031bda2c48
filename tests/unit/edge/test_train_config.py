"""One training config: every shape of a job's settings takes them from ``TrainConfig``.

The REST body (``JobCreate``), the engine's spec (``JobSpec``), the MQTT stage
assignment (``StageAssignment``) and the server tier's job file (``DistJob``)
refuse the same bad value with the same message, because each field is the one
definition in :mod:`edge.config` (and each of the job's own fields, in
:class:`~coordinator.engine.spec.JobBase`); the structural tests fail if a shape
restates one. ``edgetrain train`` and ``POST /api/v1/jobs`` (an in-process app, no
services) report that same message.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Union, get_args, get_origin

import pytest
import typer
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from typer.testing import CliRunner

from coordinator.engine import spec as spec_module
from coordinator.engine.spec import JobBase, JobSpec
from coordinator.service.api.routes import jobs
from coordinator.service.api.routes.jobs import JobCreate
from edge.config import CodecName, Microbatches, Schedule, TrainConfig, TrainConfigBase
from edge.errors import UserError
from edge.server.job_file import DistJob, load_job
from edge.wire.messages import MessageError, StageAssignment, parse_command
from edgetrain.cli.train import train_command

SETTINGS = {"model": "mlp", "steps": 2, "batch_size": 8, "microbatches": 2}
STAGE = {"job": "j1", "stage": 0, "num_stages": 1, "start": 0, "end": 3, "dataset": "digits"}
BAD = [
    ("codec", "fp12"),
    ("microbatches", 0),
    ("schedule", "zigzag"),
    ("precision", "fp8"),
    ("batch_size", 0),
    ("steps", 0),
    ("seed", -1),
    ("model", ""),
]
"""A bad value of a shared setting each; the assignment's codec is ``codec_in``/``_out``."""


def _message(cls: type[BaseModel], data: dict[str, Any], field: str) -> str:
    """The message ``cls`` refuses ``data`` with, for ``field``."""
    with pytest.raises(ValidationError) as caught:
        cls.model_validate(data)
    found = [e["msg"] for e in caught.value.errors() if e["loc"] == (field,)]
    assert found, caught.value
    return found[0]


def _shapes(field: str, value: object) -> dict[str, tuple[type[BaseModel], dict[str, Any], str]]:
    """Each shape with a payload that is valid but for ``field = value``, and the field
    that holds the value there."""
    bad = {**SETTINGS, field: value}
    if field == "codec":
        stage = [("assignment in", "codec_in"), ("assignment out", "codec_out")]
        assignments = {k: (StageAssignment, {**SETTINGS, **STAGE, f: value}, f) for k, f in stage}
    else:
        assignments = {"assignment": (StageAssignment, {**bad, **STAGE}, field)}
    return {
        "rest body": (JobCreate, bad, field),
        "engine spec": (JobSpec, bad, field),
        "job file": (DistJob, bad, field),
        **assignments,
    }


@pytest.mark.parametrize(("field", "value"), BAD)
def test_every_shape_refuses_a_bad_setting_with_the_same_message(field: str, value: object) -> None:
    expected = _message(TrainConfig, {**SETTINGS, field: value}, field)
    got = {name: _message(*shape) for name, shape in _shapes(field, value).items()}
    assert got == dict.fromkeys(got, expected)


def test_the_codec_message_names_the_codecs() -> None:
    message = _message(TrainConfig, {**SETTINGS, "codec": "fp12"}, "codec")
    assert message == (
        "Value error, unknown codec 'fp12': a link takes fp32, fp16, bf16 or int8 "
        "(a job may also say auto)"
    )
    assert TrainConfig.model_validate({**SETTINGS, "codec": "Auto"}).codec == "auto"
    assert JobSpec.model_validate({**SETTINGS, "codec": "FP16"}).codec == "fp16"
    link = {**SETTINGS, **STAGE, "codec_in": "auto"}
    assert "unknown codec 'auto'" in _message(StageAssignment, link, "codec_in")


def test_the_wire_and_the_job_file_tell_the_same_message(tmp_path: Path) -> None:
    """What an agent and ``edgetrain launch`` print: the message, in their one line."""
    expected = _message(TrainConfig, {**SETTINGS, "codec": "fp12"}, "codec")
    text = expected.removeprefix("Value error, ")
    payload = StageAssignment.model_validate({**SETTINGS, **STAGE}).model_dump_json()
    with pytest.raises(MessageError) as wire:
        parse_command(payload.replace('"codec_in":"fp32"', '"codec_in":"fp12"'))
    assert text in str(wire.value)
    path = tmp_path / "job.toml"
    path.write_text('model = "mlp"\nsteps = 2\nbatch_size = 8\ncodec = "fp12"\n')
    with pytest.raises(UserError) as file:
        load_job(path)
    assert file.value.message == f"{path}: codec: {text} (got 'fp12')"


def test_edgetrain_train_refuses_with_the_same_message() -> None:
    """Refused while parsing the options: nothing is planned or started."""
    app = typer.Typer()
    app.command()(train_command)
    for field, flag, value in (("codec", "--codec", "fp12"), ("schedule", "--schedule", "zigzag")):
        expected = _message(TrainConfig, {**SETTINGS, field: value}, field)
        done = CliRunner().invoke(app, [flag, value, "--transport", "inprocess"])
        assert isinstance(done.exception, UserError), done.output
        text = expected.removeprefix("Value error, ")
        assert done.exception.message == f"train: {field}: {text} (got {value!r})"


@pytest.fixture
def client() -> Iterator[TestClient]:
    """The jobs routes alone, in process: a body is validated before any service is used."""
    app = FastAPI()
    app.include_router(jobs.router, prefix="/api/v1")
    open_api = types.SimpleNamespace(token=None, api_read_auth=False)
    app.state.services = types.SimpleNamespace(
        settings=open_api, store=None, manager=None, registry=None
    )
    with TestClient(app) as test_client:
        yield test_client


@pytest.mark.parametrize(("field", "value"), BAD)
def test_post_jobs_names_the_field_with_the_same_message(
    client: TestClient, field: str, value: object
) -> None:
    expected = _message(TrainConfig, {**SETTINGS, field: value}, field)
    response = client.post("/api/v1/jobs", json={**SETTINGS, field: value})
    assert response.status_code == 422, response.text
    details = [d for d in response.json()["detail"] if d["loc"] == ["body", field]]
    assert [d["msg"] for d in details] == [expected], response.json()


def test_post_jobs_refuses_user_code_in_the_dataset(client: TestClient) -> None:
    """A ``package.module:function`` dataset would be imported and called on every device."""
    body = {**SETTINGS, "dataset": "os:system", "dataset_options": {"command": "true"}}
    response = client.post("/api/v1/jobs", json=body)
    assert response.status_code == 422, response.text
    (detail,) = response.json()["detail"]
    assert detail["loc"] == ["body", "dataset"] and "built-in dataset" in detail["msg"]


def _definition(field: FieldInfo) -> tuple[object, list[object]]:
    """A field's type and the objects that check it (constraints, validators), with an
    optional field's ``None`` set aside: equal objects mean one definition."""
    checks = list(field.metadata)
    if get_origin(field.annotation) not in (Union, types.UnionType):
        return field.annotation, checks
    arms = [a for a in get_args(field.annotation) if a is not type(None)]
    if len(arms) > 1:  # a union of its own (a job's microbatches: a count or "auto")
        return field.annotation, checks
    (arm,) = arms
    if get_origin(arm) is Annotated:
        arm, *extra = get_args(arm)
        for item in extra:
            checks += item.metadata if isinstance(item, FieldInfo) else [item]
    return arm, checks


@pytest.mark.parametrize("shape", [JobCreate, JobSpec, DistJob, StageAssignment])
def test_shapes_take_their_fields_from_train_config(shape: type[TrainConfigBase]) -> None:
    """Built on TrainConfig, and no shared field restated with checks of its own (a
    shape may change a default, or make a field optional or required)."""
    assert issubclass(TrainConfig, TrainConfigBase) and issubclass(shape, TrainConfigBase)
    shared = TrainConfigBase.model_fields
    if shape is not StageAssignment:
        assert issubclass(shape, TrainConfig)
        shared = TrainConfig.model_fields
    for name, field in shared.items():
        if issubclass(shape, JobBase) and name in ("microbatches", "schedule"):
            # A job may leave them to the planner: "auto", or TrainConfig's own values.
            assert shape.model_fields[name].metadata == JobBase.model_fields[name].metadata
            assert spec_module._COUNT.core_schema == TypeAdapter(Microbatches).core_schema
            assert spec_module._SCHEDULE.core_schema == TypeAdapter(Schedule).core_schema
            continue
        mine, theirs = _definition(shape.model_fields[name]), _definition(field)
        assert mine[0] == theirs[0], (shape.__name__, name)
        assert len(mine[1]) == len(theirs[1]), (shape.__name__, name)
        assert all(a is b for a, b in zip(mine[1], theirs[1], strict=True)), (shape.__name__, name)


@pytest.mark.parametrize("shape", [JobCreate, JobSpec])
def test_the_rest_body_and_the_spec_take_the_jobs_fields_from_job_base(
    shape: type[JobBase],
) -> None:
    """The job's own fields (planning, fault tolerance, data) are defined once too: the
    REST body may change a default or make a field optional, never its checks."""
    assert issubclass(shape, JobBase)
    for name, field in JobBase.model_fields.items():
        mine, theirs = _definition(shape.model_fields[name]), _definition(field)
        assert mine[0] == theirs[0], (shape.__name__, name)
        assert len(mine[1]) == len(theirs[1]), (shape.__name__, name)
        assert all(a is b for a, b in zip(mine[1], theirs[1], strict=True)), (shape.__name__, name)


def test_the_assignment_codecs_are_the_link_codec_of_the_config() -> None:
    (validator,) = [c for c in get_args(CodecName)[1:] if not isinstance(c, FieldInfo)]
    for name in ("codec_in", "codec_out"):
        checks = StageAssignment.model_fields[name].metadata
        assert any(c is validator for c in checks), name
