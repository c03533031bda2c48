"""Every field of a job goes in through every entry point: the REST body, a job.toml file
for ``edgetrain submit``, and ``edgetrain train``'s flags.

The fields are read from the job's types (``model_fields`` of the REST body and of the
engine's :class:`JobSpec`), so a new field fails here until it has a valid non-default
value in :data:`VALUES`, and a flag of ``train`` or a reason in :data:`TRAIN_TAKES_NOT`.
Each value is sent alone (with the fields it needs, :data:`NEEDS`), and must arrive:

- ``POST /api/v1/jobs`` (the jobs router in process, FastAPI's TestClient, over a real
  store and the real job manager, not started: a job stays queued) stores a spec that
  holds it; a job.toml file read by ``edgetrain submit`` (:func:`_read_job`) is posted
  the same way;
- ``edgetrain train``'s flags, parsed by the command itself (nothing runs), make a
  :class:`~coordinator.local.options.LocalTraining` whose spec holds it (or, for fault
  tolerance, the run: :data:`TRAIN_RUN_HOLDS`).

Every value must differ from what arrives without it, so a field an entry point drops
fails here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import tomli_w
from support.jobs_api import JobsApi, jobs_api
from typer.main import get_command

from coordinator.engine.spec import JobSpec
from coordinator.local.options import LocalTraining
from coordinator.service.api.routes.jobs import JobCreate
from coordinator.service.store.sqlite import JobRecord
from edge.models.datasets import build_dataset
from edgetrain.cli import app
from edgetrain.cli.client import _read_job
from edgetrain.cli.train import local_training

TRAIN = get_command(app).commands["train"]  # type: ignore[attr-defined]

BASE: dict[str, Any] = {"model": "mlp", "steps": 2, "batch_size": 8, "microbatches": 2}

VALUES: dict[str, Any] = {
    "model": "cnn-digits",
    "model_options": {"hidden": 16},
    "dataset": "synthetic-images",
    "dataset_options": {"size": 64, "seed": 3},
    "steps": 3,
    "batch_size": 16,
    "microbatches": 4,
    "schedule": "gpipe",
    "optimizer": {"name": "adamw", "lr": 0.01, "momentum": 0.5, "weight_decay": 0.1},
    "precision": "bf16",
    "compile": True,
    "seed": 7,
    "codec": "fp16",
    "recv_timeout_s": 30.0,
    "pin_first": "dev-a",
    "partition": "even",
    "stages": 2,
    "replicate_every": 3,
    "group_sizes": [2, 1],
    "objective": "energy",
    "max_step_time_s": 2.5,
    "unit_times": "devices",
    "faults": ["slow:0@1:2"],
    "data": {"name": "digits", "labels": "local"},
    "diloco": {"every": 4, "outer_lr": 0.5, "outer_momentum": 0.8},
    # The REST body's own:
    "epochs": 0.5,
    "devices": ["dev-a", "dev-b"],
}
"""A valid value of each field of a job, none its default (nor what the API resolves an
absent one to: the model's own dataset, no fault tolerance)."""

NEEDS: dict[str, dict[str, Any]] = {
    "dataset": {"model_options": {"in_features": 3 * 32 * 32}},  # its images, flattened
    "dataset_options": {"dataset": "synthetic-images", "model_options": {"in_features": 3072}},
    "group_sizes": {"partition": "even"},
    "epochs": {"steps": None},  # None: left out
}
"""What a field's value needs beside it for the job to be valid."""

README_BODY_FIELDS = (
    "model",
    "model_options",
    "dataset",
    "steps",
    "epochs",
    "batch_size",
    "microbatches",
    "schedule",
    "codec",
    "partition",
    "stages",
    "seed",
    "devices",
    "optimizer",
    "objective",
    "max_step_time_s",
    "group_sizes",
    "faults",
    "replicate_every",
    "data",
    "unit_times",
    "pin_first",
)
"""The fields README.md and examples/job.toml document for ``POST /api/v1/jobs``."""

TRAIN_TAKES_NOT = {
    "pin_first": "train starts its agents itself and runs stage 0 on the first of them "
    "(it holds the data): no other device could be named",
}
"""The job's fields ``edgetrain train`` deliberately has no flag for, with the reason."""

TRAIN_RUN_HOLDS: dict[str, Callable[[LocalTraining], Any]] = {
    "replicate_every": lambda training: training.replicate_every,
    "faults": lambda training: list(training.faults),
}
"""Fields ``train`` takes as the run's fault tolerance (``--replicate-every``,
``--fault``: the run decides how often, :class:`~coordinator.engine.options.Tolerance`),
not the spec's: where each arrives."""

TRAIN_FLAG_NAMES = {"recv_timeout_s": "--recv-timeout", "max_step_time_s": "--deadline"}
"""Flags not named as their field (``--batch-size``: ``batch_size``)."""


def _pairs(flag: str, options: Mapping[str, Any]) -> list[str]:
    return [arg for key, value in options.items() for arg in (flag, f"{key}={value}")]


TRAIN_FLAGS: dict[str, Callable[[Any], list[str]]] = {
    "model_options": lambda value: _pairs("--option", value),
    "dataset_options": lambda value: _pairs("--dataset-option", value),
    "optimizer": lambda value: [
        *("--optimizer", value["name"], "--lr", str(value["lr"])),
        *("--momentum", str(value["momentum"]), "--weight-decay", str(value["weight_decay"])),
    ],
    "group_sizes": lambda value: ["--group-sizes", ",".join(map(str, value))],
    "faults": lambda value: [arg for text in value for arg in ("--fault", text)],
    # The data stays on the first K agents (K holders of its shards): its name is the
    # job's dataset's (here the model's own, digits), min_local_units the default.
    "data": lambda value: ["--holders", "1", "--labels", value["labels"]],
    "compile": lambda value: ["--compile"] if value else [],
    "diloco": lambda value: [
        *("--diloco", str(value["every"]), "--outer-lr", str(value["outer_lr"])),
        *("--outer-momentum", str(value["outer_momentum"])),
    ],
}
"""Fields whose value takes more than ``--field VALUE``."""


def _job(name: str) -> dict[str, Any]:
    """The job that sends ``name``'s value: the base, what it needs, and the value."""
    assert name in VALUES, f"{name}: give it a valid non-default value in VALUES"
    job = {**BASE, **NEEDS.get(name, {}), name: VALUES[name]}
    return {key: value for key, value in job.items() if value is not None}


def _without(name: str) -> dict[str, Any]:
    """The same job without ``name``'s value: the base's, or none."""
    needs = {key: value for key, value in NEEDS.get(name, {}).items() if value is not None}
    return {**BASE, **needs}


def _spec(job: Mapping[str, Any]) -> JobSpec:
    return JobSpec.model_validate({k: v for k, v in job.items() if k in JobSpec.model_fields})


def _flags(job: Mapping[str, Any]) -> list[str]:
    out = []
    for name, value in job.items():
        if name in TRAIN_FLAGS:
            out += TRAIN_FLAGS[name](value)
        else:
            out += [TRAIN_FLAG_NAMES.get(name, "--" + name.replace("_", "-")), str(value)]
    return out


def _train(job: Mapping[str, Any]) -> LocalTraining:
    """The run ``edgetrain train``'s flags for ``job`` ask for, parsed by the command."""
    context = TRAIN.make_context("train", _flags(job))
    return local_training(context.params)


class Api(JobsApi):
    def submit(self, body: dict[str, Any]) -> JobRecord:
        response = self.client.post("/api/v1/jobs", json=body)
        assert response.status_code == 201, response.text
        record = self.store.get_job(response.json()["id"])
        assert record is not None
        return record


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    with jobs_api(tmp_path / "coord", Api) as api:
        yield api


def test_the_values_cover_exactly_the_fields_of_a_job() -> None:
    assert set(VALUES) == set(JobCreate.model_fields)
    assert set(JobSpec.model_fields) <= set(JobCreate.model_fields)
    assert set(README_BODY_FIELDS) <= set(JobCreate.model_fields)
    assert set(TRAIN_TAKES_NOT) | set(TRAIN_RUN_HOLDS) <= set(JobSpec.model_fields)


def _arrived(record: JobRecord, name: str) -> Any:
    """``name``'s value as the stored job holds it."""
    if name == "devices":
        return record.devices_allowed
    if name == "epochs":  # as the steps of that many passes over the data
        return record.spec["steps"]
    return getattr(JobSpec.model_validate(record.spec), name)


def _expected(name: str, body: Mapping[str, Any]) -> Any:
    if name == "devices":
        return VALUES["devices"]
    if name == "epochs":
        size = len(build_dataset("digits", "train"))  # type: ignore[arg-type]
        return round(VALUES["epochs"] * size / BASE["batch_size"])
    return getattr(_spec(body), name)


@pytest.mark.parametrize("via", ["json", "job.toml"])
@pytest.mark.parametrize("name", sorted(JobCreate.model_fields))
def test_post_jobs_takes_every_field(api: Api, tmp_path: Path, via: str, name: str) -> None:
    body = _job(name)
    if via == "job.toml":  # as edgetrain submit reads it
        path = tmp_path / "job.toml"
        path.write_text(tomli_w.dumps(body))
        body = _read_job(path)
    expected = _expected(name, body)
    assert _arrived(api.submit(body), name) == expected
    assert _arrived(api.submit(_without(name)), name) != expected, f"{name}: a default"


@pytest.mark.parametrize("name", sorted(set(JobSpec.model_fields) - set(TRAIN_TAKES_NOT)))
def test_train_takes_every_field_of_the_job(name: str) -> None:
    job = _job(name)
    where = TRAIN_RUN_HOLDS.get(name, lambda training: getattr(training.spec, name))
    expected = VALUES[name] if name in TRAIN_RUN_HOLDS else getattr(_spec(job), name)
    assert where(_train(job)) == expected
    assert where(_train(_without(name))) != expected, f"{name}: its default was sent"


@pytest.mark.parametrize("name", sorted(TRAIN_TAKES_NOT))
def test_train_has_no_flag_for_what_it_does_not_take(name: str) -> None:
    """Each exception is still true: a flag for it would make it a field to cover."""
    flags = {opt for param in TRAIN.params for opt in param.opts}
    (flag, *_) = _flags({name: VALUES[name]})
    assert flag not in flags, f"train has {flag}: cover {name} and drop its exception"
