"""Serve the coordinator with uvicorn: in the foreground (``edgetrain coordinator``) or in
a background thread (``edgetrain demo``, and tests that need a coordinator on a real port).

Both run a :class:`CoordinatorServer`, with ``log_config=None``: uvicorn leaves the
process's logging as its owner set it up (uvicorn's default config would stop its
loggers propagating, for the rest of the process).

[Note: event streams end on shutdown] An ``/api/v1/events`` stream never ends by
itself, and uvicorn's shutdown waits for every open connection before it runs the
app's lifespan shutdown, which is what closed the event bus. So a stopping server with
streams open waited forever (``edgetrain coordinator``), or until its graceful-shutdown
timeout and then cancelled each stream's task: one "Exception in ASGI application"
traceback per stream (``edgetrain demo``). :class:`CoordinatorServer` closes the event
bus as its shutdown begins: each stream finds its subscription closed at its next poll
(:data:`~coordinator.service.api.routes.system.EVENT_POLL_S`) and returns, its response
ends as a complete body, uvicorn closes the connection (it has asked each not to keep
alive) and goes on to the lifespan's shutdown. A stream opened after that finds the bus
closed and ends at once.

Tested in tests/integration/test_event_stream_shutdown.py (streams end on shutdown, in
the foreground and in a thread) and tests/integration/test_event_streams.py.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import uvicorn
from uvicorn.config import STARTUP_FAILURE

from coordinator.service.settings import Settings
from edge.errors import UserError

if TYPE_CHECKING:
    from fastapi import FastAPI

    from coordinator.service.api.deps import Services

__all__ = [
    "GRACEFUL_SHUTDOWN_S",
    "CoordinatorServer",
    "coordinator_server",
    "serve",
    "serve_in_thread",
]

GRACEFUL_SHUTDOWN_S = 5
"""Seconds a stopping server waits for the requests still in flight (a download to a
client that stopped reading, say) before it cancels them; event streams end at once."""


class CoordinatorServer(uvicorn.Server):
    """uvicorn's server, ending the app's event streams as its shutdown begins (see
    [Note: event streams end on shutdown])."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self.app = app

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        services: Services | None = getattr(self.app.state, "services", None)
        if services is not None:  # None when the app's startup failed
            services.bus.close()
        await super().shutdown(sockets)


def coordinator_server(settings: Settings, log_level: str = "warning") -> CoordinatorServer:
    """The app for ``settings``, to be served on ``settings.host:settings.port``."""
    from coordinator.service.app import create_app

    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        log_config=None,
    )
    return CoordinatorServer(config, app)


def serve(settings: Settings, log_level: str = "info") -> None:
    """Serve in the foreground until SIGINT or SIGTERM; exits 3 when the server did not
    start (as ``uvicorn.run``)."""
    server = coordinator_server(settings, log_level)
    # uvicorn raises the signal it stopped on again once it has shut down: SIGTERM then
    # reaches edgetrain's handler (edgetrain.cli.signals), SIGINT ends here, quietly.
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if not server.started:
        sys.exit(STARTUP_FAILURE)


@contextmanager
def serve_in_thread(settings: Settings, start_timeout_s: float = 60.0) -> Iterator[str]:
    """Run the app on ``settings.host:settings.port`` for the block; yields its base URL."""
    server = coordinator_server(settings)
    thread = threading.Thread(target=server.run, name="coordinator", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise UserError(f"the coordinator did not start on {settings.host}:{settings.port}")
        time.sleep(0.05)
    try:
        yield f"http://{settings.host}:{settings.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
