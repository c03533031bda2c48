"""Dependencies of the routes, as ``Annotated`` aliases so signatures read like prose.

:class:`Services` is everything a running coordinator holds (settings, store,
event bus, device registry, job manager); the app keeps one on ``app.state``.
Authentication: with ``EDGETRAIN_API_TOKEN`` set, mutating routes need
``Authorization: Bearer <token>``; reads too when ``EDGETRAIN_API_READ_AUTH``.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from coordinator.access.accounts import BrokerAccounts
from coordinator.service.events import EventBus
from coordinator.service.manager import JobManager
from coordinator.service.registry import DeviceRegistry
from coordinator.service.settings import Settings
from coordinator.service.store.sqlite import Store

__all__ = [
    "ManagerDep",
    "ReadAuth",
    "RegistryDep",
    "Services",
    "ServicesDep",
    "StoreDep",
    "WriteAuth",
]


@dataclass
class Services:
    settings: Settings
    store: Store
    bus: EventBus
    registry: DeviceRegistry
    manager: JobManager
    accounts: BrokerAccounts | None = None
    """The broker's accounts when the coordinator started it (enrolment, revocation)."""
    broker_url: str = ""


def get_services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


_bearer = HTTPBearer(auto_error=False)
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def _check(services: Services, creds: HTTPAuthorizationCredentials | None) -> None:
    token = services.settings.token
    if token is None:
        return
    if creds is None or not hmac.compare_digest(creds.credentials.encode(), token.encode()):
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "a valid 'Authorization: Bearer <token>' header is required",
            headers={"WWW-Authenticate": "Bearer"},
        )


def require_write(services: Annotated[Services, Depends(get_services)], creds: Credentials) -> None:
    _check(services, creds)


def require_read(services: Annotated[Services, Depends(get_services)], creds: Credentials) -> None:
    if services.settings.api_read_auth:
        _check(services, creds)


def get_store(request: Request) -> Store:
    return get_services(request).store


def get_registry(request: Request) -> DeviceRegistry:
    return get_services(request).registry


def get_manager(request: Request) -> JobManager:
    return get_services(request).manager


ServicesDep = Annotated[Services, Depends(get_services)]
StoreDep = Annotated[Store, Depends(get_store)]
RegistryDep = Annotated[DeviceRegistry, Depends(get_registry)]
ManagerDep = Annotated[JobManager, Depends(get_manager)]
WriteAuth = Depends(require_write)
ReadAuth = Depends(require_read)
