"""``/api/v1/devices``: the fleet as the registry sees it, and enrolment on the broker.

``POST /devices/enroll`` (write auth) makes a device's broker account and returns
its credentials; ``DELETE /devices/{id}/enrollment`` revokes it
(:class:`coordinator.access.accounts.BrokerAccounts`).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from coordinator.access.accounts import BrokerAccounts
from coordinator.service.api.deps import ReadAuth, RegistryDep, ServicesDep, WriteAuth
from coordinator.service.api.routes.errors import AUTH, CONFLICT, NOT_FOUND
from edge.models.local_data import LocalDatasetInfo

__all__ = ["router"]

router = APIRouter(prefix="/devices", tags=["devices"], dependencies=[ReadAuth], responses=AUTH)


class DevicePublic(BaseModel):
    id: str
    state: str
    last_seen: float | None
    profile: dict[str, Any] | None
    job: str | None
    stage: int | None
    datasets: dict[str, LocalDatasetInfo] = {}
    """The datasets the device holds, by name: sizes and shapes, never samples."""


class DevicesPublic(BaseModel):
    data: list[DevicePublic]
    count: int


@router.get("", response_model=DevicesPublic)
def list_devices(registry: RegistryDep) -> DevicesPublic:
    """Every device seen, online or not."""
    data = [DevicePublic(**d.to_json()) for d in registry.devices()]
    return DevicesPublic(data=data, count=len(data))


# -- enrolment: broker accounts (a broker whose accounts the coordinator runs) ---------------------


class EnrollRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    device_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class CredentialsPublic(BaseModel):
    """What ``edgetrain agent --credentials`` reads; the password is shown only here."""

    broker: str
    device_id: str
    username: str
    password: str
    ca: str | None


class EnrolledPublic(BaseModel):
    data: list[str]
    count: int


def _accounts(services: ServicesDep) -> BrokerAccounts:
    if services.accounts is None:
        raise HTTPException(
            409,
            "this coordinator does not run its broker's accounts (EDGETRAIN_BROKER_URL is set "
            "without EDGETRAIN_BROKER_ACCOUNTS, or the broker is the anonymous embedded one): "
            "enrol devices with the broker's tools",
        )
    return services.accounts


@router.post(
    "/enroll",
    response_model=CredentialsPublic,
    status_code=201,
    dependencies=[WriteAuth],
    responses=CONFLICT,
)
def enroll_device(body: EnrollRequest, services: ServicesDep) -> CredentialsPublic:
    """Create ``device_id``'s broker account (or give it a new password: rotation) and return
    its credentials. The agent connects with them; the old password stops working."""
    creds = _accounts(services).enroll(body.device_id)
    data = json.loads(creds.to_json())
    return CredentialsPublic(**data)


@router.get("/enrollments", response_model=EnrolledPublic, responses=CONFLICT)
def list_enrolled(services: ServicesDep) -> EnrolledPublic:
    """The devices with a broker account."""
    devices = _accounts(services).devices()
    return EnrolledPublic(data=devices, count=len(devices))


@router.delete(
    "/{device_id}/enrollment",
    status_code=204,
    dependencies=[WriteAuth],
    responses={**NOT_FOUND, **CONFLICT},
)
def revoke_device(device_id: str, services: ServicesDep) -> None:
    """Delete the device's broker account: it is disconnected at once and cannot log in."""
    accounts = _accounts(services)
    if device_id not in accounts.devices():
        raise HTTPException(404, f"device {device_id!r} is not enrolled")
    accounts.revoke(device_id)


# Last: /{device_id} would otherwise take /enrollments.
@router.get("/{device_id}", response_model=DevicePublic, responses=NOT_FOUND)
def get_device(device_id: str, registry: RegistryDep) -> DevicePublic:
    device = registry.get(device_id)
    if device is None:
        raise HTTPException(404, f"no device {device_id!r}")
    return DevicePublic(**device.to_json())
