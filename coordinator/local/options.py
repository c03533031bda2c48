"""How a job is trained on this machine: :class:`LocalTraining`, what ``edgetrain train`` runs.

It holds the job (a :class:`~coordinator.engine.spec.JobSpec`, which checks its own
fields) and how the job runs here: on which transport, over how many devices and
which catalogue devices they emulate, with which server tier, data holders and fault
tolerance. Its checks relate those settings to each other and to the job's figures.

Every refusal is a one-line :class:`~edge.errors.UserError`. The checks here name the
command's flags (``--batch-size``, not ``batch_size``) and come before the job's own
(``train: field: what is wrong``), as the flags shape the job; those of the faults and
of where the units are timed need the valid job, and come after. Only a setting of the
wrong type or out of range is a pydantic ``ValidationError`` (which the command's
parser refuses first).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from coordinator.engine.faults import Fault, parse_fault
from coordinator.engine.options import Tolerance
from coordinator.engine.spec import JobSpec
from coordinator.local.choices import Labels, TorchDevice, Transport
from edge.config import Replicas, ReplicateEvery
from edge.errors import UserError, describe_validation_error

__all__ = ["LocalTraining"]


class LocalTraining(BaseModel):
    """A job and how it trains on this machine (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    transport: Transport = "mqtt"
    """``mqtt``: agent processes over a broker, driven by the job engine as the service
    drives a fleet; ``inprocess``: threads of this process; ``dist``: the server tier."""
    devices: int = Field(default=3, ge=1)
    """How many devices: agents, threads or ranks (``devices == 1``: the single-device
    reference, one stage)."""
    profiles: tuple[str, ...] | None = None
    """Catalogue profiles, one per device: agents emulate them (each announces its profile
    and runs slowed to its speed) and plans follow their speeds; in process they only
    shape the plan."""
    replicas: Replicas = 1
    """``dist``: data-parallel copies of the pipeline (they divide ``devices``)."""
    device: TorchDevice = "cpu"
    """``dist``: what each rank computes on; ``mqtt``: what the server tier's agents do."""
    servers: int = Field(default=0, ge=0)
    """``mqtt``: the last this many agents are a server tier (a hybrid pipeline: frames
    between servers go over torch.distributed)."""
    holders: int = Field(default=0, ge=0)
    """``mqtt``: the first this many agents each hold a shard of the job's dataset, which
    stays there: the job trains on their union (the spec's ``data``, placed on them)."""
    labels: Labels = "central"
    """With ``holders``: whether the labels go to the last stage or stay home too."""
    broker: str | None = None
    """``mqtt``: the broker's URL; ``None``: one is started."""
    threads: int | None = Field(default=None, ge=1)
    """torch threads per agent or rank (default: cores / devices)."""
    faults: tuple[str, ...] = ()
    """Faults to inject (the forms of :func:`~coordinator.engine.faults.parse_fault`)."""
    replicate_every: ReplicateEvery | None = None
    """Fault tolerance: replicate every stage's state every this many steps (0: off);
    ``None``: off, or with ``faults`` as often as the plan's costs allow
    (:meth:`~coordinator.engine.engine.JobEngine.replication`)."""
    heartbeat_timeout_s: float = Field(default=3.0, gt=0, allow_inf_nan=False)
    """Seconds without a heartbeat before an agent is dead (its last will is quicker)."""
    rebalance: bool = True
    """With fault tolerance: migrate to a faster plan when measured stage times say so."""
    spec: JobSpec
    """The job. Last: its checks come after the run's own, and it may get its ``data``
    from ``holders``."""

    @field_validator("profiles")
    @classmethod
    def _known_profiles(cls, profiles: tuple[str, ...] | None) -> tuple[str, ...] | None:
        from edge.profiling.catalog import resolve

        for name in profiles or ():
            resolve(name)  # an unknown profile fails here, with its own one-line message
        return profiles

    @field_validator("spec", mode="before")
    @classmethod
    def _fits_the_run(cls, job: Any, info: ValidationInfo) -> Any:
        """The run's settings together and with the job's figures, before the job's own
        checks; then the job's data on the holders."""
        given = info.data
        if len(given) < len(cls.model_fields) - 1:  # a setting is invalid: its error says so
            return job
        _check(given, job)
        if given["holders"] and isinstance(job, Mapping) and job.get("data") is None:
            job = {**job, "data": {"name": _holders_data(job), "labels": given["labels"]}}
        try:
            return JobSpec.model_validate(job)
        except ValidationError as exc:  # the job's own fields, named as the command names them
            raise UserError(describe_validation_error(exc, "train")) from None

    @model_validator(mode="after")
    def _fits_the_job(self) -> LocalTraining:
        faults = self.fault_list
        if self.spec.unit_times == "devices" and self.transport != "mqtt":
            raise UserError(
                "--unit-times devices needs --transport mqtt (agents to time the units)"
            )
        from coordinator.engine.engine import JobEngine

        if JobEngine.fault_tolerant(self.spec, self.tolerance) and self.transport != "mqtt":
            raise UserError("--fault and --replicate-every need --transport mqtt (agents to lose)")
        for f in faults:
            if f.kind == "join":
                from edge.profiling.catalog import resolve

                resolve(f.profile or "")  # an unknown profile fails here, before anything starts
            if f.stage >= (self.spec.stages or self.devices) or f.step >= self.spec.steps:
                raise UserError(
                    f"--fault {f}: stage must be below --stages (else --devices) and step "
                    "below --steps"
                )
        return self

    @property
    def fault_list(self) -> tuple[Fault, ...]:
        """:attr:`faults`, parsed."""
        return tuple(parse_fault(text) for text in self.faults)

    @property
    def tolerance(self) -> Tolerance:
        """What the job's run is told of fault tolerance."""
        return Tolerance(
            replicate_every=self.replicate_every, faults=self.fault_list, rebalance=self.rebalance
        )


def _check(run: Mapping[str, Any], job: Any) -> None:
    """The run's settings (``run``: them, validated, by name) together and with the job's
    figures that they bound: its device groups, stages and batch split (a figure of the
    wrong type is left to the job's own checks)."""
    transport, devices, replicas = run["transport"], run["devices"], run["replicas"]
    servers, holders, faults, profiles = (
        run["servers"],
        run["holders"],
        run["faults"],
        run["profiles"],
    )
    sizes = _figure(job, "group_sizes")
    if not (isinstance(sizes, list | tuple) and all(isinstance(n, int) for n in sizes)):
        sizes = None
    if sizes and sum(sizes) != devices:
        text = ",".join(str(n) for n in sizes)
        raise UserError(f"--group-sizes {text} adds up to {sum(sizes)}, not --devices {devices}")
    if sizes and _figure(job, "partition") != "even":
        raise UserError("--group-sizes needs --partition even")
    if profiles and len(profiles) != devices:
        raise UserError(f"--devices: {len(profiles)} profiles for {devices} devices")
    if profiles and transport == "dist":
        raise UserError("--devices with profiles is for --transport mqtt or inprocess")
    if sizes and (replicas > 1 or servers):
        raise UserError("--group-sizes runs without --replicas or --servers")
    if holders and (transport != "mqtt" or holders > devices or sizes or servers):
        raise UserError(
            "--holders K needs --transport mqtt, K <= --devices, and no --group-sizes or --servers"
        )
    if run["labels"] == "local" and not holders:
        raise UserError("--labels local needs --holders (data that stays home)")
    if run["labels"] == "local" and (faults or run["replicate_every"]):
        raise UserError("--labels local cannot be combined with --fault or --replicate-every yet")
    if transport != "dist" and replicas > 1:
        raise UserError("--replicas is for --transport dist")
    if transport != "dist" and run["device"] != "cpu" and not servers:
        raise UserError("--device is for --transport dist, or --servers' agents")
    if servers and (transport != "mqtt" or servers > devices):
        raise UserError("--servers K needs --transport mqtt and K <= --devices")
    if servers and faults:
        raise UserError("--servers and --fault cannot be combined yet")
    if devices % replicas:
        raise UserError(f"--devices {devices} is not a multiple of --replicas {replicas}")
    stages = _figure(job, "stages")
    if isinstance(stages, int) and stages > devices // replicas:
        per = "" if replicas == 1 else f" / --replicas {replicas}"
        raise UserError(f"--stages {stages} is more than --devices {devices}{per}")
    batch, microbatches = _figure(job, "batch_size"), _figure(job, "microbatches")
    if replicas > 1 and microbatches == "auto":
        raise UserError("--replicas needs a number of --microbatches (auto plans one pipeline)")
    if isinstance(microbatches, str) and microbatches.isdigit():  # as the flag gives it
        microbatches = int(microbatches)
    split = isinstance(batch, int) and isinstance(microbatches, int) and microbatches > 0
    if split and batch % (microbatches * replicas):  # the job's own check knows no replicas
        raise UserError(f"--batch-size {batch} is not a multiple of --microbatches x --replicas")


def _figure(job: Any, name: str) -> Any:
    """The job's ``name``, given (a mapping) or validated (a spec); else its default."""
    if isinstance(job, Mapping):
        return job.get(name, JobSpec.model_fields[name].default)
    return getattr(job, name, None)


def _holders_data(job: Mapping[str, Any]) -> str:
    """The dataset the holders shard: the job's, else its model's own."""
    if job.get("dataset") is not None:
        return str(job["dataset"])
    from edge.models.zoo import get_model

    return get_model(job["model"], **(job.get("model_options") or {})).dataset
