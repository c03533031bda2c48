"""What a job is: :class:`JobSpec`, what to train and how (the plan says where).

A :class:`JobSpec` is :class:`~edge.config.TrainConfig` with the engine's own settings
on top: how the units are split and planned, fault tolerance, and where the data lives
(:class:`DataPlacement`). Also the figures of a job that do not need its plan: the
largest MQTT message it can send (:func:`largest_message_bytes`) and a new job's id.
Its stage assignments are :mod:`coordinator.engine.assignments`'; watching its stages,
:mod:`coordinator.engine.monitor`.

Tested in tests/unit/edge/test_train_config.py (one definition of each setting),
tests/unit/coordinator/engine/test_assignments.py (local labels with fault tolerance)
and tests/unit/coordinator/engine/test_message_bound.py.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Annotated, Any, Literal, Self, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    TypeAdapter,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import PydanticCustomError

from coordinator.engine.faults import FaultText
from edge.config import Microbatches, RecvTimeout, ReplicateEvery, Schedule, TrainConfig

__all__ = [
    "DataPlacement",
    "DeviceName",
    "JobBase",
    "JobSpec",
    "Labels",
    "MicrobatchesOrAuto",
    "Objective",
    "Partition",
    "ScheduleOrAuto",
    "UnitTimes",
    "largest_message_bytes",
    "microbatches_of",
    "new_job_id",
]


Partition = Literal["plan", "even"]
"""How a job's units are split over its devices (:attr:`JobBase.partition`)."""
Objective = Literal["time", "energy"]
"""What the planner minimises for a job (:attr:`JobBase.objective`)."""
UnitTimes = Literal["host", "devices"]
"""Where the cost model's unit seconds come from (:attr:`JobBase.unit_times`)."""
Labels = Literal["central", "local"]
"""Where local data's labels go (:attr:`DataPlacement.labels`)."""


class DataPlacement(BaseModel):
    """Where a job's data lives: ``local``, on the devices that hold it, which form stage
    0's group ([Note: local data] in :mod:`edge.models.local_data`;
    :mod:`coordinator.planner.holders`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """The name the holders registered it under (``edgetrain agent --data NAME=SPEC``)."""
    placement: Literal["local"] = "local"
    min_local_units: int = Field(default=1, ge=1)
    """Units every holder runs on its own samples before anything leaves it."""
    labels: Labels = "central"
    """``local``: the labels never leave their holders either. The last units and the
    loss run on the holders too, each on its own samples (the plan is U-shaped:
    holders, helpers, holders; [Note: labels stay home] in :mod:`edge.runtime.stage`);
    ``central``: the last stage, on a helper, takes the labels from the holders."""

    @property
    def labels_local(self) -> bool:
        return self.labels == "local"


DeviceName = Annotated[str, Field(min_length=1, max_length=128)]
"""A device's id as a job names it. Its bounds make pydantic read it as Unicode text, so a
lone surrogate (``"\\ud800"``, which Python's JSON parser gives) is refused rather than
kept in a job that no JSON response can carry."""


_COUNT: TypeAdapter[int] = TypeAdapter(Microbatches)
_SCHEDULE: TypeAdapter[Schedule] = TypeAdapter(Schedule)


def _or_auto(adapter: TypeAdapter[Any], field: str) -> Callable[[object], Any]:
    """A check that takes ``"auto"``, or a value ``adapter`` takes, refused with the
    adapter's one message, as every shape refuses it (a plain union would give one error
    per arm)."""

    def check(value: object) -> Any:
        if value == "auto":
            return "auto"
        try:
            return adapter.validate_python(value)
        except ValidationError as exc:
            message = exc.errors()[0]["msg"].replace("{", "{{").replace("}", "}}")
            raise PydanticCustomError(field, message) from None

    return check


MicrobatchesOrAuto = Annotated[
    int | Literal["auto"],
    PlainValidator(_or_auto(_COUNT, "microbatches")),
    WithJsonSchema({"anyOf": [_COUNT.json_schema(), {"const": "auto"}]}),
]
"""A job's microbatches: :data:`~edge.config.Microbatches`, or ``"auto"`` (see
:attr:`JobBase.microbatches`)."""

ScheduleOrAuto = Annotated[
    Schedule | Literal["auto"],
    PlainValidator(_or_auto(_SCHEDULE, "schedule")),
    WithJsonSchema({"enum": [*get_args(Schedule), "auto"], "type": "string"}),
]
"""A job's schedule: :data:`~edge.config.Schedule`, or ``"auto"`` (see
:attr:`JobBase.schedule`)."""


class JobBase(TrainConfig):
    """Every field of a job, each defined here once: :class:`~edge.config.TrainConfig`'s,
    with how the job is planned, its fault tolerance and where its data lives on top.

    It checks each field, not how they go together: :meth:`conflict` says that. A
    :class:`JobSpec` refuses a job whose fields conflict; the REST body
    (:class:`~coordinator.service.api.routes.jobs.JobCreate`) builds on this class too,
    and names the field in its 422.
    """

    microbatches: MicrobatchesOrAuto = "auto"  # type: ignore[assignment]
    """Microbatches per step; they divide ``batch_size``. ``auto``: the planner chooses them
    with the plan, weighing the bubble against what each microbatch costs whatever its
    rows ([Note: choosing the microbatches] in :mod:`coordinator.planner.microbatches`);
    the job runs with its plan's number (:meth:`at_microbatches`)."""
    schedule: ScheduleOrAuto = "1f1b"  # type: ignore[assignment]
    """``1f1b``: PipeDream-Flush; ``gpipe``: every forward, then every backward; ``zb-h1``:
    1F1B with each backward split, the weights' gradients filling the bubble ([Note: zero
    bubble] in :mod:`edge.runtime.schedules`); ``auto``: whichever of them the plan's
    simulated step finds fastest among those its devices hold ([Note: choosing the
    schedule] in :mod:`coordinator.engine.engine`); the job runs with it
    (:meth:`at_schedule`)."""
    recv_timeout_s: RecvTimeout = 120.0
    """Seconds a stage waits for one frame before it gives up on the job."""
    pin_first: DeviceName | None = None
    """The device that holds the data and must run stage 0; planning only."""
    partition: Partition = "plan"
    """How the units are split: ``plan``, the planner's best plan; ``even``, the same number
    of units on each device (on the ``stages`` fastest when ``stages`` is given;
    :mod:`coordinator.planner.partition`); planning only."""
    stages: int | None = Field(default=None, ge=1, le=1024)
    """Exactly this many stages (``None``: what the partition gives; with ``plan``, the
    planner's best plan of that many), each on a device or, where the planner places
    groups, a group of devices; planning only. A re-plan over fewer survivors plans as
    many as survive."""
    replicate_every: ReplicateEvery = 0
    """Fault tolerance: replicate every stage's state every R steps (0: off). Such a job
    survives devices dying and the coordinator restarting."""
    group_sizes: tuple[Annotated[int, Field(ge=1, le=1024)], ...] | None = Field(
        default=None, min_length=1, max_length=1024, examples=[[2, 1, 1]]
    )
    """With ``partition="even"``: how many devices each stage runs on, in stage order (their
    sum is the number of devices); a stage of several trains data-parallel, each member
    on a share of every microbatch by its speed ([Note: groups on the wire]). Planning only."""
    objective: Objective = "time"
    """What the planner minimises: the step time, or the energy per step (from the
    devices' power figures: predictions); planning only."""
    max_step_time_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """Only plans whose predicted step time is at most this many seconds; planning only."""
    unit_times: UnitTimes = "host"
    """Where the cost model's seconds of each unit come from: ``host``, the coordinator's
    machine, scaled to each device by its matmul rate; ``devices``, each device times
    the units itself before the job is planned, under its own limits (once per device,
    model and batch shape; [Note: a device's own unit seconds] in
    :mod:`coordinator.engine.unit_profiles`): a slower start, a closer prediction where
    a device differs from the host unit by unit. Planning only."""
    faults: tuple[FaultText, ...] = Field(
        default=(), max_length=32, examples=[["kill:1@8", "slow:0@4:3", "join:laptop@6"]]
    )
    """Faults the service injects into this job, for testing fault tolerance, so only with
    it: ``kill:STAGE@STEP`` (SIGKILL the agent of that stage once STEP is reported;
    ``kill:STAGE.MEMBER@STEP``, a member of its group), ``slow:STAGE@STEP:FACTOR``,
    ``join:PROFILE@STEP`` (a new agent with that catalogue profile;
    :mod:`coordinator.engine.faults`). Kill and join need a testbed coordinator."""
    data: DataPlacement | None = Field(
        default=None, examples=[{"name": "digits", "placement": "local"}]
    )
    """Data that stays home: the job trains on the union of every online holder's local
    dataset of that name (``edgetrain agent --data NAME=SPEC``; its model's dataset then
    only says what samples look like). The holders are stage 0, and only activations
    after ``min_local_units`` units leave them."""

    def at_microbatches(self, microbatches: int) -> Self:
        """This job with ``microbatches`` a step: an ``auto`` job as its plan runs it."""
        if self.microbatches != "auto":
            return self
        return self.model_copy(update={"microbatches": microbatches})

    @property
    def training(self) -> str:
        """``exact`` (a step equals single-device training), or what makes it non-exact."""
        if self.diloco is None:
            return "exact"
        return f"non-exact: DiLoCo, a stage group syncs every {self.diloco.every} steps"

    def at_schedule(self, schedule: Schedule) -> Self:
        """This job under ``schedule``: an ``auto`` job as its plan runs it."""
        if self.schedule != "auto":
            return self
        return self.model_copy(update={"schedule": schedule})

    def conflict(self) -> tuple[tuple[str, ...], str] | None:
        """The first of this job's fields that cannot go with the others, as ``(where,
        why)``: the field to name (a field of ``data``: its path) and why; ``None`` when
        they all go together."""
        sizes = self.group_sizes
        if sizes is not None:
            if self.partition != "even":
                return ("group_sizes",), "group_sizes needs partition even"
            if self.stages is not None and self.stages != len(sizes):
                why = f"stages={self.stages}, but group_sizes has {len(sizes)} stages"
                return ("group_sizes",), why
        if self.diloco is not None and (self.replicate_every or self.faults):
            why = "diloco cannot be combined with fault tolerance yet (replicate_every, faults)"
            return ("diloco",), why
        if self.diloco is not None and self.data is not None and self.data.labels_local:
            return ("diloco",), 'diloco cannot be combined with labels "local" yet'
        data = self.data
        if data is None:
            return None
        if data.labels_local and (self.replicate_every or self.faults):
            why = 'labels "local" cannot be combined with fault tolerance yet'
            why += " (replicate_every, faults)"
            return ("data", "labels"), why
        if self.partition != "plan" or sizes is not None:
            return ("data",), "local data needs partition plan: the holders are stage 0"
        if self.pin_first is not None:
            return ("data",), "local data places stage 0 on its holders: no pin_first"
        return None


class JobSpec(JobBase):
    """What to train and how (see :class:`JobBase`), its fields going together; the plan
    says where."""

    @model_validator(mode="after")
    def _fields_go_together(self) -> JobSpec:
        found = self.conflict()
        if found is not None:
            raise ValueError(found[1])
        return self


def microbatches_of(spec: JobBase) -> int:
    """``spec``'s microbatches a step; :class:`ValueError` for an ``auto`` job, which runs
    with its plan's (:meth:`JobBase.at_microbatches`)."""
    if isinstance(spec.microbatches, int):
        return spec.microbatches
    raise ValueError('microbatches "auto" is chosen with the plan: plan the job first')


_MQTT_MAX = 268_435_455  # MQTT's own limit on one packet


def largest_message_bytes(spec: JobSpec) -> int:
    """An upper bound on any one MQTT message of ``spec``, for a broker started for it.

    The largest is either a tensor frame (one microbatch's activations or gradients
    after any unit, at fp32) or a stage's state (its weights with the optimizer's state,
    at most two more copies of them: AdamW), each bounded here by the whole model's;
    with a margin for headers and metadata. MQTT's own limit when the model cannot be
    profiled here.
    """
    from edge.models.unit_costs import profile_model
    from edge.models.zoo import get_model

    try:
        model = get_model(spec.model, seed=spec.seed, **spec.model_options)
        m = 1 if spec.microbatches == "auto" else microbatches_of(spec)  # auto: at most all
        microbatch = max(1, spec.batch_size // m)
        units = profile_model(model, microbatch, timing=False).units
    except Exception:  # a user model that will fail later, with its own message
        return _MQTT_MAX
    frame = max(u.out_bytes for u in units)
    state = 3 * sum(u.param_bytes for u in units)
    return min(_MQTT_MAX, int(1.25 * max(frame, state)) + (1 << 20))


def new_job_id() -> str:
    return "j" + secrets.token_hex(6)
