"""``/api/v1/devices``: the fleet as the registry sees it."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel

from coordinator.service.api.deps import ReadAuth, RegistryDep
from coordinator.service.api.routes.errors import AUTH, NOT_FOUND

__all__ = ["router"]

router = APIRouter(prefix="/devices", tags=["devices"], dependencies=[ReadAuth], responses=AUTH)


class DevicePublic(BaseModel):
    id: str
    state: str
    last_seen: float | None
    profile: dict[str, Any] | None
    job: str | None
    stage: int | None


class DevicesPublic(BaseModel):
    data: list[DevicePublic]
    count: int


@router.get("", response_model=DevicesPublic)
def list_devices(registry: RegistryDep) -> DevicesPublic:
    """Every device seen, online or not."""
    data = [DevicePublic(**d.to_json()) for d in registry.devices()]
    return DevicesPublic(data=data, count=len(data))


@router.get("/{device_id}", response_model=DevicePublic, responses=NOT_FOUND)
def get_device(device_id: str, registry: RegistryDep) -> DevicePublic:
    device = registry.get(device_id)
    if device is None:
        raise HTTPException(404, f"no device {device_id!r}")
    return DevicePublic(**device.to_json())
