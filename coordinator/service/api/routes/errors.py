"""Error bodies the routes declare in OpenAPI, so every response has a schema.

404, 409, 501 and 401 carry ``{"detail": "one line"}`` (:class:`Message`); a 422 is
FastAPI's own ``HTTPValidationError`` shape (``detail``: a list of ``loc``,
``msg``, ``type``), also when a route or a :class:`~edge.errors.UserError`
raises it, so a client parses one shape for every 422.
"""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException
from pydantic import BaseModel

__all__ = [
    "AUTH",
    "CONFLICT",
    "NOT_FOUND",
    "NOT_IMPLEMENTED",
    "Message",
    "unprocessable",
    "validation_detail",
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
