"""The coordinator's jobs API in-process, for unit tests without a broker or a socket.

:func:`jobs_api` serves the jobs router (FastAPI's TestClient) over a real store, the
real device registry and the real job manager, as the coordinator wires them
(:class:`~coordinator.service.api.deps.Services`); the control connection is a
stand-in (:class:`support.control.HandDelivered`) that nothing publishes on unless a
test does. The job manager is not started, so a job posted stays queued, until a test
calls :meth:`JobsApi.start`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from fastapi import FastAPI
from fastapi.testclient import TestClient

from coordinator.service.api.deps import Services
from coordinator.service.api.routes import jobs
from coordinator.service.events import EventBus
from coordinator.service.manager import JobManager
from coordinator.service.registry import DeviceRegistry
from coordinator.service.settings import Settings
from coordinator.service.store.sqlite import Store
from support.control import HandDelivered

__all__ = ["JobsApi", "jobs_api"]


class JobsApi:
    """The jobs API's client, and the store and job manager behind it."""

    def __init__(self, client: TestClient, store: Store, manager: JobManager) -> None:
        self.client, self.store, self.manager = client, store, manager
        self.started = False

    def start(self) -> None:
        """Start the job manager's worker: queued jobs are taken from now on."""
        if not self.started:
            self.manager.start()
            self.started = True


A = TypeVar("A", bound=JobsApi)


@contextmanager
def jobs_api(data_dir: Path, kind: type[A] = JobsApi) -> Iterator[A]:  # type: ignore[assignment]
    """The jobs API over a coordinator's state in ``data_dir``, as a ``kind``; what it
    started (the registry, the manager if started, the event bus) is stopped at exit."""
    bus = EventBus()
    control = HandDelivered()
    with Store(data_dir) as store:
        registry = DeviceRegistry(store, bus, control)  # type: ignore[arg-type]
        registry.start()
        manager = JobManager(store, bus, registry, control)  # type: ignore[arg-type]
        app = FastAPI()
        app.include_router(jobs.router, prefix="/api/v1")
        app.state.services = Services(Settings(data_dir=data_dir), store, bus, registry, manager)
        api = None
        try:
            with TestClient(app) as client:
                api = kind(client, store, manager)
                yield api
        finally:
            if api is not None and api.started:
                manager.stop()
            registry.stop()
            bus.close()
