"""TrainConfig: every setting a job trains with, each validated here once.

A job's settings travel through four shapes: the REST body a client posts
(``JobCreate``), the coordinator engine's job spec (``JobSpec``), the MQTT stage
assignment a device receives (:class:`edge.wire.messages.StageAssignment`) and the
server tier's job file (:class:`edge.server.job_file.DistJob`). Each builds on
:class:`TrainConfig` (the assignment on :class:`TrainConfigBase`, since its codec is
per link), adding only what is its own, so a setting has one type and one check,
and a bad value is refused with the same message whichever way it came in.

The field types below are also for the settings some of those shapes carry and
others do not (data-parallel ``replicas``, state replication every
``replicate_every`` steps, the frame ``recv_timeout_s``): each is declared by the
shapes that run with it, with the one type defined here.

Tested in tests/unit/edge/test_train_config.py (one definition, one message, whichever
shape) and tests/unit/edge/models/test_options.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from edge.errors import UserError

__all__ = [
    "LINK_CODECS",
    "BatchSize",
    "CodecChoice",
    "CodecName",
    "DatasetName",
    "DiLoCo",
    "Microbatches",
    "ModelName",
    "OptimizerName",
    "OptimizerSpec",
    "Precision",
    "RecvTimeout",
    "Replicas",
    "ReplicateEvery",
    "Schedule",
    "Seed",
    "Steps",
    "TrainConfig",
    "TrainConfigBase",
    "check_batch_split",
    "check_model_options_field",
]

LINK_CODECS = ("fp32", "fp16", "bf16", "int8")
"""What one link may carry (:class:`edge.wire.frames.Codec`), most precise first."""


def _link_codec(value: str) -> str:
    name = value.lower()
    if name not in LINK_CODECS:
        raise ValueError(
            f"unknown codec {value!r}: a link takes fp32, fp16, bf16 or int8 "
            "(a job may also say auto)"
        )
    return name


def _codec_choice(value: str) -> str:
    return "auto" if value.lower() == "auto" else _link_codec(value)


ModelName = Annotated[str, Field(min_length=1)]
"""A zoo model, or ``package.module:function`` (a user model)."""
DatasetName = Annotated[str, Field(min_length=1)]
"""A built-in dataset, or ``package.module:function`` (a user dataset)."""
Steps = Annotated[int, Field(ge=1, le=1_000_000)]
BatchSize = Annotated[int, Field(ge=1, le=65_536)]
Microbatches = Annotated[int, Field(ge=1, le=1024)]
Schedule = Literal["1f1b", "gpipe", "zb-h1"]
Precision = Literal["fp32", "bf16"]
OptimizerName = Literal["sgd", "adamw"]
Seed = Annotated[int, Field(ge=0, le=2**31)]
CodecName = Annotated[
    str, AfterValidator(_link_codec), Field(json_schema_extra={"enum": list(LINK_CODECS)})
]
"""One link's codec, any case, kept lower-case."""
CodecChoice = Annotated[
    str,
    AfterValidator(_codec_choice),
    Field(json_schema_extra={"enum": [*LINK_CODECS, "auto"]}),
]
"""A job's codec: one for every link, or ``auto`` (the planner picks each link's)."""
Replicas = Annotated[int, Field(ge=1)]
"""Data-parallel copies of the pipeline; each trains on ``1/replicas`` of every batch."""
ReplicateEvery = Annotated[int, Field(ge=0, le=100_000)]
"""Publish every stage's state every this many steps, for fault tolerance (0: never)."""
RecvTimeout = Annotated[float, Field(gt=0, le=86_400)]
"""Seconds a stage waits for one frame before it gives up on the job."""


def check_model_options_field(model: str | None, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` of ``model``, as a field validator of ``model_options`` (after
    ``model``) gives them: an error of the field unless they are what the model takes
    ([Note: options are data] in :mod:`edge.models.options`). An unknown model is
    left to be refused where it is built, by its own name."""
    from edge.models.zoo import MODELS, check_model_options

    if model is None or (":" not in model and model not in MODELS):
        return options
    try:
        check_model_options(model, options)
    except UserError as exc:
        raise PydanticCustomError("options", exc.message) from None
    return options


def check_batch_split(batch_size: int, microbatches: int, replicas: int | None = None) -> None:
    """Raise :class:`ValueError` unless ``batch_size`` splits into ``microbatches`` equal
    microbatches (each split again over ``replicas`` data-parallel copies, if given)."""
    if batch_size % (microbatches * (replicas or 1)):
        split = f"microbatches {microbatches}"
        if replicas is not None:
            split += f" x replicas {replicas}"
        raise ValueError(f"batch_size {batch_size} is not a multiple of {split}")


class OptimizerSpec(BaseModel):
    """Which optimizer a stage builds over its own parameters."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: OptimizerName = "sgd"
    lr: float = Field(default=0.05, gt=0, allow_inf_nan=False)
    momentum: float = Field(default=0.9, ge=0, lt=1)
    weight_decay: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0)


class DiLoCo(BaseModel):
    """The non-exact mode of a stage group: DiLoCo (Douillard et al., "DiLoCo: Distributed
    Low-Communication Training of Language Models", 2023), [Note: DiLoCo in a group] in
    :mod:`edge.runtime.outer_sync`."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    every: int = Field(ge=2, le=10_000)
    """Steps between a group's syncs: its members step on their own rows in between."""
    outer_lr: float = Field(default=0.7, gt=0, le=10)
    """The outer step's learning rate (Nesterov SGD on the members' mean movement)."""
    outer_momentum: float = Field(default=0.9, ge=0, lt=1)
    """The outer step's Nesterov momentum."""


COMPILE_SPLIT = "compile cannot be combined with schedule zb-h1: a compiled backward is one graph"
"""Why ``compile`` runs no zero-bubble schedule ([Note: compiled stages] in
:mod:`edge.runtime.compiling`)."""


class TrainConfigBase(BaseModel):
    """Every setting of :class:`TrainConfig` but the codec, which a stage has per link."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    model: ModelName = Field(examples=["cnn-digits"])
    model_options: dict[str, Any] = Field(default_factory=dict)
    """The model's keyword arguments (``num_classes``, ``width``...)."""
    dataset: DatasetName | None = None
    """Absent: the model's own dataset."""
    dataset_options: dict[str, Any] | None = None
    """The dataset's keyword arguments. Absent: the model's own with its own dataset, else
    none."""
    steps: Steps
    """Optimizer steps."""
    batch_size: BatchSize
    """Samples per step."""
    microbatches: Microbatches = 1
    """Microbatches per step; they divide ``batch_size``."""
    schedule: Schedule = "1f1b"
    """``1f1b``: PipeDream-Flush; ``gpipe``: every forward, then every backward;
    ``zb-h1``: 1F1B with each backward split, the weights' gradients filling the bubble
    ([Note: zero bubble] in :mod:`edge.runtime.schedules`)."""
    optimizer: OptimizerSpec = OptimizerSpec()
    precision: Precision = "fp32"
    """``bf16``: stages compute under bf16 autocast (weights and optimizer stay fp32)."""
    compile: bool = False
    """Each stage runs its units under ``torch.compile`` ([Note: compiled stages] in
    :mod:`edge.runtime.compiling`): its first step compiles first, and the seconds that
    took are reported apart from the step's compute."""
    seed: Seed = 0
    """Seed of the weights and the data order."""
    diloco: DiLoCo | None = None
    """``None``: exact, a stage group sums its gradients every step. Set: **non-exact**, each
    member of a group steps its own optimizer on its own rows and the group syncs every
    ``every`` steps ([Note: DiLoCo in a group] in :mod:`edge.runtime.outer_sync`); a stage
    on one device trains as ever."""

    @model_validator(mode="after")
    def _check_batch(self) -> TrainConfigBase:
        # A shape with data-parallel replicas splits every microbatch over them too.
        # A job's "auto" (coordinator.engine.spec.JobBase) is checked once its plan chose.
        if isinstance(self.microbatches, int):
            check_batch_split(self.batch_size, self.microbatches, getattr(self, "replicas", None))
        if self.compile and self.schedule == "zb-h1":  # [Note: compiled stages]
            raise ValueError(COMPILE_SPLIT)
        return self

    @field_validator("model_options")
    @classmethod
    def _model_options(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        return check_model_options_field(info.data.get("model"), value)

    @field_validator("dataset_options")
    @classmethod
    def _dataset_options(
        cls, value: dict[str, Any] | None, info: ValidationInfo
    ) -> dict[str, Any] | None:
        # Options are data ([Note: options are data] in edge.models.options): checked in
        # every shape, so a device refuses bad ones in an assignment before building.
        from edge.models.datasets import DATASETS, check_dataset_options
        from edge.models.options import DATASET_RESERVED, check_reserved

        dataset = info.data.get("dataset")
        if value is None:
            return value
        try:
            if dataset is None:  # the model's own dataset: known once the model is built
                where = f"model {info.data.get('model')}'s dataset"
                check_reserved(where, "dataset_options", value, DATASET_RESERVED)
            elif ":" in dataset or dataset in DATASETS:  # else refused, by name, where built
                check_dataset_options(dataset, value)
        except UserError as exc:
            raise PydanticCustomError("options", exc.message) from None
        return value

    def resolve_data(self) -> tuple[str, dict[str, Any]]:
        """The dataset and its options, with the model's filling in what is absent.

        Raises :class:`~edge.errors.UserError` for a model that cannot be built.
        """
        from edge.models.zoo import get_model

        spec = get_model(self.model, seed=self.seed, **self.model_options)
        dataset = self.dataset or spec.dataset
        options = self.dataset_options
        if options is None:
            options = spec.dataset_options if dataset == spec.dataset else {}
        return dataset, options

    def train_settings(self) -> dict[str, Any]:
        """The settings of :class:`TrainConfigBase`, by name: to build another shape on them."""
        return {name: getattr(self, name) for name in TrainConfigBase.model_fields}


class TrainConfig(TrainConfigBase):
    """Every setting a job trains with (see the module)."""

    codec: CodecChoice = "fp32"
    """Activations and gradients on every link, or ``auto``: the planner compresses the
    links that would otherwise slow the step (:mod:`coordinator.planner.codecs`)."""

    @property
    def link_codec(self) -> str:
        """The codec of a link whose plan chose none: ``codec``, or fp32 for ``auto``."""
        return "fp32" if self.codec == "auto" else self.codec
