"""Structured logs: one JSON object per line, with the device, job, stage and step.

:func:`setup_logging` installs the formatter on the root logger; code logs as
usual and passes context in ``extra`` (``log.info("...", extra={"job": j,
"stage": s, "step": t})``), or binds it once with :func:`bind`.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Mapping, MutableMapping
from typing import Any

__all__ = ["JsonFormatter", "bind", "setup_logging"]

_CONTEXT = ("device", "job", "stage", "step", "reason")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in _CONTEXT:
            value = getattr(record, key, None)
            if value is not None:
                out[key] = value
        if record.exc_info:
            out["error"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(level: str = "info", device: str | None = None) -> None:
    """JSON lines on standard error; ``device`` is added to every record."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    if device is not None:
        handler.addFilter(_AddDevice(device))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.Formatter.converter = time.gmtime


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
