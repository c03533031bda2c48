"""Health, live events (Server-Sent Events) and Prometheus metrics.

``/metrics`` serves the coordinator's registry (:func:`metrics_registry`), named by
Prometheus' conventions: units as suffixes (``_seconds``, ``_bytes_per_second``),
counters end in ``_total``, shares of a whole in ``_ratio``:

- ``edgetrain_build_info{version}``: always 1, the version serving;
- ``edgetrain_devices_online``: devices online or busy;
- per running job: ``edgetrain_job_steps_total{job}``, ``edgetrain_job_loss{job}``,
  and per stage ``edgetrain_stage_step_seconds{job,stage,device}``,
  ``edgetrain_stage_wait_ratio{job,stage}`` (the bubble) and
  ``edgetrain_link_bytes_per_second{job,stage}``, from its last step;
- prometheus-client's ``process_*``, ``python_info`` and ``python_gc_*``.

[Note: event streams hold no thread] ``/api/v1/events`` is an async generator on
the event loop that polls its subscription without blocking (every
:data:`EVENT_POLL_S`, with ``await asyncio.sleep``). A generator that blocked in
the subscription's wait would hold a threadpool worker per open browser for as
long as the stream lasts; the pool is small (40 by default) and every plain route
(``def``) needs one, so a few dozen dashboards would stall the whole API.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    GCCollector,
    Info,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from coordinator.service.api.deps import ReadAuth, Services, ServicesDep
from coordinator.service.api.routes.errors import AUTH
from edge import __version__
from edge.wire.messages import StepReport

__all__ = ["EVENT_POLL_S", "KEEP_ALIVE_S", "FleetCollector", "metrics_registry", "router"]

EVENT_POLL_S = 0.25
"""How often an event stream looks for new events, in seconds."""
KEEP_ALIVE_S = 15.0
"""Seconds without an event after which a stream sends a comment to keep it open."""

router = APIRouter(tags=["system"])


@router.get("/healthz")
def healthz(services: ServicesDep) -> dict[str, object]:
    return {"status": "ok", "devices": len(services.registry.devices())}


@router.get("/api/v1/events", dependencies=[ReadAuth], responses=AUTH)
async def events(services: ServicesDep) -> StreamingResponse:
    """Live updates as Server-Sent Events: ``device``, ``job`` and ``step`` events."""
    sub = services.bus.subscribe()

    async def stream() -> AsyncIterator[str]:
        # See [Note: event streams hold no thread]; the subscription closes when the
        # server stops ([Note: event streams end on shutdown] in coordinator.service.serve).
        try:
            yield ": connected\n\n"
            idle = 0.0
            while not sub.closed:
                batch = sub.get(timeout=0)
                for event in batch:
                    yield event.sse()
                if batch:
                    idle = 0.0
                    continue
                await asyncio.sleep(EVENT_POLL_S)
                idle += EVENT_POLL_S
                if idle >= KEEP_ALIVE_S:
                    yield ": keep-alive\n\n"
                    idle = 0.0
        finally:
            sub.close()

    return StreamingResponse(
        stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


class FleetCollector(Collector):
    """The fleet's and running jobs' metrics, computed at scrape time from the registry
    and the store."""

    def __init__(self, services: Services) -> None:
        self.services = services

    def collect(self) -> Iterator[Metric]:
        devices = self.services.registry.devices()
        online = GaugeMetricFamily("edgetrain_devices_online", "Devices online or busy")
        online.add_metric([], sum(d.state != "offline" for d in devices))
        yield online
        step = GaugeMetricFamily(
            "edgetrain_stage_step_seconds",
            "Last step time per stage",
            labels=["job", "stage", "device"],
        )
        wait = GaugeMetricFamily(
            "edgetrain_stage_wait_ratio",
            "Share of the last step a stage spent waiting (bubble)",
            labels=["job", "stage"],
        )
        link = GaugeMetricFamily(
            "edgetrain_link_bytes_per_second",
            "Bytes a stage sent per second in its last step",
            labels=["job", "stage"],
        )
        loss = GaugeMetricFamily("edgetrain_job_loss", "Last loss of a job", labels=["job"])
        steps = CounterMetricFamily(
            "edgetrain_job_steps", "Steps a running job has completed", labels=["job"]
        )
        store = self.services.store
        for job in store.list_jobs(limit=20, offset=0, state="running"):
            steps.add_metric([job.id], job.steps_done)
            latest: dict[int, StepReport] = {}
            for r in store.job_steps(job.id, from_step=max(0, job.steps_done - 1)):
                latest[r.stage] = r
            for stage, r in sorted(latest.items()):
                labels = [job.id, str(stage)]
                step.add_metric([*labels, r.device], r.step_s)
                if r.step_s > 0:
                    wait.add_metric(labels, r.wait_s / r.step_s)
                    link.add_metric(labels, r.bytes_sent / r.step_s)
                if r.loss is not None:
                    loss.add_metric([job.id], r.loss)
        yield from (steps, step, wait, link, loss)


def metrics_registry(services: Services) -> CollectorRegistry:
    """The coordinator's Prometheus registry (see the module docstring); the app makes one
    when it starts and keeps it as ``app.state.metrics_registry``."""
    registry = CollectorRegistry()
    Info("edgetrain_build", "The edgetrain version serving", registry=registry).info(
        {"version": __version__}
    )
    registry.register(FleetCollector(services))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


@router.get("/metrics", dependencies=[ReadAuth], responses=AUTH)
def metrics(request: Request) -> Response:
    """Prometheus text format."""
    registry: CollectorRegistry = request.app.state.metrics_registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
