"""Health, live events (Server-Sent Events) and Prometheus metrics."""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import APIRouter, Response
from fastapi.responses import StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from coordinator.service.api.deps import ReadAuth, Services, ServicesDep
from coordinator.service.api.routes.errors import AUTH
from edge.wire.messages import StepReport

__all__ = ["FleetCollector", "router"]

router = APIRouter(tags=["system"])


@router.get("/healthz")
def healthz(services: ServicesDep) -> dict[str, object]:
    return {"status": "ok", "devices": len(services.registry.devices())}


@router.get("/api/v1/events", dependencies=[ReadAuth], responses=AUTH)
def events(services: ServicesDep) -> StreamingResponse:
    """Live updates as Server-Sent Events: ``device``, ``job`` and ``step`` events."""
    sub = services.bus.subscribe()

    def stream() -> Iterator[str]:
        try:
            yield ": connected\n\n"
            while not sub.closed:
                batch = sub.get(timeout=15.0)
                if not batch:
                    yield ": keep-alive\n\n"
                for event in batch:
                    yield event.sse()
        finally:
            sub.close()

    return StreamingResponse(
        stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


class FleetCollector(Collector):
    """Gauges computed at scrape time from the registry and the store."""

    def __init__(self, services: Services) -> None:
        self.services = services

    def collect(self) -> Iterator[GaugeMetricFamily]:
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
            "edgetrain_stage_wait_fraction",
            "Share of the last step a stage spent waiting (bubble)",
            labels=["job", "stage"],
        )
        link = GaugeMetricFamily(
            "edgetrain_link_bytes_per_second",
            "Bytes a stage sent per second in its last step",
            labels=["job", "stage"],
        )
        loss = GaugeMetricFamily("edgetrain_job_loss", "Last loss of a job", labels=["job"])
        store = self.services.store
        for job in store.list_jobs(limit=20, offset=0, state="running"):
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
        yield from (step, wait, link, loss)


@router.get("/metrics", dependencies=[ReadAuth], responses=AUTH)
def metrics(services: ServicesDep) -> Response:
    """Prometheus text format."""
    registry = CollectorRegistry()
    registry.register(FleetCollector(services))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
