"""The request body limit: a 413 from ``Content-Length``, and from the bytes received
when there is none (a chunked body), before the body is read whole.

The middleware runs in process: behind FastAPI's TestClient in front of a real route,
and alone under a hand-made ASGI ``receive`` that hands the body over in chunks, so
the test sees how much of it was read.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel
from starlette.types import Message, Receive, Scope, Send

from coordinator.service.body_limit import BodyLimitMiddleware

LIMIT = 1000
JSON = {"Content-Type": "application/json"}
ONE_LINE = {"detail": f"the request body is over the limit of {LIMIT} bytes"}


class Note(BaseModel):
    text: str


@pytest.fixture
def app() -> tuple[FastAPI, list[int]]:
    """A FastAPI app with one JSON route behind the limit, and the sizes it accepted."""
    app = FastAPI()
    app.add_middleware(BodyLimitMiddleware, max_bytes=LIMIT)
    seen: list[int] = []

    @app.post("/notes")
    def add(note: Note) -> dict[str, int]:
        seen.append(len(note.text))
        return {"length": len(note.text)}

    return app, seen


def _body(size: int) -> bytes:
    """A JSON ``Note`` of exactly ``size`` bytes."""
    body = json.dumps({"text": "x" * (size - len('{"text": ""}'))}).encode()
    assert len(body) == size
    return body


def _chunks(body: bytes, size: int = 100) -> Iterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start : start + size]


def test_a_body_up_to_the_limit_is_accepted(app: tuple[FastAPI, list[int]]) -> None:
    api, seen = app
    with TestClient(api) as client:
        exact = client.post("/notes", headers=JSON, content=_body(LIMIT))
        assert exact.status_code == 200, exact.text
        chunked = client.post("/notes", headers=JSON, content=_chunks(_body(LIMIT)))
        assert "content-length" not in chunked.request.headers
        assert chunked.status_code == 200, chunked.text
    assert seen == [LIMIT - 12, LIMIT - 12]


def test_a_content_length_over_the_limit_is_a_one_line_413(
    app: tuple[FastAPI, list[int]],
) -> None:
    api, seen = app
    with TestClient(api) as client:
        response = client.post("/notes", headers=JSON, content=_body(LIMIT + 1))
    assert response.status_code == 413
    assert response.headers["content-type"] == "application/json"
    assert response.json() == ONE_LINE and b"\n" not in response.content
    assert seen == []


def test_a_chunked_body_over_the_limit_is_a_413(app: tuple[FastAPI, list[int]]) -> None:
    api, seen = app
    with TestClient(api) as client:
        response = client.post("/notes", headers=JSON, content=_chunks(_body(LIMIT + 1)))
    assert "content-length" not in response.request.headers
    assert response.status_code == 413, response.text
    assert response.json() == ONE_LINE
    assert seen == []


async def _drive(app: Any, headers: list[tuple[bytes, bytes]], chunks: list[bytes]) -> Any:
    """Run ``app`` behind the limit on a request whose body comes in ``chunks``; the
    number of chunks received and the response's messages."""
    given = 0
    sent: list[Message] = []

    async def receive() -> Message:
        nonlocal given
        given += 1
        more = given < len(chunks)
        return {"type": "http.request", "body": chunks[given - 1], "more_body": more}

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/", "headers": headers}
    await BodyLimitMiddleware(app, max_bytes=LIMIT)(scope, receive, send)
    return given, sent


async def _read_all(scope: Scope, receive: Receive, send: Send) -> None:
    """A bare ASGI app that reads the whole body, then answers 200."""
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"read"})


def test_a_chunked_body_is_cut_off_at_the_limit_not_read_whole() -> None:
    chunks = [b"x" * 300] * 10  # 3000 bytes; the limit is passed in the 4th chunk
    given, sent = asyncio.run(_drive(_read_all, [], chunks))
    assert given == 4
    body = sent[1]["body"]
    assert sent[0] == {
        "type": "http.response.start",
        "status": 413,
        "headers": [
            (b"content-length", str(len(body)).encode()),
            (b"content-type", b"application/json"),
        ],
    }
    assert json.loads(body) == ONE_LINE
    under, ok = asyncio.run(_drive(_read_all, [], [b"x" * 250] * 4))
    assert (under, ok[0]["status"]) == (4, 200)


def test_a_content_length_over_the_limit_is_refused_before_any_byte_is_read() -> None:
    headers = [(b"content-length", str(LIMIT + 1).encode())]
    given, sent = asyncio.run(_drive(_read_all, headers, [b"x" * (LIMIT + 1)]))
    assert given == 0
    assert sent[0]["status"] == 413 and json.loads(sent[1]["body"]) == ONE_LINE


def test_other_scopes_pass_through_untouched() -> None:
    seen: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(scope["type"])

    async def nothing() -> Message:
        return {"type": "lifespan.startup"}

    async def ignore(message: Message) -> None:
        return None

    asyncio.run(BodyLimitMiddleware(app, max_bytes=LIMIT)({"type": "lifespan"}, nothing, ignore))
    assert seen == ["lifespan"]
