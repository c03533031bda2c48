"""Unit tests start no process and open no socket (shared/DESIGN.md, tests/).

Every unit test runs with both refused: one that needs a process, a broker, a
socket or a process group fails here, and belongs in tests/integration/ or
tests/e2e/. (gloo opens its sockets in C++, out of sight of this check.)
"""

from __future__ import annotations

import _posixsubprocess
import os
import socket
import subprocess
from collections.abc import Callable
from typing import Any

import pytest


def _refuse(what: str) -> Callable[..., Any]:
    def refused(*args: Any, **kwargs: Any) -> Any:
        pytest.fail(
            f"a unit test {what}: it belongs in tests/integration/ or tests/e2e/ "
            "(see tests/unit/conftest.py)",
            pytrace=True,
        )

    return refused


@pytest.fixture(autouse=True)
def no_processes_or_sockets(monkeypatch: pytest.MonkeyPatch) -> None:
    # fork_exec is what subprocess (its own reference to it) and multiprocessing's spawn
    # start processes with.
    monkeypatch.setattr(subprocess, "_fork_exec", _refuse("starts a process"))
    monkeypatch.setattr(_posixsubprocess, "fork_exec", _refuse("starts a process"))
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, _refuse("starts a process"))
    for name in ("bind", "connect", "connect_ex"):
        monkeypatch.setattr(socket.socket, name, _refuse("opens a socket"))
