"""Stopping a coordinator with sixty event streams open ends every stream cleanly (see
[Note: event streams end on shutdown] in coordinator.service.serve).

``edgetrain coordinator`` as a process (a real Mosquitto; its logs are JSON lines on
standard error) gets 60 Server-Sent-Events clients, then SIGTERM or SIGINT: every client
reads its stream to a clean end (a complete body, not a dropped connection), and the
process exits within :data:`STOP_S` with the status of its signal (143, or 0 for SIGINT),
having written no traceback and no ``error`` record. Served in a thread, as ``edgetrain
demo`` does, leaving the block ends the streams the same way, with nothing logged at
ERROR. Before the fix the process waited for the streams forever, and the thread
cancelled them after its graceful-shutdown timeout, one traceback per stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
from support.coordinator import coordinator_process
from support.markers import needs_mosquitto
from support.mosquitto import Broker
from support.waiting import until

from coordinator.local.broker import free_port
from coordinator.service.serve import serve_in_thread
from coordinator.service.settings import Settings
from edgetrain.cli.signals import TERMINATED

pytestmark = needs_mosquitto

CLIENTS = 60
STOP_S = 10.0
"""How long a stop may take, streams ended and process gone; it takes about a second."""


async def _rest(lines: AsyncIterator[str]) -> list[str]:
    """The lines of a stream to its end; a stream cut off raises (httpx.RemoteProtocolError)."""
    return [line async for line in lines]


async def _stop_with_streams(url: str, stop: Callable[[], None]) -> float:
    """Open :data:`CLIENTS` event streams, call ``stop`` once each has said it is
    connected, read each to its end; the seconds from ``stop`` to the last end."""
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=0)
    async with (
        httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client,
        contextlib.AsyncExitStack() as stack,
    ):
        opened = [
            await stack.enter_async_context(client.stream("GET", "/api/v1/events"))
            for _ in range(CLIENTS)
        ]
        assert {r.status_code for r in opened} == {200}
        lines = [r.aiter_lines() for r in opened]
        firsts = await asyncio.wait_for(asyncio.gather(*(anext(each) for each in lines)), 60)
        assert set(firsts) == {": connected"}
        start = time.monotonic()
        stop()
        rests = await asyncio.wait_for(asyncio.gather(*(_rest(each) for each in lines)), STOP_S)
        took = time.monotonic() - start
    # Only the blank line after ": connected" was left: no event came, and none was lost.
    assert all(rest == [""] for rest in rests), rests
    return took


@pytest.mark.parametrize(
    ("sig", "status"), [(signal.SIGTERM, TERMINATED), (signal.SIGINT, 0)], ids=["term", "int"]
)
def test_a_signal_ends_the_coordinators_event_streams(
    mosquitto: Broker, tmp_path: Path, sig: signal.Signals, status: int
) -> None:
    port = free_port()
    log = tmp_path / "coordinator.log"
    with (
        log.open("wb") as stderr,
        coordinator_process(port, mosquitto.url, tmp_path / "coord", stderr=stderr) as proc,
    ):
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            try:
                return httpx.get(f"{url}/healthz").status_code == 200
            except httpx.TransportError:
                return False

        assert until(ready, 60), log.read_text()[-3000:]
        took = asyncio.run(_stop_with_streams(url, lambda: proc.send_signal(sig)))
        start = time.monotonic()
        try:
            exited = proc.wait(STOP_S - took)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {STOP_S} s after the signal: {log.read_text()[-3000:]}")
        took += time.monotonic() - start
    text = log.read_text()
    assert exited == status, text[-3000:]
    assert took < STOP_S
    assert "Traceback" not in text, text[-3000:]
    records = [json.loads(line) for line in text.splitlines()]
    assert [r for r in records if r["level"] not in ("debug", "info", "warning")] == []
    assert records[-1]["msg"].startswith("Finished server process"), records[-1]


def test_leaving_serve_in_thread_ends_its_event_streams(
    mosquitto: Broker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = Settings(broker_url=mosquitto.url, data_dir=tmp_path / "coord", port=free_port())
    with contextlib.ExitStack() as served:
        url = served.enter_context(serve_in_thread(settings))
        took = asyncio.run(_stop_with_streams(url, served.close))
    assert took < STOP_S
    failed = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert failed == [], [r.getMessage() for r in failed]
