"""A limit on request bodies, as ASGI middleware: a body over ``max_bytes`` is a 413.

The limit is checked twice. A ``Content-Length`` over it is refused before the app
runs; and the bytes the app actually receives are counted as they arrive, so a
chunked body (no ``Content-Length``) or one longer than it claimed is cut off at
the limit rather than read whole into memory. The 413 is one line of JSON,
``{"detail": "..."}``, like the API's other errors.

The count is raised inside ``receive`` as :class:`BodyTooLarge`, an
``HTTPException``: FastAPI passes an ``HTTPException`` from body reading through
to its exception handler (anything else it turns into a 400), which answers 413.
Where the exception escapes the app instead, the middleware answers it itself.
"""

from __future__ import annotations

from fastapi import HTTPException
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["BodyLimitMiddleware", "BodyTooLarge"]


class BodyTooLarge(HTTPException):
    """A request body over the limit (status 413)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"the request body is over the limit of {max_bytes} bytes")


def _declared_length(scope: Scope) -> int | None:
    value = Headers(scope=scope).get("content-length")
    try:
        return None if value is None else int(value)
    except ValueError:  # the server refuses a malformed length before the app sees it
        return None


class BodyLimitMiddleware:
    """Refuse request bodies over ``max_bytes`` with a 413 (see the module)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _declared_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        received = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def noted_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, noted_send)
        except BodyTooLarge:
            if started:
                raise
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = BodyTooLarge(self.max_bytes)
        response = JSONResponse({"detail": error.detail}, status_code=error.status_code)
        await response(scope, receive, send)
