"""``/api/v1/plans``: what-if planning; nothing runs."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from coordinator.planner import plan_problem
from coordinator.planner.baselines import run_baselines
from coordinator.planner.build import build_problem, parse_fleet
from coordinator.planner.simulator import simulate
from coordinator.service.api.deps import ReadAuth, RegistryDep
from coordinator.service.api.routes.errors import AUTH, unprocessable
from coordinator.service.api.routes.jobs import zoo_model_name
from edge.config import BatchSize, Microbatches, ModelName, Schedule, check_batch_split
from edge.errors import UserError
from edge.problem import DeviceSpec

__all__ = ["router"]

router = APIRouter(prefix="/plans", tags=["plans"], dependencies=[ReadAuth], responses=AUTH)


class PlanCreate(BaseModel):
    """A model and a fleet: ids of known devices and/or catalogue names (``rpi4-4gb:2``)."""

    model_config = ConfigDict(extra="forbid")

    model: ModelName = Field(examples=["vgg11"])
    model_options: dict[str, Any] = Field(default_factory=dict)
    devices: list[str] = Field(min_length=1, max_length=256, examples=[["rpi4-4gb:2", "laptop"]])
    batch_size: BatchSize = 32
    microbatches: Microbatches = 4
    pin_first: str | None = None
    schedule: Schedule = "1f1b"

    @field_validator("model")
    @classmethod
    def _zoo_only(cls, value: str) -> str:
        return zoo_model_name(value)

    @model_validator(mode="after")
    def _check(self) -> PlanCreate:
        check_batch_split(self.batch_size, self.microbatches)
        return self


@router.post("")
def create_plan(body: PlanCreate, registry: RegistryDep) -> dict[str, Any]:
    """The plan, its predicted samples/s, the baselines' predictions and the simulated step."""
    fleet: list[DeviceSpec] = []
    known = {d.id: d for d in registry.devices()}
    try:
        for name in body.devices:
            device = known.get(name)
            if device is not None and device.profile is not None:
                fleet.append(
                    DeviceSpec.model_validate({**device.profile, "id": name, "details": None})
                )
            else:
                fleet += parse_fleet(name)
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
