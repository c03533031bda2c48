"""Bounded waiting for tests: poll a condition until it holds or time runs out."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["until"]


def until(check: Callable[[], object], timeout: float, interval: float = 0.1) -> bool:
    """Whether ``check()`` became true within ``timeout`` seconds (polled every ``interval``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(interval)
    return bool(check())
