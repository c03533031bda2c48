"""``/api/v1/jobs``: submit, list, inspect, cancel; metrics, weights and ONNX of a job.

The body (:class:`JobCreate`) is the job's fields, each defined once in
:class:`coordinator.engine.spec.JobBase` (the training settings among them are
:class:`edge.config.TrainConfig`'s), with the API's own on top; the route builds the
engine's :class:`~coordinator.engine.spec.JobSpec` from it (a field that cannot go
with the others is a 422 naming it). Its model and dataset must be the zoo's
and built-in (a ``package.module:function`` would run code the client chose on every
device). Both are checked by building them before the job is queued, the model with its
options and the dataset with its own, so an unknown name or a bad (or out-of-bounds:
[Note: bounded zoo options]) option is a 422 naming ``model``, ``dataset`` or
``dataset_options``.

A job may carry ``faults`` to inject (for testing fault tolerance; the forms of
:mod:`coordinator.engine.faults`): each is checked when the job is submitted, against
the job (its step below ``steps``) and against what this coordinator can do
(``kill`` and ``join`` need a testbed coordinator), and a refused one is a 422
naming it. Faults imply fault tolerance: without ``replicate_every`` a job with
faults replicates every ``max(1, steps // 10)`` steps.

``partition`` and ``stages`` shape the plan (:mod:`coordinator.planner.partition`):
a ``stages`` above the model's units, or above the devices the job allows, is a
422 naming ``stages``; one above the devices online when the job is planned
fails the job with that reason. ``group_sizes`` (with ``partition`` ``even``)
runs stage ``s`` on a group of ``group_sizes[s]`` devices: positive, one per
stage (no more than the model's units), adding up to the devices the job allows
when it names them (else to the devices online when it is planned, or the job
fails); anything else is a 422 naming ``group_sizes``. With fault tolerance, a
group member that dies is survived by its co-members without a rollback.

Tested in tests/unit/coordinator/service/api/routes/test_job_routes.py,
tests/unit/edgetrain/cli/test_job_fields.py (every job field through the body) and
tests/e2e/test_api.py.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Response
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from coordinator.engine.faults import FaultActuator, parse_fault
from coordinator.engine.spec import DeviceName, JobBase, JobSpec
from coordinator.service.api.deps import ManagerDep, ReadAuth, RegistryDep, StoreDep, WriteAuth
from coordinator.service.api.routes.errors import (
    AUTH,
    CONFLICT,
    NOT_FOUND,
    NOT_IMPLEMENTED,
    unprocessable,
)
from coordinator.service.registry import DeviceRegistry
from coordinator.service.store.sqlite import JobRecord
from edge.config import BatchSize, ReplicateEvery, Steps
from edge.errors import UserError, describe_validation_error
from edge.models.datasets import DATASETS, build_dataset
from edge.models.zoo import get_model
from edge.runtime.data import check_data_fits

__all__ = ["router"]

router = APIRouter(prefix="/jobs", tags=["jobs"], responses=AUTH)


class JobCreate(JobBase):
    """A training job: the job's fields (:class:`~coordinator.engine.spec.JobBase`, each
    defined there once), with the API's own on top: ``epochs`` (give ``steps`` or
    ``epochs``), the ``devices`` the job may use, its own defaults, and what a client
    may not ask for (a user's model or dataset)."""

    steps: Steps | None = None  # type: ignore[assignment]  # or epochs: resolved by the route
    epochs: float | None = Field(default=None, gt=0, le=10_000)
    batch_size: BatchSize = 32
    devices: list[DeviceName] | None = None
    """Devices the job may use (all online devices when absent)."""
    replicate_every: ReplicateEvery | None = None  # type: ignore[assignment]  # resolved too
    """Replicate every stage's state every R steps (0 or absent: off, but absent with
    faults means every max(1, steps // 10) steps): the job then survives devices
    dying and a coordinator restart."""

    @field_validator("model")
    @classmethod
    def _zoo_only(cls, value: str) -> str:
        return zoo_model_name(value)

    @field_validator("dataset")
    @classmethod
    def _built_in_only(cls, value: str | None) -> str | None:
        # As for models: every device would import and call code the client chose.
        if value is not None and ":" in value:
            raise ValueError(
                "user datasets (package.module:function) are accepted only from the "
                "command line; name a built-in dataset"
            )
        return value

    @model_validator(mode="after")
    def _check(self) -> JobCreate:
        if (self.steps is None) == (self.epochs is None):
            raise ValueError("give exactly one of steps and epochs")
        if self.faults and self.replicate_every == 0:
            raise ValueError(
                "faults need fault tolerance: give replicate_every > 0 or leave "
                "it out for the default"
            )
        return self


class JobPublic(JobRecord):
    """A job as the API shows it: the stored record and its latest step's metrics."""

    latest: dict[str, Any] | None = None


class JobsPublic(BaseModel):
    data: list[JobPublic]
    count: int


def zoo_model_name(value: str) -> str:
    """A model named over the API must be from the zoo: ``package.module:function``
    would import and call code the client chose, so it is for the command line only."""
    if ":" in value:
        raise ValueError(
            "user models (package.module:function) are accepted only from the "
            "command line; name a zoo model"
        )
    return value


def _public(record: JobRecord, latest: dict[str, Any] | None = None) -> JobPublic:
    return JobPublic(**record.model_dump(), latest=latest)


def _job_or_404(store: Any, job_id: str) -> JobRecord:
    record = store.get_job(job_id) if len(job_id) <= 16 else None
    if record is None:
        raise HTTPException(404, f"no job {job_id!r}")
    return record


@router.post("", response_model=JobPublic, status_code=201, dependencies=[WriteAuth])
def create_job(
    body: JobCreate, store: StoreDep, manager: ManagerDep, registry: RegistryDep
) -> JobPublic:
    """Queue a job; it is planned over the online devices when its turn comes."""
    try:
        model = get_model(body.model, **body.model_options)
        dataset, options = body.resolve_data()
    except UserError as exc:
        raise unprocessable(["body", "model"], exc.message) from None
    given = body.dataset_options is not None and dataset in DATASETS
    data_field = "dataset_options" if given else "dataset"
    try:  # checked here, as the model is, not on the devices; and the size for epochs
        data = build_dataset(dataset, "train", **options)
    except UserError as exc:
        raise unprocessable(["body", data_field], exc.message) from None
    size = len(data)  # type: ignore[arg-type]
    steps = body.steps or max(1, round((body.epochs or 1) * size / body.batch_size))
    replicate_every = body.replicate_every
    if replicate_every is None:
        replicate_every = max(1, steps // 10) if body.faults else 0
    conflict = body.conflict()  # as the spec would refuse it, but naming the field
    if conflict is not None:
        raise unprocessable(["body", *conflict[0]], conflict[1])
    _check_groups(body, model.num_units)
    _check_data(body, model.num_units)
    fields = body.model_dump(include=set(JobSpec.model_fields))  # the job's, REST's own left
    resolved = {
        "dataset": dataset,
        "dataset_options": options,
        "steps": steps,
        "replicate_every": replicate_every,
    }
    try:
        spec = JobSpec(**(fields | resolved))
    except ValidationError as exc:  # only steps is new here: too many epochs
        raise unprocessable(["body", "epochs"], describe_validation_error(exc, "job")) from None
    _check_stages(body, model.num_units)
    _check_faults(body, steps, manager.actuator)
    if body.data is None:
        _check_data_memory(body, data, dataset, registry, data_field)
    job = manager.submit(spec, body.devices)
    return _public(_job_or_404(store, job))


def _check_data_memory(
    body: JobCreate, data: Any, name: str, registry: DeviceRegistry, field: str
) -> None:
    """A 422 naming ``field`` when the data stage 0 reads ([Note: options are data];
    :func:`edge.runtime.data.data_bytes`) needs more memory than any device that may run
    stage 0 announces: ``pin_first``, else the devices the job may use, else every
    known device. With none known yet, the device given stage 0 refuses it itself."""
    may = {body.pin_first} if body.pin_first is not None else body.devices
    memory = [
        float(d.profile.get("memory_bytes") or 0)
        for d in registry.devices()
        if d.profile is not None and (may is None or d.id in may)
    ]
    if not memory:
        return
    whose = "any device that may run its stage 0 announces"
    try:
        check_data_fits(data, name, int(max(memory)), whose)
    except UserError as exc:
        raise unprocessable(["body", field], exc.message) from None


def _check_data(body: JobCreate, units: int) -> None:
    """A 422 naming ``data`` when a job on local data asks for what this model and the API
    cannot give it (what its other fields cannot go with is :meth:`JobBase.conflict`'s)."""
    data = body.data
    if data is None:
        return
    why = None
    if body.epochs is not None:
        why = "local data needs steps, not epochs: its size is the holders' sum"
    elif data.min_local_units > units:
        why = (
            f"min_local_units {data.min_local_units} is more than the {units} units of {body.model}"
        )
    if why is not None:
        raise unprocessable(["body", "data"], why)


def _check_stages(body: JobCreate, units: int) -> None:
    """A 422 naming ``stages`` when no plan of that many stages can exist for this job."""
    if body.stages is None:
        return
    if body.stages > units:
        why = f"stages={body.stages} is more than the {units} units of {body.model}"
        raise unprocessable(["body", "stages"], why)
    if body.devices is not None and body.stages > len(set(body.devices)):
        why = f"stages={body.stages} is more than the {len(set(body.devices))} devices allowed"
        raise unprocessable(["body", "stages"], why)


def _check_groups(body: JobCreate, units: int) -> None:
    """A 422 naming ``group_sizes`` when this model, or the devices the job allows, cannot
    run on those groups (what its other fields cannot go with is :meth:`JobBase.conflict`'s)."""
    sizes = body.group_sizes
    if sizes is None:
        return
    why = None
    allowed = len(set(body.devices)) if body.devices is not None else None
    if len(sizes) > units:
        why = f"group_sizes has {len(sizes)} stages, more than the {units} units of {body.model}"
    elif allowed is not None and sum(sizes) != allowed:
        why = f"group_sizes adds up to {sum(sizes)} devices, but the job allows {allowed}"
    if why is not None:
        raise unprocessable(["body", "group_sizes"], why)


def _check_faults(body: JobCreate, steps: int, actuator: FaultActuator) -> None:
    """A 422 naming the first fault that cannot happen in this job on this coordinator."""
    for i, text in enumerate(body.faults):
        fault = parse_fault(text, "fault")
        why: str | None
        if fault.step >= steps:
            why = f"step {fault.step} is not below the job's {steps} steps"
        elif fault.kind != "join" and body.stages is not None and fault.stage >= body.stages:
            why = f"stage {fault.stage} is not below the job's {body.stages} stages"
        elif fault.kind != "join" and body.devices is not None and fault.stage >= len(body.devices):
            why = f"stage {fault.stage} is not below the {len(body.devices)} devices allowed"
        else:
            why = actuator.refusal(fault)
        if why is not None:
            raise unprocessable(["body", "faults", i], f"fault {text!r}: {why}")


@router.get("", response_model=JobsPublic, dependencies=[ReadAuth])
def list_jobs(
    store: StoreDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=2**62)] = 0,
) -> JobsPublic:
    data = [_public(r) for r in store.list_jobs(limit=limit, offset=offset)]
    return JobsPublic(data=data, count=store.count_jobs())


@router.get("/{job_id}", response_model=JobPublic, dependencies=[ReadAuth], responses=NOT_FOUND)
def get_job(job_id: str, store: StoreDep) -> JobPublic:
    record = _job_or_404(store, job_id)
    steps = store.job_steps(job_id, from_step=max(0, record.steps_done - 1))
    latest = max(steps, key=lambda r: (r.step, r.stage)).model_dump() if steps else None
    return _public(record, latest)


@router.post(
    "/{job_id}/cancel",
    response_model=JobPublic,
    dependencies=[WriteAuth],
    responses={**NOT_FOUND, **CONFLICT},
)
def cancel_job(job_id: str, store: StoreDep, manager: ManagerDep) -> JobPublic:
    _job_or_404(store, job_id)
    if not manager.cancel(job_id):
        raise HTTPException(409, f"job {job_id} has already ended")
    return _public(_job_or_404(store, job_id))


@router.get("/{job_id}/metrics", dependencies=[ReadAuth], responses=NOT_FOUND)
def job_metrics(
    job_id: str,
    store: StoreDep,
    since_step: Annotated[
        int | None,
        Query(
            ge=0,
            le=2**62,
            description="Only the steps after this one (a poll asks for what is new).",
        ),
    ] = None,
) -> dict[str, Any]:
    """Per step: loss, samples/s, and per stage compute, wait and bytes; all steps, or
    with ``since_step`` only the later ones."""
    record = _job_or_404(store, job_id)
    batch = int(record.spec.get("batch_size", 0))
    steps: dict[int, dict[str, Any]] = {}
    first = 0 if since_step is None else since_step + 1
    for r in store.job_steps(job_id, from_step=first):
        row = steps.setdefault(r.step, {"step": r.step, "loss": None, "stages": []})
        if r.loss is not None:
            row["loss"] = r.loss
            row["samples_per_s"] = batch / r.step_s if r.step_s > 0 else None
        row["stages"].append(
            {
                "stage": r.stage,
                "device": r.device,
                "compute_s": r.compute_s,
                "wait_s": r.wait_s,
                "send_s": r.send_s,
                "step_s": r.step_s,
                "bytes_sent": r.bytes_sent,
                "bytes_received": r.bytes_received,
            }
        )
    return {"job": job_id, "steps": [steps[k] for k in sorted(steps)]}


@router.get("/{job_id}/anatomy", dependencies=[ReadAuth], responses=NOT_FOUND)
def job_anatomy(job_id: str, store: StoreDep) -> dict[str, Any]:
    """Where the job's step goes, per stage member: ``predicted`` for its plan, and
    ``measured`` over its steps so far (the mean, and over how many ``steps``), each in
    the parts of :mod:`coordinator.planner.anatomy` (``null`` until there is one)."""
    record = _job_or_404(store, job_id)
    predicted = (record.plan or {}).get("anatomy")
    return {"job": job_id, "predicted": predicted, "measured": store.job_anatomy(job_id)}


class LinksCreate(BaseModel):
    """The link rates to plan a job at, Mbit/s each way, every device's link at each
    (default: 1000, 300, 100, 30, 10, 3 and 1)."""

    model_config = {"extra": "forbid"}

    mbps: list[Annotated[float, Field(ge=0.01, le=1e6, allow_inf_nan=False)]] | None = Field(
        default=None, min_length=1, max_length=16, examples=[[100, 30, 10]]
    )


@router.post(
    "/{job_id}/links",
    dependencies=[WriteAuth],
    responses={**NOT_FOUND, **CONFLICT},
)
def job_links(
    job_id: str, store: StoreDep, manager: ManagerDep, body: LinksCreate = LinksCreate()
) -> dict[str, Any]:
    """A job on local data planned again with every link at each rate, over the
    devices online now (:mod:`coordinator.engine.links`; nothing runs): per rate
    (``ladder``) whether the plan still hands units to helpers, its links' codecs, its
    predicted samples/s beside the holders alone, and the share of its step on links;
    and ``split_stops_paying_below_mbps``, the rate below which the holders train
    alone (``0``: never, ``null``: not even at the fleet's own). Planning profiles the
    model here, so it needs the write token, as ``/api/v1/plans`` does. A job on no
    local data, or with no holder online, is a 409."""
    _job_or_404(store, job_id)
    try:
        return manager.links(job_id, body.mbps)
    except UserError as exc:
        raise HTTPException(409, exc.message) from None


@router.get("/{job_id}/events", dependencies=[ReadAuth], responses=NOT_FOUND)
def job_events(job_id: str, store: StoreDep) -> dict[str, Any]:
    """What happened to the job, in order: state changes, attempts, failures (with the
    time each was detected), recoveries, migrations."""
    _job_or_404(store, job_id)
    events = [{"ts": e.ts, "kind": e.kind, "detail": e.detail} for e in store.job_events(job_id)]
    return {"job": job_id, "events": events}


def _download(data: bytes, filename: str) -> Response:
    disposition = f'attachment; filename="{filename}"'
    return Response(
        data, media_type="application/octet-stream", headers={"Content-Disposition": disposition}
    )


def _weights(store: Any, job_id: str) -> bytes:
    record = _job_or_404(store, job_id)
    path = store.model_path(job_id)
    if record.state != "completed" or not path.exists():
        raise HTTPException(409, f"job {job_id} has no trained model (state {record.state})")
    data: bytes = path.read_bytes()
    return data


@router.get("/{job_id}/model", dependencies=[ReadAuth], responses={**NOT_FOUND, **CONFLICT})
def job_model(job_id: str, store: StoreDep) -> Response:
    """The trained weights (safetensors; keys are unit-prefixed)."""
    return _download(_weights(store, job_id), f"{job_id}.safetensors")


@router.get(
    "/{job_id}/model.onnx",
    dependencies=[ReadAuth],
    responses={**NOT_FOUND, **CONFLICT, **NOT_IMPLEMENTED},
)
def job_model_onnx(job_id: str, store: StoreDep) -> Response:
    """The trained model exported to ONNX (checked by onnx.checker); 501 on a coordinator
    installed without the ``export`` extra."""
    from coordinator.service.export import export_onnx
    from edge.errors import MissingExtraError

    spec = _job_or_404(store, job_id).spec
    weights = _weights(store, job_id)
    try:
        onnx = export_onnx(spec["model"], weights, model_options=spec.get("model_options") or {})
    except MissingExtraError as exc:
        raise HTTPException(501, exc.message) from None
    return _download(onnx, f"{job_id}.onnx")
