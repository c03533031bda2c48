"""Serve the coordinator from inside another program: uvicorn in a background thread.

Used by ``edgetrain demo`` and by tests that need a coordinator on a real port;
``edgetrain coordinator`` runs uvicorn in the foreground instead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from coordinator.service.settings import Settings
from edge.errors import UserError

__all__ = ["serve_in_thread"]


@contextmanager
def serve_in_thread(settings: Settings, start_timeout_s: float = 60.0) -> Iterator[str]:
    """Run the app on ``settings.host:settings.port`` for the block; yields its base URL.

    The graceful-shutdown wait is short (3 s) because an open event stream would
    otherwise hold the server up for its keep-alive period. ``log_config=None``
    leaves the process's logging as its owner set it up: uvicorn's default config
    would stop its loggers propagating, for the rest of the process.
    """
    import uvicorn

    from coordinator.service.app import create_app

    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level="warning",
        timeout_graceful_shutdown=3,
        log_config=None,
    )
    server = uvicorn.Server(config)
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
