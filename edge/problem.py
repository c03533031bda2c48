"""The planning problem, versions 1 and 2: the contract between profilers and the planner.

This module owns the data types of ``shared/spec/planning.md`` and
``shared/spec/planning-v2.md`` (layers, devices, the problem, version 2's
``groups`` switch, objective and power figures) and their validation, so that
the device side (which produces
``layers`` from a model profile and a ``device`` from self-profiling) and the
coordinator (which plans) share one definition. Scoring and search live in
``coordinator.planner``; only the types live here, below both.

Tested in tests/integration/test_plan_cli.py (each malformed field refused in one line;
version 2) and tests/unit/edge/profiling/test_catalog.py (version 2's power figures).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from edge.errors import UserError, describe_validation_error

__all__ = [
    "DeviceSpec",
    "Objective",
    "PlanningProblem",
    "UnitSpec",
    "load_problem",
    "parse_problem",
]


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


# strict=True refuses "12" where a number belongs: a string in a numeric field is a mistake.
Positive = Annotated[float, Field(gt=0, allow_inf_nan=False), AfterValidator(_finite)]
NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False), AfterValidator(_finite)]


class _Strict(BaseModel):
    # Refuse unknown fields (a misspelt field is a silent wrong answer otherwise) and
    # refuse strings where numbers belong.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class UnitSpec(_Strict):
    """One unit of the model, in execution order; plans cut between units."""

    name: str = Field(min_length=1)
    fwd_flops: NonNegative
    """Forward FLOPs per sample."""
    bwd_flops: NonNegative | None = None
    """Backward FLOPs per sample; ``2 * fwd_flops`` when absent."""
    param_bytes: NonNegative
    out_bytes: NonNegative
    """Bytes of this unit's output per sample: what crosses a cut after it."""
    act_bytes: NonNegative | None = None
    """Bytes kept for backward per sample; ``out_bytes`` when absent."""

    @property
    def train_flops(self) -> float:
        """Forward plus backward FLOPs per sample."""
        bwd = 2.0 * self.fwd_flops if self.bwd_flops is None else self.bwd_flops
        return self.fwd_flops + bwd

    @property
    def saved_bytes(self) -> float:
        return self.out_bytes if self.act_bytes is None else self.act_bytes


class DeviceSpec(_Strict):
    """A device as the planner sees it: speed, memory and its link."""

    id: str = Field(min_length=1)
    gflops: Positive
    """Sustained training GFLOP/s."""
    memory_bytes: Positive
    bandwidth_mbps: Positive
    """Link to the network, megabits per second, each way."""
    latency_ms: NonNegative
    """One-way latency of that link, milliseconds."""
    watts_busy: NonNegative | None = None
    """Version 2: power while computing, watts (``None``: 0 in the score)."""
    watts_idle: NonNegative | None = None
    """Version 2: power while on and not computing, watts (``None``: 0 in the score)."""
    details: dict[str, Any] | None = None
    """Free-form measurement detail (e.g. from ``edgetrain profile``); ignored by the score."""


class Objective(_Strict):
    """Version 2's objective: what to minimise, and an optional step-time deadline."""

    minimize: Literal["time", "energy"] = "time"
    max_step_time_s: Positive | None = None
    """Only plans whose step time is at most this are feasible."""


_V2_ONLY = ("groups", "objective")


class PlanningProblem(_Strict):
    """A whole planning problem (``shared/spec/planning.md``, version 1, or
    ``planning-v2.md``, version 2: stages on device groups, energy, deadlines)."""

    version: Literal[1, 2]
    batch_size: Positive
    microbatches: Annotated[int, Field(ge=1)]
    optimizer_state_factor: Positive = 4.0
    pin_first: str | None = None
    groups: bool | None = None
    """Version 2: whether a stage may run on a group of devices (``None``: yes)."""
    objective: Objective | None = None
    """Version 2: the objective (``None``: minimise step time, no deadline)."""
    layers: list[UnitSpec] = Field(min_length=1)
    devices: list[DeviceSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _check_references(self) -> PlanningProblem:
        if self.version == 1:
            for name in _V2_ONLY:
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}: only in version 2 problems")
            for i, d in enumerate(self.devices):
                for name in ("watts_busy", "watts_idle"):
                    if getattr(d, name) is not None:
                        raise ValueError(f"devices.{i}.{name}: only in version 2 problems")
        ids = [d.id for d in self.devices]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"devices: duplicate id {dupes[0]!r}")
        if self.pin_first is not None and self.pin_first not in ids:
            raise ValueError(f"pin_first: {self.pin_first!r} names no device in devices")
        return self

    @property
    def microbatch_size(self) -> float:
        return self.batch_size / self.microbatches

    @property
    def allows_groups(self) -> bool:
        """Whether a stage may run on several devices (version 2, unless ``groups`` is false)."""
        return self.version == 2 and self.groups is not False

    @property
    def goal(self) -> Objective:
        """The objective; version 1 and a version 2 file without one minimise step time."""
        return self.objective or Objective()

    def as_version(self, version: Literal[1, 2]) -> PlanningProblem:
        """The same devices and model as a problem of ``version``: version 1 drops the
        groups, objective and power figures; version 2 keeps everything."""
        if version == self.version:
            return self
        if version == 2:
            return self.model_copy(update={"version": 2})
        devices = [
            d.model_copy(update={"watts_busy": None, "watts_idle": None}) for d in self.devices
        ]
        return self.model_copy(
            update={"version": 1, "groups": None, "objective": None, "devices": devices}
        )

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)


def parse_problem(data: Any, source: str = "problem") -> PlanningProblem:
    """Validate ``data`` as a planning problem, or raise a one-line :class:`UserError`."""
    if isinstance(data, dict) and "version" in data and data["version"] not in (1, 2):
        raise UserError(f"{source}: version: unknown version {data['version']!r} (expected 1 or 2)")
    try:
        return PlanningProblem.model_validate(data)
    except ValidationError as exc:
        raise UserError(describe_validation_error(exc, source)) from None


def load_problem(path: Path) -> PlanningProblem:
    """Read and validate a problem file (JSON)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise UserError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except (json.JSONDecodeError, ValueError) as exc:
        raise UserError(f"{path}: not valid JSON: {exc}") from None
    return parse_problem(data, str(path))


def _refuse_constant(name: str) -> float:
    # json accepts NaN and Infinity by default; a problem file must not.
    raise ValueError(f"{name} is not allowed")
