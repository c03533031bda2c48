"""Fixtures shared by every test suite."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# tests/ is not a package: make tests/support importable whatever pytest's import mode.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from support.mosquitto import Broker, find_mosquitto, mosquitto_broker


@pytest.fixture
def mosquitto() -> Iterator[Broker]:
    """A fresh Mosquitto broker on a free loopback port; ``.url`` is ``mqtt://127.0.0.1:PORT``."""
    if find_mosquitto() is None:
        pytest.skip("mosquitto binary not found (on PATH or /usr/sbin/mosquitto)")
    with mosquitto_broker() as broker:
        yield broker
