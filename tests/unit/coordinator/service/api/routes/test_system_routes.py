"""``/metrics``: the coordinator's Prometheus registry, named by Prometheus' conventions.

The system router runs in-process (FastAPI's TestClient, no socket) over a real store
and the real device registry, whose messages come through a stand-in for the control
connection (support.control); one device is online and one job is running.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from support.control import HandDelivered

from coordinator.service.api.deps import Services
from coordinator.service.api.routes import system
from coordinator.service.events import EventBus
from coordinator.service.registry import DeviceRegistry
from coordinator.service.settings import Settings
from coordinator.service.store.sqlite import Store
from edge import __version__
from edge.wire.messages import DeviceStatus, StepReport
from edge.wire.topics import device_status


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    bus = EventBus()
    control = HandDelivered()
    with Store(tmp_path) as store:
        registry = DeviceRegistry(store, bus, control)  # type: ignore[arg-type]
        registry.start()
        for device, state in (("pi-1", "online"), ("pi-2", "offline")):
            status = DeviceStatus(device=device, state=state)
            control.publish(device_status(device), status.model_dump_json().encode())
        store.create_job("j1", {"model": "mlp", "steps": 5, "batch_size": 8})
        for state in ("planning", "running"):
            store.set_job_state("j1", state, steps_done=3)  # type: ignore[arg-type]
        for stage in (0, 1):
            report = StepReport(
                job="j1",
                step=2,
                stage=stage,
                device=f"pi-{stage + 1}",
                ts=1.0,
                step_s=0.5,
                wait_s=0.1,
                bytes_sent=1000,
                loss=1.25 if stage == 1 else None,
            )
            store.add_step("j1", report)
        services = Services(Settings(data_dir=tmp_path), store, bus, registry, None)  # type: ignore[arg-type]
        app = FastAPI()
        app.include_router(system.router)
        app.state.services = services
        app.state.metrics_registry = system.metrics_registry(services)
        try:
            with TestClient(app) as c:
                yield c
        finally:
            registry.stop()
            bus.close()


def _samples(client: TestClient) -> tuple[dict[str, str], list[Sample]]:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=")
    families = list(text_string_to_metric_families(response.text))
    types = {f.name: f.type for f in families}
    return types, [s for f in families for s in f.samples]


def test_metrics_follow_the_naming_conventions(client: TestClient) -> None:
    types, samples = _samples(client)
    for sample in samples:
        counter = types.get(sample.name.removesuffix("_total")) == "counter"
        assert sample.name.endswith(("_total", "_created")) == counter, sample
        assert "fraction" not in sample.name, sample
    by_name = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples}
    assert by_name[("edgetrain_build_info", (("version", __version__),))] == 1
    assert by_name[("edgetrain_devices_online", ())] == 1
    assert types["edgetrain_job_steps"] == "counter"
    assert by_name[("edgetrain_job_steps_total", (("job", "j1"),))] == 3
    assert by_name[("edgetrain_job_loss", (("job", "j1"),))] == 1.25
    for stage in ("0", "1"):
        labels = (("job", "j1"), ("stage", stage))
        assert by_name[("edgetrain_stage_wait_ratio", labels)] == pytest.approx(0.2)
        assert by_name[("edgetrain_link_bytes_per_second", labels)] == 2000
    step = ("edgetrain_stage_step_seconds", (("device", "pi-2"), ("job", "j1"), ("stage", "1")))
    assert by_name[step] == 0.5
    # prometheus-client's process, platform and GC collectors.
    names = {s.name for s in samples}
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes", "python_info"} <= names
    assert "python_gc_objects_collected_total" in names
