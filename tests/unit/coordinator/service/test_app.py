"""The guards ``create_app`` puts before every route: the ``Host`` check and the body limit.

The app is not started (the TestClient is not entered, so its lifespan, which would
start a broker, never runs): both guards answer before any route is reached, and
``/openapi.json`` needs no service.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from coordinator.service.app import create_app
from coordinator.service.settings import Settings

TOKEN = "x7Qm2vLr9TzKpW4nB8sD"


def _client(tmp_path: Path, **settings: object) -> TestClient:
    return TestClient(create_app(Settings(data_dir=tmp_path, **settings)))  # type: ignore[arg-type]


@pytest.mark.parametrize("host", ["localhost:8000", "127.0.0.1:8000", "[::1]:8000", "LOCALHOST"])
def test_loopback_hosts_are_answered(tmp_path: Path, host: str) -> None:
    response = _client(tmp_path).get("/openapi.json", headers={"Host": host})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("host", ["testserver", "evil.example:8000", "127.0.0.1.evil.example", ""])
def test_other_hosts_are_a_400(tmp_path: Path, host: str) -> None:
    response = _client(tmp_path).get("/openapi.json", headers={"Host": host})
    assert (response.status_code, response.text) == (400, "Invalid host header")


def test_the_served_host_and_allowed_hosts_are_answered(tmp_path: Path) -> None:
    client = _client(
        tmp_path, host="10.1.2.3", api_token=TOKEN, allowed_hosts=["pi.example", "*.lab.example"]
    )
    for host in ("10.1.2.3:8000", "pi.example", "a.lab.example:80", "localhost"):
        assert client.get("/openapi.json", headers={"Host": host}).status_code == 200, host
    for host in ("10.1.2.4", "lab.example.evil", "testserver"):
        assert client.get("/openapi.json", headers={"Host": host}).status_code == 400, host
    anyone = _client(tmp_path, allowed_hosts=["*"])
    assert anyone.get("/openapi.json", headers={"Host": "evil.example"}).status_code == 200


def test_a_body_over_max_body_bytes_is_a_413(tmp_path: Path) -> None:
    client = _client(tmp_path, max_body_bytes=100, allowed_hosts=["testserver"])
    response = client.post("/api/v1/jobs", content=b"{" + b" " * 100 + b"}")
    assert response.status_code == 413
    assert response.json() == {"detail": "the request body is over the limit of 100 bytes"}
    chunked = client.post("/api/v1/plans", content=iter([b"{", b" " * 100, b"}"]))
    assert "content-length" not in chunked.request.headers
    assert chunked.status_code == 413, chunked.text
    big = _client(tmp_path, allowed_hosts=["testserver"]).post(
        "/api/v1/jobs", content=b" " * ((1 << 20) + 1)
    )
    assert big.status_code == 413
