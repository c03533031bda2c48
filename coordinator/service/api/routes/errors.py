"""Error bodies the routes declare in OpenAPI, so every response has a schema.

404, 409, 501 and 401 carry ``{"detail": "one line"}`` (:class:`Message`); a 422 is
FastAPI's own ``HTTPValidationError`` shape (``detail``: a list of ``loc``,
``msg``, ``type``), also when a route or a :class:`~edge.errors.UserError`
raises it, so a client parses one shape for every 422.

A 422 echoes each refused ``input``, as FastAPI's does, but only what JSON can
carry: a body may hold ``NaN`` or ``Infinity`` (Python's JSON parser reads them),
which no JSON response can encode, and a string may hold a lone surrogate
(``"\\ud800"``, which Python's parser reads too), which UTF-8 cannot encode. So such
an input is left out (:func:`validation_error`), and a lone surrogate in a ``loc``
(a refused key) or a message is sent as its escape, rather than turning the refusal
into a 500.

Tested in tests/integration/test_api_hostile_bodies.py (NaN, Infinity and lone
surrogates refused as strict JSON) and tests/e2e/test_openapi_fuzz.py (every response as
documented).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import HTTPException, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel

__all__ = [
    "AUTH",
    "CONFLICT",
    "NOT_FOUND",
    "NOT_IMPLEMENTED",
    "Message",
    "unprocessable",
    "validation_detail",
    "validation_error",
]


class Message(BaseModel):
    """An error told in one line."""

    detail: str


NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"model": Message, "description": "No such id"}}
CONFLICT: dict[int | str, dict[str, Any]] = {409: {"model": Message, "description": "Wrong state"}}
NOT_IMPLEMENTED: dict[int | str, dict[str, Any]] = {
    501: {"model": Message, "description": "Needs an extra this coordinator lacks"}
}
AUTH: dict[int | str, dict[str, Any]] = {
    401: {"model": Message, "description": "Missing or wrong bearer token"}
}


def validation_detail(loc: list[str | int], msg: str) -> list[dict[str, Any]]:
    """One item of FastAPI's ``HTTPValidationError.detail``."""
    return [{"loc": loc, "msg": msg, "type": "value_error"}]


def unprocessable(loc: list[str | int], msg: str) -> HTTPException:
    """A 422 shaped like FastAPI's own validation errors, naming the field."""
    return HTTPException(422, validation_detail(loc, msg))


def _encodable(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False, ensure_ascii=False).encode()
    except (TypeError, ValueError):  # UnicodeEncodeError is a ValueError
        return False
    return True


def _utf8(value: Any) -> Any:
    """``value`` (a string, or a list of them and numbers) with each lone surrogate as its
    escape, ``\\ud800``: UTF-8 has no code for one, so a response could not carry it."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode()
    if isinstance(value, list):
        return [_utf8(item) for item in value]
    return value


async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 for a refused request, echoing no input JSON cannot encode."""
    errors = jsonable_encoder(exc.errors())
    for error in errors:
        if "input" in error and not _encodable(error["input"]):
            del error["input"]
        if "ctx" in error and not _encodable(error["ctx"]):
            del error["ctx"]
        error["loc"], error["msg"] = _utf8(error["loc"]), _utf8(error["msg"])  # a key is a loc
    return JSONResponse({"detail": errors}, status_code=422)
