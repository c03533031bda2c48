"""The coordinator as a FastAPI application.

:func:`start_services` brings up what the API stands on, in order: the data
directory and store, the broker (the embedded default when no URL is
configured: TLS, accounts and ACLs, :mod:`coordinator.local.owned`; for a broker
at a URL, its accounts when ``broker_accounts`` names their record), one MQTT
control connection of the coordinator's account, the device registry, the fault
actuator (a testbed's when ``testbed_state`` is set: see
:mod:`coordinator.testbed.actuator`) and the job manager; :func:`create_app`
serves them under ``/api/v1`` (OpenAPI at ``/docs``), plus ``/healthz``,
``/metrics`` and ``/api/v1/events``. A user error in a request (bad model name,
bad option) is a 422 naming the field; nothing a client sends produces a 500.

Two middlewares stand before every route: a request whose ``Host`` header is not
one of ``settings.trusted_hosts`` is a 400 (a guard against DNS rebinding: see
:mod:`coordinator.service.settings`), and a body over ``settings.max_body_bytes``
is a 413 (:mod:`coordinator.service.body_limit`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.middleware.trustedhost import TrustedHostMiddleware

from coordinator.access.accounts import BrokerAccounts
from coordinator.engine.faults import FaultActuator, ThrottleActuator
from coordinator.service.api.deps import Services
from coordinator.service.api.routes import devices, jobs, plans, system
from coordinator.service.api.routes.errors import validation_detail, validation_error
from coordinator.service.body_limit import BodyLimitMiddleware
from coordinator.service.events import EventBus
from coordinator.service.manager import JobManager
from coordinator.service.registry import DeviceRegistry
from coordinator.service.settings import Settings
from coordinator.service.store.sqlite import Store
from edge import __version__
from edge.errors import UserError
from edge.transport.mqtt import MqttTransport
from edge.transport.settings import MqttSettings

__all__ = ["create_app", "start_services"]


def _broker_login(settings: Settings) -> tuple[MqttSettings, BrokerAccounts | None]:
    """How the coordinator logs in to the broker at ``broker_url``, and that broker's accounts
    when ``broker_accounts`` names their record: then its coordinator account and CA
    (``tls/ca.pem``) unless EDGETRAIN_BROKER_USERNAME (with _PASSWORD) or _CA say otherwise."""
    login = settings.broker_settings()
    record = settings.broker_accounts
    if record is None:
        return login, None
    ca = settings.broker_ca or record / "tls" / "ca.pem"
    try:
        ca_pem = ca.read_text() if settings.broker_ca or ca.is_file() else None
    except OSError as exc:
        raise UserError(f"broker CA {ca}: {exc.strerror or exc}") from None
    accounts = BrokerAccounts(record, login.url, ca_pem)
    if settings.broker_username is None:
        login = accounts.login(login.url)  # verifying by broker_ca's CA, or the record's
    elif settings.broker_ca is None and ca_pem is not None:
        login = login.model_copy(update={"tls_ca_pem": ca_pem})
    return login, accounts


def start_services(settings: Settings) -> tuple[Services, Callable[[], None]]:
    """Everything the API needs, started; and the function that stops it all."""
    stack = contextlib.ExitStack()
    try:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        store = Store(settings.data_dir)
        stack.callback(store.close)
        accounts = None
        if settings.broker_url is None:
            from coordinator.local.owned import start_owned_broker

            owned = start_owned_broker(
                settings.data_dir / "broker",
                port=settings.broker_port,
                log_dir=settings.data_dir / "logs",
                hosts=settings.broker_hosts,
            )
            stack.callback(owned.stop)
            url, login, accounts = owned.url, owned.settings(), owned.accounts
        else:
            url = settings.broker_url
            login, accounts = _broker_login(settings)
        control = MqttTransport(login)
        control.connect(timeout=15)
        stack.callback(control.close)
        if settings.broker_url is not None and accounts is not None:
            accounts.attach(control)  # creates the enrolled devices; changes go through it
        bus = EventBus()
        stack.callback(bus.close)
        registry = DeviceRegistry(store, bus, control, settings.heartbeat_timeout_s)
        registry.start()
        stack.callback(registry.stop)
        actuator: FaultActuator = ThrottleActuator(control)
        if settings.testbed_state is not None:
            from coordinator.testbed.actuator import TestbedActuator

            enroll = accounts.enroll if accounts is not None else None
            actuator = TestbedActuator(settings.testbed_state, control, enroll)
        manager = JobManager(store, bus, registry, control, actuator=actuator, access=accounts)
        manager.start()
        stack.callback(manager.stop)
    except BaseException:
        stack.close()
        raise
    services = Services(
        settings=settings,
        store=store,
        bus=bus,
        registry=registry,
        manager=manager,
        accounts=accounts,
        broker_url=url,
    )
    return services, stack.close


def create_app(settings: Settings | None = None) -> FastAPI:
    """The coordinator app; services start with the app and stop with it."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        services, stop = start_services(settings)
        app.state.services = services
        app.state.metrics_registry = system.metrics_registry(services)
        try:
            yield
        finally:
            stop()

    app = FastAPI(title="edgetrain coordinator", version=__version__, lifespan=lifespan)
    # The last added runs first: the host is checked before any body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(
        TrustedHostMiddleware, allowed_hosts=settings.trusted_hosts, www_redirect=False
    )
    app.include_router(devices.router, prefix="/api/v1")
    app.include_router(jobs.router, prefix="/api/v1")
    app.include_router(plans.router, prefix="/api/v1")
    app.include_router(system.router)

    from fastapi.responses import FileResponse
    from fastapi.staticfiles import StaticFiles

    from coordinator.service.dashboard import INDEX_HTML, STATIC_DIR

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", include_in_schema=False)
    def dashboard() -> FileResponse:
        """The dashboard (static HTML, CSS and JavaScript; see coordinator.service.dashboard)."""
        return FileResponse(INDEX_HTML, headers={"Cache-Control": "no-cache"})

    app.add_exception_handler(RequestValidationError, validation_error)  # type: ignore[arg-type]

    @app.exception_handler(UserError)
    async def user_error(_request: Request, exc: UserError) -> JSONResponse:
        return JSONResponse({"detail": validation_detail([], exc.message)}, status_code=422)

    return app
