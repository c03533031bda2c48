"""``/api/v1/plans``: what-if planning; nothing runs.

Planning profiles the model on the coordinator, so it needs the write token, as
submitting a job does. The fleet is named in the body and nothing else: each item
of ``devices`` is the id of a known device, a catalogue profile
(``NAME[:COUNT]``, at most :data:`MAX_DEVICES` devices in all) or a measured
device itself, as an object (what ``edgetrain profile --json`` prints, its figures
bounded so that no prediction overflows). The command line's other form, the path
of a JSON file, is refused: a client must not make the coordinator read its files.

Tested in tests/unit/coordinator/service/api/routes/test_plan_routes.py and
tests/e2e/test_api.py::test_what_if_plan_needs_no_devices_online.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from coordinator.planner import plan_problem
from coordinator.planner.baselines import run_baselines
from coordinator.planner.bounds import certificate
from coordinator.planner.build import build_problem, parse_fleet
from coordinator.planner.simulator import simulate
from coordinator.service.api.deps import RegistryDep, WriteAuth
from coordinator.service.api.routes.errors import AUTH, unprocessable
from coordinator.service.api.routes.jobs import zoo_model_name
from edge.config import (
    BatchSize,
    Microbatches,
    ModelName,
    Schedule,
    check_batch_split,
    check_model_options_field,
)
from edge.errors import UserError
from edge.problem import DeviceSpec

__all__ = ["MAX_DEVICES", "DeviceCreate", "PlanCreate", "router"]

router = APIRouter(prefix="/plans", tags=["plans"], responses=AUTH)

MAX_DEVICES = 256
"""Most devices one what-if plan may have, counting a catalogue item's ``:COUNT``."""


def _within(low: float, high: float) -> Any:
    return Field(ge=low, le=high, allow_inf_nan=False)


class DeviceCreate(DeviceSpec):
    """A measured device, given in the body (the fields of ``edgetrain profile --json``)."""

    id: str = Field(min_length=1, max_length=128)
    gflops: Annotated[float, _within(1e-3, 1e7)]
    """Sustained training GFLOP/s."""
    memory_bytes: Annotated[float, _within(1, 2.0**60)]
    bandwidth_mbps: Annotated[float, _within(1e-3, 1e7)]
    """Link to the network, megabits per second, each way."""
    latency_ms: Annotated[float, _within(0, 1e6)]
    """One-way latency of that link, milliseconds."""

    @field_validator("details")
    @classmethod
    def _json_details(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # Free-form but JSON: a NaN in them is not JSON, whatever Python's parser reads.
        try:
            json.dumps(value, allow_nan=False)
        except ValueError:
            raise ValueError("details hold a number that is not finite") from None
        return value


def _named_device(item: str) -> str:
    """A known id or a catalogue ``NAME[:COUNT]``, never a file: see the module."""
    if any(c in item for c in "/\\,") or item.lower().endswith(".json"):
        raise ValueError(
            f"{item!r} is not a device name: the API reads no files and takes one device "
            "per item; give a measured device as an object in devices instead"
        )
    _, colon, count = item.rpartition(":")
    if colon and count.isdigit() and (len(count) > 4 or int(count) > MAX_DEVICES):
        raise ValueError(f"{item!r}: a count is at most {MAX_DEVICES}")
    return item


def _item_kind(value: Any) -> str:
    return "device" if isinstance(value, dict | DeviceSpec) else "name"


DeviceItem = Annotated[
    Annotated[str, Field(min_length=1, max_length=128), AfterValidator(_named_device), Tag("name")]
    | Annotated[DeviceCreate, Tag("device")],
    Discriminator(_item_kind),
]
"""An item of ``devices``: a name (a string) or a measured device (an object)."""


class PlanCreate(BaseModel):
    """A model and a fleet: ids of known devices, catalogue names (``rpi4-4gb:2``) and
    measured devices as objects."""

    model_config = ConfigDict(extra="forbid")

    model: ModelName = Field(examples=["vgg11"])
    model_options: dict[str, Any] = Field(default_factory=dict)
    devices: list[DeviceItem] = Field(
        min_length=1, max_length=MAX_DEVICES, examples=[["rpi4-4gb:2", "laptop"]]
    )
    batch_size: BatchSize = 32
    microbatches: Microbatches = 4
    pin_first: str | None = None
    schedule: Schedule = "1f1b"

    @field_validator("model")
    @classmethod
    def _zoo_only(cls, value: str) -> str:
        return zoo_model_name(value)

    @field_validator("model_options")
    @classmethod
    def _options(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        return check_model_options_field(info.data.get("model"), value)

    @model_validator(mode="after")
    def _check(self) -> PlanCreate:
        check_batch_split(self.batch_size, self.microbatches)
        total = sum(_count(item) for item in self.devices)
        if total > MAX_DEVICES:
            raise ValueError(f"devices: {total} devices in all, more than {MAX_DEVICES}")
        return self


def _count(item: str | DeviceSpec) -> int:
    """How many devices an item of ``devices`` stands for."""
    if isinstance(item, DeviceSpec):
        return 1
    _, colon, count = item.rpartition(":")
    return int(count) if colon and count.isdigit() else 1


@router.post("", dependencies=[WriteAuth])
def create_plan(body: PlanCreate, registry: RegistryDep) -> dict[str, Any]:
    """The plan, its predicted samples/s, the baselines' predictions and the simulated step."""
    fleet: list[DeviceSpec] = []
    known = {d.id: d for d in registry.devices()}
    try:
        for item in body.devices:
            if isinstance(item, DeviceSpec):
                fleet.append(DeviceSpec.model_validate(item.model_dump()))
                continue
            device = known.get(item)
            if device is not None and device.profile is not None:
                fleet.append(
                    DeviceSpec.model_validate({**device.profile, "id": item, "details": None})
                )
            else:
                fleet += parse_fleet(item, files=False)
        problem = build_problem(
            body.model,
            fleet,
            batch_size=body.batch_size,
            microbatches=body.microbatches,
            pin_first=body.pin_first,
            model_options=body.model_options,
        )
    except UserError as exc:
        raise unprocessable(["body"], exc.message) from None
    found = plan_problem(problem, time_budget_s=5.0)
    if found.score is None:
        return {"feasible": False, "reason": found.reason}
    sim = simulate(problem, found.score.plan, body.schedule)
    baselines = run_baselines(problem)
    return {
        **found.score.to_json(),
        **certificate(problem, found.score.step_time_s),
        "stages": found.score.plan.to_json(found.score.shares),  # with devices and shares
        "method": found.method,
        "exact": found.exact,
        "units": [unit.name for unit in problem.layers],
        "compute_s": found.score.compute_s,
        "link_s": found.score.link_s,
        "memory_bytes": found.score.memory_bytes,
        "baselines": {
            k: {
                "throughput_sps": b.throughput_sps,
                "step_time_s": b.step_time_s,
                "feasible": b.feasible,
            }
            for k, b in baselines.items()
        },
        "simulation": sim.to_json(),
    }
