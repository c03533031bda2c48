"""The planning problem, version 1: the contract between profilers and the planner.

This module owns the data types of ``shared/spec/planning.md`` (layers, devices,
the problem) and their validation, so that the device side (which produces
``layers`` from a model profile and a ``device`` from self-profiling) and the
coordinator (which plans) share one definition. Scoring and search live in
``coordinator.planner``; only the types live here, below both.
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

__all__ = ["DeviceSpec", "PlanningProblem", "UnitSpec", "load_problem", "parse_problem"]


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
    details: dict[str, Any] | None = None
    """Free-form measurement detail (e.g. from ``edgetrain profile``); ignored by the score."""


class PlanningProblem(_Strict):
    """A whole planning problem (``shared/spec/planning.md``, version 1)."""

    version: Literal[1]
    batch_size: Positive
    microbatches: Annotated[int, Field(ge=1)]
    optimizer_state_factor: Positive = 4.0
    pin_first: str | None = None
    layers: list[UnitSpec] = Field(min_length=1)
    devices: list[DeviceSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _check_references(self) -> PlanningProblem:
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

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)


def parse_problem(data: Any, source: str = "problem") -> PlanningProblem:
    """Validate ``data`` as a planning problem, or raise a one-line :class:`UserError`."""
    if isinstance(data, dict) and "version" in data and data["version"] != 1:
        raise UserError(f"{source}: version: unknown version {data['version']!r} (expected 1)")
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
