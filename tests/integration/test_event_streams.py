"""Sixty open event streams leave the API answering (see [Note: event streams hold no
thread] in coordinator.service.api.routes.system).

A real coordinator (uvicorn on a free loopback port, a real Mosquitto, no agents)
gets 60 Server-Sent-Events clients at once, more than the 40 threads plain routes
share. While they all stay open, plain GETs still answer, and a job submitted then
reaches every stream as a ``job`` event. A stream that blocked a thread while it
waited would leave the GETs queued behind the streams' 15-second waits.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
from support.markers import needs_mosquitto
from support.mosquitto import Broker

from coordinator.local.broker import free_port
from coordinator.service.serve import serve_in_thread
from coordinator.service.settings import Settings

pytestmark = needs_mosquitto

CLIENTS = 60
ANSWER_S = 10.0
"""Generous for a GET on a loaded machine; blocked streams would hold it 15 s or more."""
JOB = {"model": "mlp", "steps": 2, "batch_size": 8, "microbatches": 2}


async def _first_lines(lines: AsyncIterator[str], want: str) -> list[str]:
    """Lines of a stream up to and including the first that starts with ``want``."""
    seen = []
    async for line in lines:
        seen.append(line)
        if line.startswith(want):
            return seen
    raise AssertionError(f"the stream ended before a line starting {want!r}: {seen}")


async def _check(url: str) -> None:
    limits = httpx.Limits(max_connections=CLIENTS + 10, max_keepalive_connections=0)
    async with (
        httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as streams,
        httpx.AsyncClient(base_url=url, timeout=ANSWER_S) as api,
        contextlib.AsyncExitStack() as stack,
    ):
        opened = [
            await stack.enter_async_context(streams.stream("GET", "/api/v1/events"))
            for _ in range(CLIENTS)
        ]
        assert {r.status_code for r in opened} == {200}
        assert {r.headers["content-type"] for r in opened} == {"text/event-stream; charset=utf-8"}
        lines = [r.aiter_lines() for r in opened]
        connected = await asyncio.wait_for(
            asyncio.gather(*(_first_lines(each, ": connected") for each in lines)), 60
        )
        assert all(seen == [": connected"] for seen in connected)
        for path in ("/healthz", "/api/v1/devices", "/api/v1/jobs"):
            response = await api.get(path)
            assert response.status_code == 200, (path, response.text)
        job = (await api.post("/api/v1/jobs", json=JOB)).json()["id"]
        events = await asyncio.wait_for(
            asyncio.gather(*(_first_lines(each, "data: ") for each in lines)), 60
        )
        for seen in events:
            assert seen[-2] == "event: job" and f'"id": "{job}"' in seen[-1], seen


def test_sixty_event_streams_leave_the_api_answering(mosquitto: Broker, tmp_path: Path) -> None:
    settings = Settings(broker_url=mosquitto.url, data_dir=tmp_path / "coord", port=free_port())
    with serve_in_thread(settings) as url:
        asyncio.run(_check(url))
