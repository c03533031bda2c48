"""``POST /api/v1/plans``: the write token, and a fleet named in the body, never by a file.

The plans router runs in-process (FastAPI's TestClient, no socket) with a token set,
over the real device registry fed through a stand-in for the control connection
(support.control): one known device, ``pi-1``, has published its profile.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import SecretStr
from support.control import HandDelivered

from coordinator.service.api.deps import Services
from coordinator.service.api.routes import plans
from coordinator.service.events import EventBus
from coordinator.service.registry import DeviceRegistry
from coordinator.service.settings import Settings
from coordinator.service.store.sqlite import Store
from edge.problem import DeviceSpec
from edge.wire.topics import device_profile

TOKEN = "plans-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BOX = {"id": "box", "gflops": 50, "memory_bytes": 8e9, "bandwidth_mbps": 1000, "latency_ms": 0.5}
BODY: dict[str, Any] = {"model": "mlp", "batch_size": 8, "microbatches": 2}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    bus = EventBus()
    control = HandDelivered()
    with Store(tmp_path) as store:
        registry = DeviceRegistry(store, bus, control)
        registry.start()
        pi = DeviceSpec(id="pi-1", gflops=5, memory_bytes=4e9, bandwidth_mbps=900, latency_ms=0.2)
        control.publish(device_profile("pi-1"), pi.model_dump_json().encode())
        settings = Settings(data_dir=tmp_path, api_token=SecretStr(TOKEN))
        app = FastAPI()
        app.include_router(plans.router, prefix="/api/v1")
        app.state.services = Services(settings, store, bus, registry, None)  # type: ignore[arg-type]
        try:
            with TestClient(app) as c:
                yield c
        finally:
            registry.stop()
            bus.close()


def _refusal(client: TestClient, devices: list[Any], **extra: Any) -> tuple[list[Any], str]:
    response = client.post(
        "/api/v1/plans", json={**BODY, **extra, "devices": devices}, headers=AUTH
    )
    assert response.status_code == 422, response.text
    (detail,) = response.json()["detail"]
    return detail["loc"], detail["msg"]


def test_planning_needs_the_write_token(client: TestClient) -> None:
    body = {**BODY, "devices": ["laptop"]}
    assert client.post("/api/v1/plans", json=body).status_code == 401
    wrong = {"Authorization": "Bearer not-the-token-at-all"}
    assert client.post("/api/v1/plans", json=body, headers=wrong).status_code == 401
    assert client.post("/api/v1/plans", json=body, headers=AUTH).status_code == 200


def test_known_catalogue_and_inline_devices_make_the_fleet(client: TestClient) -> None:
    body = {**BODY, "devices": ["pi-1", "rpi4-4gb:2", BOX], "pin_first": "box"}
    response = client.post("/api/v1/plans", json=body, headers=AUTH)
    assert response.status_code == 200, response.text
    plan = response.json()
    assert plan["feasible"] is True
    assert plan["stages"][0]["device"] == "box"
    used = {stage["device"] for stage in plan["stages"]}
    assert all(s["devices"] == [s["device"]] and s["shares"] == [1.0] for s in plan["stages"])
    assert used <= {"pi-1", "rpi4-4gb-1", "rpi4-4gb-2", "box"}
    assert 0 < plan["lower_bound_step_s"] <= plan["step_time_s"]  # its certificate
    assert plan["gap"] == pytest.approx(plan["step_time_s"] / plan["lower_bound_step_s"] - 1)


@pytest.mark.parametrize("item", ["/etc/hostname", "../coord/edgetrain.db", "me.json", "a,b"])
def test_a_file_path_is_refused_naming_the_item(client: TestClient, item: str) -> None:
    loc, msg = _refusal(client, ["laptop", item])
    assert loc == ["body", "devices", 1, "name"]
    assert msg == (
        f"Value error, {item!r} is not a device name: the API reads no files and takes one "
        "device per item; give a measured device as an object in devices instead"
    )


def test_a_file_in_the_working_directory_is_never_read(
    client: TestClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command line reads ``NAME`` as a device file when one exists; the API does not."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mybox").write_text(json.dumps(BOX))
    loc, msg = _refusal(client, ["mybox"])
    assert loc == ["body"] and msg.startswith("unknown device profile 'mybox'")


@pytest.mark.parametrize(
    ("devices", "loc", "message"),
    [
        (
            [{**BOX, "gflops": 1e-300}],
            ["body", "devices", 0, "device", "gflops"],
            "greater than or equal to 0.001",
        ),
        ([{**BOX, "path": "/etc/hostname"}], ["body", "devices", 0, "device", "path"], "Extra"),
        (
            ["rpi4-4gb:300"],
            ["body", "devices", 0, "name"],
            "'rpi4-4gb:300': a count is at most 256",
        ),
        (["rpi4-4gb:200", "laptop:100"], ["body"], "devices: 300 devices in all, more than 256"),
    ],
)
def test_bad_devices_are_refused(
    client: TestClient, devices: list[Any], loc: list[Any], message: str
) -> None:
    got_loc, msg = _refusal(client, devices)
    assert got_loc == loc and message in msg, (got_loc, msg)


def test_model_options_out_of_bounds_are_refused(client: TestClient) -> None:
    loc, msg = _refusal(client, ["laptop"], model_options={"depth": 10**9})
    assert loc == ["body", "model_options"]
    assert msg == "model mlp: depth must be an integer from 2 to 1024 (got 1000000000)"
