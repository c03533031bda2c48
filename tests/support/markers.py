"""The ``broker`` marker, kept true: every test that needs Mosquitto has it, and so
``-m "not broker"`` runs exactly the tests that do not.

[Note: the broker marker]
A test needs a Mosquitto binary when it

- uses a fixture that starts one (:data:`BROKER_FIXTURES`, directly or through
  another fixture): :class:`BrokerMarkers` marks it ``broker`` at collection, so
  nobody has to remember;
- is skipped when there is none: it says so with :data:`needs_mosquitto` (the skip
  and the marker together); a skip whose reason names mosquitto on a test without
  the marker stops the run at collection;
- starts one in this process (``support.mosquitto``, ``coordinator.local.broker``):
  Mosquitto started while a test without the marker runs fails that test, before
  any process starts.

A command that starts Mosquitto in a child process (``edgetrain demo``, ``train``,
``testbed up``) is out of sight of the last rule: such a test gets ``needs_mosquitto``.
tests/unit/test_markers.py checks all three rules on a session of its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator, Iterable
from typing import Any

import pytest

import coordinator.local.broker as broker_mod

__all__ = ["BROKER_FIXTURES", "NO_MOSQUITTO", "BrokerMarkers", "needs_mosquitto"]

BROKER_FIXTURES = frozenset({"mosquitto", "module_broker", "own_brokers", "secure_broker"})
"""Fixtures that start Mosquitto, or skip without it (tests/conftest.py, tests/e2e/conftest.py,
tests/integration/test_transport_conformance.py, tests/security/conftest.py)."""

NO_MOSQUITTO = "mosquitto binary not found (on PATH or /usr/sbin/mosquitto)"

needs_mosquitto = [
    pytest.mark.broker,
    pytest.mark.skipif(broker_mod.find_mosquitto() is None, reason=NO_MOSQUITTO),
]
"""For ``pytestmark`` or ``pytest.param(marks=...)``: needs Mosquitto, skipped without it."""


def _skipped_without_mosquitto(item: pytest.Item) -> bool:
    return any(
        "mosquitto" in str(mark.kwargs.get("reason", "")).lower()
        for mark in item.iter_markers("skipif")
    )


class BrokerMarkers:
    """A pytest plugin that applies and enforces the broker marker (see the module note)."""

    def __init__(self) -> None:
        self._running: pytest.Item | None = None
        self._unguarded: Callable[..., Any] | None = None

    def pytest_configure(self, config: pytest.Config) -> None:
        self._unguarded = broker_mod._start_mosquitto
        broker_mod._start_mosquitto = self._guard(self._unguarded)  # type: ignore[assignment]

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if self._unguarded is not None:
            broker_mod._start_mosquitto = self._unguarded  # type: ignore[assignment]

    def pytest_collection_modifyitems(self, items: Iterable[pytest.Item]) -> None:
        unmarked = []
        for item in items:
            if BROKER_FIXTURES & set(getattr(item, "fixturenames", ())):
                item.add_marker(pytest.mark.broker)
            elif item.get_closest_marker("broker") is None and _skipped_without_mosquitto(item):
                unmarked.append(item.nodeid)
        if unmarked:
            raise pytest.UsageError(
                "skipped without mosquitto but not marked broker "
                "(use support.markers.needs_mosquitto): " + ", ".join(unmarked)
            )

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, object, object]:
        outer, self._running = self._running, item
        try:
            return (yield)
        finally:
            self._running = outer

    def _guard(self, start: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(start)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            item = self._running
            if item is not None and item.get_closest_marker("broker") is None:
                pytest.fail(
                    f"{item.nodeid} starts Mosquitto but is not marked broker "
                    "(see [Note: the broker marker] in tests/support/markers.py)",
                    pytrace=False,
                )
            return start(*args, **kwargs)

        return guarded
