"""Control messages: the JSON half of the wire contract, validated by pydantic.

Commands go to a device's ``cmd`` topic (:func:`edge.wire.topics.device_cmd`);
events come back on the job's ``events`` topic; a device's status, profile and
heartbeat go to its own topics. Every message carries a ``type`` field, so one
parse (:func:`parse_command`, :func:`parse_event`) tells them apart and refuses
anything else with a one-line reason. Tensors never travel here: see
:mod:`edge.wire.frames` for the binary frame.

Tested in tests/unit/edge/test_train_config.py (a job's settings refused with the same
message on the wire), tests/unit/edge/models/test_options.py (an assignment refused at
parse is still answerable) and tests/unit/edge/runtime/test_unit_times.py (the timing
command): each message with the code that sends or reads it, not in a file of its own.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from edge.config import (
    BatchSize,
    CodecName,
    DatasetName,
    Microbatches,
    ModelName,
    OptimizerSpec,
    RecvTimeout,
    Replicas,
    ReplicateEvery,
    TrainConfigBase,
    check_batch_split,
)
from edge.errors import describe_validation_error
from edge.wire.timeline import TIMELINE_PATTERN

__all__ = [
    "CancelJob",
    "Command",
    "DeviceStatus",
    "DistGroup",
    "Event",
    "HandOver",
    "Heartbeat",
    "MessageError",
    "OptimizerSpec",
    "StageAssignment",
    "StageDone",
    "StageFailed",
    "StageHeld",
    "StageReady",
    "StartJob",
    "StepReport",
    "Throttle",
    "TimeUnits",
    "UnitTimes",
    "UnitTiming",
    "parse_command",
    "parse_event",
    "parse_unit_times",
    "refused_assignment",
]


MAX_UNITS = 4096
"""Units a :class:`UnitTimes` may list (a zoo model has at most a few hundred)."""
MAX_UNIT_NAME = 128
MAX_UNIT_TIMES_BYTES = 1 << 20
"""The largest :class:`UnitTimes` payload a coordinator reads."""
MAX_TIMED_STEPS = 5
MAX_TIMING_BUDGET_S = 600.0


class MessageError(ValueError):
    """A control message that cannot be used; the text is one line."""


JobId = Annotated[str, Field(min_length=1, max_length=16), Field(pattern=r"^[A-Za-z0-9_-]+$")]


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DistGroup(_Message):
    """Server tier inside a pipeline: the stages in ``ranks`` talk over torch.distributed.

    The coordinator hosts the rendezvous store at ``store_host:store_port``; each
    such stage joins the process group as ``ranks[stage]`` (of ``world_size``),
    and frames between two of them travel over c10d (:mod:`edge.transport.dist`)
    while every other link stays on MQTT.
    """

    store_host: str = Field(min_length=1)
    store_port: int = Field(ge=1, le=65535)
    world_size: int = Field(ge=1)
    ranks: dict[int, int] = Field(min_length=1)
    """Stage -> rank, for the stages in the group."""
    backend: Literal["gloo", "nccl"] = "gloo"
    """``nccl``: GPUs; host frames still use gloo (:mod:`edge.transport.dist`)."""
    timeout_s: float = Field(default=120.0, gt=0)

    @model_validator(mode="after")
    def _check(self) -> DistGroup:
        if sorted(self.ranks.values()) != list(range(self.world_size)):
            raise ValueError(f"ranks {self.ranks} are not 0..{self.world_size - 1} once each")
        return self


class StageAssignment(TrainConfigBase):
    """Everything a device needs to run one stage of a job: the job's training settings
    (:class:`~edge.config.TrainConfigBase`, with the codec per link) and this stage's place."""

    type: Literal["assign"] = "assign"
    job: JobId
    stage: int = Field(ge=0)
    num_stages: int = Field(ge=1)
    start: int = Field(ge=0)
    """First unit of the segment; ``end`` is one past the last."""
    end: int = Field(ge=1)
    dataset: DatasetName
    """Resolved: never absent here (:meth:`~edge.config.TrainConfigBase.resolve_data`)."""
    dataset_options: dict[str, Any] = Field(default_factory=dict)
    codec_in: CodecName = "fp32"
    """Codec of the link to the previous stage (the gradients this stage sends back)."""
    codec_out: CodecName = "fp32"
    """Codec of the link to the next stage (the activations this stage sends)."""
    prev_device: str | None = None
    next_device: str | None = None
    recv_timeout_s: RecvTimeout = 120.0
    first_step: int = Field(default=0, ge=0)
    """The step the stage starts at (below ``steps``); see [Note: the step of a state]."""
    replicate_every: ReplicateEvery = 0
    """Publish the stage's state on ``job_replica`` every this many steps (0: never)."""
    restore: bool = False
    """Load the state retained on ``job_restore`` (for step ``first_step``) before ``ready``."""
    replica: int = Field(default=0, ge=0)
    """Which of ``replicas`` data-parallel copies of the pipeline this stage belongs to."""
    replicas: Replicas = 1
    dist: DistGroup | None = None
    """Set when this stage is in a torch.distributed group with some of its neighbours."""
    member: int = Field(default=0, ge=0)
    """Which member of its stage's group this device is (0 alone)."""
    group_samples: tuple[tuple[int, ...], ...] | None = None
    """Groups: per stage, the samples of each microbatch each member computes, in member
    order (:func:`edge.wire.groups.split_samples`); ``None`` for one device per stage."""
    local_data: str | None = Field(default=None, min_length=1, max_length=64)
    """Stage 0 of a job on data that stays home: read the dataset this device holds under
    this name ([Note: local data] in :mod:`edge.models.local_data`), its own samples
    only, ``group_samples[0][member]`` of every microbatch; ``dataset`` then only names
    what the samples look like."""
    labels_local: bool = False
    """The labels stay home ([Note: labels stay home] in :mod:`edge.runtime.stage`):
    stage 0 sends none, and the last stage, on the same holders, reads each member's
    own labels from its ``local_data``."""
    handover: bool = False
    """Keep the state of the step before the current one, so that a stage stopped by
    :class:`CancelJob` with ``hold`` can hand over the state of a step every stage
    reached ([Note: a group member dies] in :mod:`coordinator.engine.handover`)."""

    @classmethod
    def for_stage(cls, config: TrainConfigBase, **fields: Any) -> StageAssignment:
        """``config``'s training settings with ``fields`` on top: the stage's place, its
        codecs and neighbours, and the dataset and its options resolved
        (:meth:`~edge.config.TrainConfigBase.resolve_data`)."""
        return cls(**{**config.train_settings(), **fields})

    @model_validator(mode="after")
    def _check(self) -> StageAssignment:
        if self.stage >= self.num_stages:
            raise ValueError(f"stage {self.stage} is not below num_stages {self.num_stages}")
        if self.end <= self.start:
            raise ValueError(f"empty segment [{self.start}, {self.end})")
        if self.replica >= self.replicas:
            raise ValueError(f"replica {self.replica} is not below replicas {self.replicas}")
        if self.dist is not None and self.stage not in self.dist.ranks:
            raise ValueError(f"stage {self.stage} has a dist group without a rank in it")
        if self.first_step >= self.steps:
            raise ValueError(f"first_step {self.first_step} is not below steps {self.steps}")
        reader = self.stage == 0 or (self.labels_local and self.is_last)
        if self.local_data is not None and (not reader or self.replicas > 1):
            raise ValueError(
                "only stage 0 (and with labels_local the last), without replicas, reads local data"
            )
        if self.labels_local and (self.is_first or self.is_last) and self.local_data is None:
            raise ValueError("labels_local: the first and last stages need local_data")
        self._check_groups()
        return self

    def _check_groups(self) -> None:
        groups = self.group_samples
        if groups is None:
            if self.member:
                raise ValueError(f"member {self.member} without group_samples")
            return
        n = self.batch_size // (self.microbatches * self.replicas)
        if len(groups) != self.num_stages:
            raise ValueError(f"group_samples has {len(groups)} stages, not {self.num_stages}")
        for s, counts in enumerate(groups):
            if not counts or min(counts) < 1 or sum(counts) != n:
                raise ValueError(
                    f"stage {s}: samples {list(counts)} are not positive counts adding up "
                    f"to the microbatch's {n}"
                )
        if self.member >= len(groups[self.stage]):
            raise ValueError(f"member {self.member} is not in stage {self.stage}'s group")
        if self.replicas > 1 or self.dist is not None:
            raise ValueError("a stage group cannot be combined with replicas or a dist group")

    @property
    def group_size(self) -> int:
        """Members of this stage's group (1 alone)."""
        return 1 if self.group_samples is None else len(self.group_samples[self.stage])

    def samples_of(self, stage: int) -> tuple[int, ...]:
        """Each member's samples of a microbatch on ``stage`` (one member: all of them)."""
        if self.group_samples is None:
            return (self.batch_size // (self.microbatches * self.replicas),)
        return self.group_samples[stage]

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1


class StartJob(_Message):
    """Every stage is ready: start stepping."""

    type: Literal["start"] = "start"
    job: JobId


class CancelJob(_Message):
    type: Literal["cancel"] = "cancel"
    job: JobId
    reason: str = "cancelled"
    hold: bool = False
    """Stop, answer :class:`StageHeld` and keep the stage's state for a :class:`HandOver`."""


class HandOver(_Message):
    """Publish the held stage's state for ``step`` on its replica topic, then let it go."""

    type: Literal["handover"] = "handover"
    job: JobId
    step: int = Field(ge=0)


class Throttle(_Message):
    """Run this device's compute ``slowdown`` times slower than it runs by itself, from now
    on (fault injection; an emulated device's own throttle is multiplied, not replaced)."""

    type: Literal["throttle"] = "throttle"
    slowdown: float = Field(ge=1.0, le=1000.0, allow_inf_nan=False)


class TimeUnits(_Message):
    """Time each unit of ``model`` in a training step on this device, as its stages would
    run it (its threads, its CPU quota, its throttle), and answer :class:`UnitTimes` on
    the device's ``units`` topic (:func:`edge.wire.topics.device_units`): the planner's
    per-device unit seconds ([Note: a device's own unit seconds] in
    :mod:`coordinator.engine.unit_profiles`). Zoo models on their own datasets only
    (or code the device's ``allow_code`` allows); never while a stage is held."""

    type: Literal["time-units"] = "time-units"
    request: JobId
    """Echoed in the answer: which request it answers."""
    model: ModelName
    model_options: dict[str, Any] = Field(default_factory=dict)
    optimizer: OptimizerSpec = OptimizerSpec()
    batch_size: BatchSize
    microbatches: Microbatches = 1
    small_batch_size: BatchSize | None = None
    """Also time the units at this batch (the same ``microbatches``, fewer rows each)."""
    timed_microbatches: Microbatches = 1
    """Microbatches run per timed step (:func:`edge.runtime.unit_times.measure_unit_times`)."""
    steps: int = Field(default=1, ge=1, le=MAX_TIMED_STEPS)
    warmup: int = Field(default=1, ge=0, le=MAX_TIMED_STEPS)
    budget_s: float | None = Field(default=None, gt=0, le=MAX_TIMING_BUDGET_S)
    """Measure no further step once the measured ones took this long (at least one runs):
    ``steps`` is then a most ([Note: several timed steps] in
    :mod:`edge.runtime.unit_times`)."""

    @model_validator(mode="after")
    def _check_shapes(self) -> TimeUnits:
        check_batch_split(self.batch_size, self.microbatches)
        if self.small_batch_size is not None:
            check_batch_split(self.small_batch_size, self.microbatches)
            if self.small_batch_size >= self.batch_size:
                raise ValueError("small_batch_size must be below batch_size")
        if self.timed_microbatches > self.microbatches:
            raise ValueError("timed_microbatches must be at most microbatches")
        return self


Command = Annotated[
    StageAssignment | StartJob | CancelJob | HandOver | Throttle | TimeUnits,
    Field(discriminator="type"),
]


class _Event(_Message):
    job: JobId
    stage: int = Field(ge=0)
    device: str
    member: int = Field(default=0, ge=0)
    """Which member of the stage's group sent it (0 alone)."""
    ts: float = Field(default_factory=time.time, allow_inf_nan=False)


class StageReady(_Event):
    """The stage is built and subscribed; it waits for :class:`StartJob`."""

    type: Literal["ready"] = "ready"
    parameters: int = 0


StepSeconds = Annotated[float, Field(ge=0.0, le=1e9, allow_inf_nan=False)]
"""A step report's duration: finite, not negative, under 31 years. What a device says is
summed and served as JSON (:mod:`coordinator.planner.anatomy`, the metrics routes), where
a non-finite or overflowing figure would break the reply."""
UnixTime = Annotated[float, Field(ge=0.0, le=1e11, allow_inf_nan=False)]
"""A wall-clock instant a report names (Unix seconds; 0: not said)."""


class StepReport(_Event):
    """One step of one stage: what it cost and, on the last stage, the loss."""

    type: Literal["step"] = "step"
    step: int = Field(ge=0)
    loss: float | None = None
    compute_s: StepSeconds = 0.0
    own_compute_s: StepSeconds | None = None
    """The compute seconds the device itself took (``compute_s`` less the time other
    processes held a CPU, where that can be told apart: [Note: a device's own compute
    seconds] in :mod:`edge.runtime.stage`); ``None`` from an agent that does not say."""
    compile_s: StepSeconds = 0.0
    """Seconds ``torch.compile`` took in the step (a job with ``compile: true``: its first
    step), not in ``compute_s`` ([Note: compiled stages] in :mod:`edge.runtime.compiling`)."""
    wait_s: StepSeconds = 0.0
    send_s: StepSeconds = 0.0
    step_s: StepSeconds = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    frames_dropped: int = 0
    replica_bytes: int = 0
    """Size of the state published after this step, for step ``step + 1`` (0: none was)."""
    replica_s: StepSeconds = 0.0
    """Seconds spent serialising and handing over that state."""
    allreduce_s: StepSeconds = 0.0
    """Data parallelism: seconds averaging gradients (and the loss) over the replicas,
    or summing them over the stage's group."""
    samples: int = 0
    """Samples this device ran forward and backward in the step (its group share)."""
    allreduce_bytes: int = 0
    """A group's member: bytes it sent summing the group's gradients (in ``bytes_sent``);
    over torch.distributed, the bytes of the vector it all-reduced (c10d's own traffic)."""
    allreduce_started: UnixTime = 0.0
    """A group's member over MQTT: when its sum started (Unix seconds, 0: no sum), right
    after its last backward. The sum cannot finish before the last member starts its own,
    so ``max(started over the group) - started`` of ``allreduce_s`` is this member's wait
    for the slowest, the rest the transfer (:func:`edge.wire.groups.sum_waits`)."""
    allreduce_cpu_s: StepSeconds = 0.0
    """A group's member over MQTT: CPU seconds its whole process spent during the sum
    (encoding, the client library, TLS, decoding, adding; its network thread included)."""
    allreduce_early_bytes: int = Field(default=0, ge=0)
    """A group's member: bytes of its sum it sent (over torch.distributed, whose
    all-reduce it started) while its last backward still ran ([Note: the sum overlapped
    with the backward] in :mod:`edge.runtime.group_sum`)."""
    actions: str = Field(default="", max_length=65536, pattern=r"^([FBW]\d+( [FBW]\d+)*)?$")
    """The forwards, backwards and weight passes the stage ran in the step, in the order it
    ran them, as a schedule row (``"F0 F1 B0 W0 B1 W1"``:
    :func:`edge.runtime.schedules.format_schedule`); empty from an agent that does not say."""
    peak_held: int = Field(default=0, ge=0)
    """The most microbatches whose forward had run and backward (weight pass, when split)
    had not, at once: how many microbatches' activations the stage held at its peak."""
    started_at: UnixTime = 0.0
    """When the step started here (Unix seconds; 0: an agent that does not say)."""
    timeline: str = Field(default="", max_length=196608, pattern=TIMELINE_PATTERN)
    """When each of the step's blocking waits and sends began and ended, from
    ``started_at`` (:mod:`edge.wire.timeline`); empty from an agent that does not say."""


class StageDone(_Event):
    type: Literal["done"] = "done"
    steps: int = 0
    weights_sha256: str = ""
    """The SHA-256 of the stage's final weights (safetensors bytes): a group's members
    must report the same."""


class StageFailed(_Event):
    type: Literal["failed"] = "failed"
    error: str


class StageHeld(_Event):
    """The stage stopped on a :class:`CancelJob` with ``hold``, holding its state: the
    newest step it finished (``first_step - 1`` if none), so it can hand over the state
    of step ``finished + 1`` and, with ``handover``, of step ``finished``."""

    type: Literal["held"] = "held"
    finished: int = Field(ge=-1)


Event = Annotated[
    StageReady | StepReport | StageDone | StageFailed | StageHeld, Field(discriminator="type")
]


class DeviceStatus(_Message):
    """Retained on a device's ``status`` topic; the last-will says ``offline``."""

    device: str
    state: Literal["online", "offline", "busy"]
    ts: float = Field(default_factory=time.time)
    job: str | None = None
    stage: int | None = None
    version: str = ""


Seconds = Annotated[float, Field(ge=0.0, le=86_400.0, allow_inf_nan=False)]


class UnitTiming(_Message):
    """One unit's median seconds per microbatch (:class:`edge.runtime.unit_times.UnitTime`)."""

    name: str = Field(min_length=1, max_length=MAX_UNIT_NAME)
    fwd_s: Seconds
    bwd_s: Seconds


class UnitTimes(_Message):
    """A device's answer to :class:`TimeUnits`, on its own ``units`` topic: each unit's
    times at ``batch_size`` (``full``) and at ``small_batch_size`` (``small``), or why
    it could not time them (``error``, and no times)."""

    type: Literal["unit-times"] = "unit-times"
    request: JobId
    device: str = Field(min_length=1, max_length=64)
    full: list[UnitTiming] = Field(default_factory=list, max_length=MAX_UNITS)
    small: list[UnitTiming] | None = Field(default=None, max_length=MAX_UNITS)
    error: str | None = Field(default=None, max_length=500)


class Heartbeat(_Message):
    device: str
    ts: float = Field(default_factory=time.time)
    job: str | None = None
    stage: int | None = None
    step: int | None = None


_COMMAND: TypeAdapter[StageAssignment | StartJob | CancelJob | HandOver | Throttle | TimeUnits] = (
    TypeAdapter(Command)
)
_EVENT: TypeAdapter[StageReady | StepReport | StageDone | StageFailed | StageHeld] = TypeAdapter(
    Event
)


def parse_command(
    payload: bytes | str,
) -> StageAssignment | StartJob | CancelJob | HandOver | Throttle | TimeUnits:
    """A command from JSON, or :class:`MessageError` with one line saying what is wrong."""
    try:
        return _COMMAND.validate_json(payload)
    except ValidationError as exc:
        raise MessageError(describe_validation_error(exc, "command")) from None


class _Place(BaseModel):
    """Where an assignment puts its device, read apart from the rest of it."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["assign"]
    job: JobId
    stage: int = Field(ge=0, le=1 << 20)
    member: int = Field(default=0, ge=0, le=1 << 20)


def refused_assignment(payload: bytes | str) -> tuple[str, int, int] | None:
    """The job, stage and member of an assignment :func:`parse_command` refused, when
    those three can still be read: the device then answers ``failed`` with the reason,
    and the coordinator need not wait for an answer that would never come."""
    try:
        place = _Place.model_validate_json(payload)
    except ValidationError:
        return None
    return place.job, place.stage, place.member


def parse_event(
    payload: bytes | str,
) -> StageReady | StepReport | StageDone | StageFailed | StageHeld:
    """An event from JSON, or :class:`MessageError` with one line saying what is wrong."""
    try:
        return _EVENT.validate_json(payload)
    except ValidationError as exc:
        raise MessageError(describe_validation_error(exc, "event")) from None


def parse_unit_times(payload: bytes | str) -> UnitTimes:
    """A :class:`UnitTimes` from JSON, or :class:`MessageError` with one line saying what
    is wrong (payloads over :data:`MAX_UNIT_TIMES_BYTES` are refused unread)."""
    if len(payload) > MAX_UNIT_TIMES_BYTES:
        raise MessageError(f"unit times: {len(payload)} bytes, more than {MAX_UNIT_TIMES_BYTES}")
    try:
        return UnitTimes.model_validate_json(payload)
    except ValidationError as exc:
        raise MessageError(describe_validation_error(exc, "unit times")) from None
