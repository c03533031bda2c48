"""A throwaway Mosquitto broker on a free loopback port, for tests and benchmarks.

A thin wrapper over :mod:`coordinator.local.broker`, the one implementation of starting
and stopping Mosquitto (its own config in a temporary directory, ready once that
process listens, ended by its own pid: SIGTERM, then SIGKILL after a grace
period). This module keeps the names the tests import.

Restarting a broker on the same port is ``mosquitto_broker(port=old.port)``
after the first one has stopped; ``password_file`` (a ``mosquitto_passwd``
file) turns anonymous access off.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from coordinator.local.broker import (
    BrokerStartError,
    MosquittoBroker,
    find_mosquitto,
    free_port,
    running_broker,
)
from coordinator.local.owned import OwnedBroker, start_owned_broker
from support.markers import NO_MOSQUITTO

__all__ = [
    "Broker",
    "BrokerStartError",
    "find_mosquitto",
    "free_port",
    "mosquitto_broker",
    "owned_mosquitto",
]

Broker = MosquittoBroker
"""``host``, ``port``, ``url`` (``mqtt://host:port``), ``proc``, ``log_path``, ``log()``."""


@contextmanager
def mosquitto_broker(
    port: int | None = None,
    *,
    password_file: Path | None = None,
    log_dir: Path | None = None,
    start_timeout_s: float = 10.0,
    grace_s: float = 5.0,
) -> Iterator[Broker]:
    """Run Mosquitto on ``127.0.0.1:port`` for the block; ``None`` picks a free port.

    A picked port can be taken by another process before Mosquitto binds it (tests
    run in parallel on shared machines), so then up to three ports are tried.
    """
    if find_mosquitto() is None:
        raise FileNotFoundError("mosquitto is not installed (looked on PATH and in /usr/sbin)")
    with running_broker(
        "mosquitto",
        port,
        log_dir,
        password_file=password_file,
        start_timeout_s=start_timeout_s,
        grace_s=grace_s,
    ) as broker:
        assert isinstance(broker, MosquittoBroker)
        yield broker


@contextmanager
def owned_mosquitto(prefix: str = "edgetrain-") -> Iterator[OwnedBroker]:
    """The broker ``edgetrain train`` and ``coordinator`` start, on Mosquitto: TLS, and
    accounts with grants (dynamic security) that the caller owns; the test is skipped
    where Mosquitto is missing."""
    if find_mosquitto() is None:
        pytest.skip(NO_MOSQUITTO)
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        owned = start_owned_broker(Path(tmp) / "broker", prefer="mosquitto", log_dir=Path(tmp))
        try:
            yield owned
        finally:
            owned.stop()
