"""Structured logs: one JSON object per line, with the device, job, stage and step.

Both long-running processes log this way: ``edgetrain agent`` and ``edgetrain
coordinator`` call :func:`setup_logging` once, which installs the formatter on
the root logger, so every record of the process (``edge.*``, ``coordinator.*``,
and libraries such as uvicorn when they are left to propagate) is one line::

    {"ts": 1767225600.123, "level": "info", "logger": "coordinator.service.registry",
     "msg": "device pi-1: online -> offline", "device": "pi-1"}

Code logs as usual and passes context in ``extra`` (``log.info("...", extra={"job":
j, "stage": s, "step": t})``), or binds it once with :func:`bind`; the context keys
that appear are :data:`CONTEXT`, each only when set.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any, TextIO

from edge.errors import UserError

__all__ = ["CONTEXT", "LEVELS", "JsonFormatter", "bind", "setup_logging"]

CONTEXT = ("device", "job", "stage", "step", "reason")
"""The ``extra`` keys a JSON line carries, after ts, level, logger and msg."""

LEVELS = ("debug", "info", "warning", "error")
"""What ``--log-level`` takes."""


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in CONTEXT:
            value = getattr(record, key, None)
            if value is not None:
                out[key] = value
        if record.exc_info:
            out["error"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(
    level: str = "info", device: str | None = None, stream: TextIO | None = None
) -> None:
    """Every record of this process (and every warning) as a JSON line on ``stream``
    (standard error) from ``level`` up; ``device`` is added to every record. A ``level``
    not in :data:`LEVELS` is a :class:`~edge.errors.UserError`."""
    if level.lower() not in LEVELS:
        raise UserError(f"--log-level: {level!r} is not one of {', '.join(LEVELS)}")
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(JsonFormatter())
    if device is not None:
        handler.addFilter(_AddDevice(device))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.captureWarnings(True)  # a library's warnings too, as py.warnings records


class _AddDevice(logging.Filter):
    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = device

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "device", None) is None:
            record.device = self.device
        return True


class _Bound(logging.LoggerAdapter[logging.Logger]):
    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        kwargs["extra"] = {**(self.extra or {}), **kwargs.get("extra", {})}
        return msg, kwargs


def bind(logger: logging.Logger, **context: Any) -> logging.LoggerAdapter[logging.Logger]:
    """A logger that adds ``context`` (job, stage...) to every record."""
    extra: Mapping[str, Any] = context
    return _Bound(logger, extra)
