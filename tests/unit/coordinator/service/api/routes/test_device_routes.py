"""``GET /api/v1/devices``: the local datasets a device announces, read from its profile.

The devices router runs in-process (FastAPI's TestClient, no socket) over a real store
and the real device registry, whose messages come through a stand-in for the control
connection (support.control). tests/integration/test_agent_local_data.py has a real
agent announce them through a real broker.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from support.control import HandDelivered

from coordinator.service.api.deps import Services
from coordinator.service.api.routes import devices
from coordinator.service.events import EventBus
from coordinator.service.registry import DeviceRegistry
from coordinator.service.settings import Settings
from coordinator.service.store.sqlite import Store
from edge.models.local_data import LocalDatasetInfo
from edge.problem import DeviceSpec
from edge.wire.messages import DeviceStatus, Heartbeat
from edge.wire.topics import device_heartbeat, device_profile, device_status

SHARD: dict[str, Any] = {
    "kind": "zoo",
    "samples": 479,
    "input_shape": [1, 8, 8],
    "input_dtype": "float32",
    "label_shape": [],
    "label_dtype": "int64",
    "num_classes": 10,
    "source": "digits:shard=1/3",
}


def _announce(control: HandDelivered, device: str, state: str, datasets: Any) -> None:
    details = None if datasets is None else {"cores": 4, "datasets": datasets}
    spec = DeviceSpec(
        id=device, gflops=5, memory_bytes=4e9, bandwidth_mbps=100, latency_ms=2, details=details
    )
    control.publish(device_profile(device), spec.model_dump_json().encode())
    status = DeviceStatus(device=device, state=state)  # type: ignore[arg-type]
    control.publish(device_status(device), status.model_dump_json().encode())


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[TestClient, DeviceRegistry]]:
    bus = EventBus()
    control = HandDelivered()
    with Store(tmp_path) as store:
        registry = DeviceRegistry(store, bus, control)  # type: ignore[arg-type, unused-ignore]
        registry.start()
        _announce(control, "pi-1", "online", {"digits": SHARD})
        _announce(control, "pi-2", "offline", {"digits": {**SHARD, "source": "digits:shard=2/3"}})
        _announce(control, "pi-3", "busy", {"digits": SHARD, "junk": {"samples": "many"}})
        _announce(control, "laptop", "online", None)
        app = FastAPI()
        app.include_router(devices.router, prefix="/api/v1")
        app.state.services = Services(Settings(data_dir=tmp_path), store, bus, registry, None)  # type: ignore[arg-type]
        try:
            with TestClient(app) as c:
                yield c, registry
        finally:
            registry.stop()
            bus.close()


def test_the_devices_endpoint_shows_each_devices_datasets(
    fleet: tuple[TestClient, DeviceRegistry],
) -> None:
    client, _ = fleet
    listed = client.get("/api/v1/devices").json()
    assert {d["id"]: d["datasets"] for d in listed["data"]} == {
        "laptop": {},
        "pi-1": {"digits": SHARD},
        "pi-2": {"digits": {**SHARD, "source": "digits:shard=2/3"}},
        "pi-3": {"digits": SHARD},  # an entry that does not parse is left out
    }
    one = client.get("/api/v1/devices/pi-1").json()
    assert one["datasets"] == {"digits": SHARD}
    assert one["profile"]["details"]["datasets"] == {"digits": SHARD}


def test_holders_are_the_devices_not_offline_that_hold_the_name(
    fleet: tuple[TestClient, DeviceRegistry],
) -> None:
    _, registry = fleet
    info = LocalDatasetInfo.model_validate(SHARD)
    assert registry.holders("digits") == {"pi-1": info, "pi-3": info}
    assert registry.holders("junk") == {} and registry.holders("cifar") == {}


def test_a_plan_runs_on_idle_devices_and_a_what_if_also_on_busy_ones(
    fleet: tuple[TestClient, DeviceRegistry],
) -> None:
    _, registry = fleet
    assert [d.id for d in registry.available()] == ["laptop", "pi-1"]
    assert [d.id for d in registry.planning_profiles()] == ["laptop", "pi-1", "pi-3"]
    assert [d.id for d in registry.planning_profiles(["pi-2", "pi-3"])] == ["pi-3"]
    # What the planner reads: its figures and the datasets, not the rest of details.
    pi3 = registry.planning_profiles(["pi-3"])[0]
    assert pi3.details is not None and set(pi3.details) == {"datasets"}


def test_a_heartbeat_counts_only_for_a_device_that_announced_its_profile(
    fleet: tuple[TestClient, DeviceRegistry],
) -> None:
    """A device is never listed online before the planner can use it: a heartbeat of an
    unknown device is ignored, and one of a known device that went offline revives it."""
    client, registry = fleet
    control = registry.control

    def beat(device: str) -> None:
        payload = Heartbeat(device=device).model_dump_json().encode()
        control.publish(device_heartbeat(device), payload)

    beat("pi-9")
    assert registry.get("pi-9") is None
    assert "pi-9" not in {d["id"] for d in client.get("/api/v1/devices").json()["data"]}
    assert "pi-9" not in {d.id for d in registry.available()}
    beat("pi-2")
    assert registry.get("pi-2").state == "online"  # type: ignore[union-attr]
    assert "pi-2" in {d.id for d in registry.available()}
