"""The API token as the routes' dependencies ask for it: writes need it whenever it is set,
reads only with ``api_read_auth``.

Two routes of a small app, one guarded like every read route (``ReadAuth``) and one like
every write route (``WriteAuth``), run in process (FastAPI's TestClient, no socket);
the guards read nothing of the services but the settings.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from coordinator.service.api.deps import ReadAuth, Services, WriteAuth
from coordinator.service.settings import Settings

TOKEN = "x7Qm2vLr9TzKpW4nB8sD"
GOOD = {"Authorization": f"Bearer {TOKEN}"}
WRONG = {"Authorization": "Bearer x7Qm2vLr9TzKpW4nB8sE"}
NOT_BEARER = {"Authorization": f"Basic {TOKEN}"}


def _client(tmp_path: Path, **settings: object) -> TestClient:
    app = FastAPI()

    @app.get("/read", dependencies=[ReadAuth])
    def read() -> str:
        return "read"

    @app.post("/write", dependencies=[WriteAuth])
    def write() -> str:
        return "written"

    config = Settings(data_dir=tmp_path, **settings)  # type: ignore[arg-type]
    app.state.services = Services(config, None, None, None, None)  # type: ignore[arg-type]
    return TestClient(app)


def _statuses(client: TestClient, headers: dict[str, str] | None) -> tuple[int, int]:
    return (
        client.get("/read", headers=headers).status_code,
        client.post("/write", headers=headers).status_code,
    )


@pytest.mark.parametrize("headers", [None, GOOD, WRONG, NOT_BEARER])
def test_without_a_token_everything_is_open(tmp_path: Path, headers: dict[str, str] | None) -> None:
    assert _statuses(_client(tmp_path), headers) == (200, 200)
    assert _statuses(_client(tmp_path, api_read_auth=True), headers) == (200, 200)


def test_a_token_guards_the_writes_and_leaves_the_reads_open(tmp_path: Path) -> None:
    client = _client(tmp_path, api_token=TOKEN)
    assert _statuses(client, GOOD) == (200, 200)
    for headers in (None, WRONG, NOT_BEARER):
        assert _statuses(client, headers) == (200, 401)
    refused = client.post("/write")
    assert refused.headers["WWW-Authenticate"] == "Bearer"
    assert refused.json() == {
        "detail": "a valid 'Authorization: Bearer <token>' header is required"
    }
    assert TOKEN not in client.post("/write", headers=WRONG).text


def test_with_read_auth_the_reads_need_the_token_too(tmp_path: Path) -> None:
    client = _client(tmp_path, api_token=TOKEN, api_read_auth=True)
    assert _statuses(client, GOOD) == (200, 200)
    for headers in (None, WRONG, NOT_BEARER):
        assert _statuses(client, headers) == (401, 401)
