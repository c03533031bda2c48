"""The broker marker means what it says ([Note: the broker marker] in support/markers.py).

Each rule is checked on a small pytest session of its own, run in this process
with the plugin that tests/conftest.py registers; no broker starts.
"""

from __future__ import annotations

from typing import Any

import pytest
from support.markers import BrokerMarkers

import coordinator.local.broker as broker_mod

pytest_plugins = ["pytester"]


def test_a_test_using_a_broker_fixture_is_marked_broker(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
        import pytest

        @pytest.fixture
        def mosquitto():
            return "a broker"

        @pytest.fixture
        def control(mosquitto):  # through another fixture counts too
            return mosquitto
        """
    )
    pytester.makepyfile(
        """
        def test_direct(mosquitto): pass
        def test_through_control(control): pass
        def test_without(): pass
        """
    )
    result = pytester.runpytest_inprocess("-m", "not broker", plugins=[BrokerMarkers()])
    result.assert_outcomes(passed=1, deselected=2)
    result = pytester.runpytest_inprocess("-m", "broker", plugins=[BrokerMarkers()])
    result.assert_outcomes(passed=2, deselected=1)


def test_a_mosquitto_skip_without_the_marker_stops_the_run(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        from support.markers import needs_mosquitto

        @pytest.mark.skipif(False, reason="mosquitto not installed")
        def test_unmarked(): pass

        @pytest.mark.parametrize("x", [pytest.param(1, marks=needs_mosquitto)])
        def test_marked(x): pass
        """
    )
    result = pytester.runpytest_inprocess(plugins=[BrokerMarkers()])
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*not marked broker*test_unmarked*"])
    assert "test_marked" not in result.stderr.str()


def test_starting_mosquitto_in_a_test_without_the_marker_fails_it(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[Any] = []
    # What the plugin guards, standing in for Mosquitto: nothing starts here.
    monkeypatch.setattr(broker_mod, "_start_mosquitto", lambda *a: started.append(a))
    pytester.makepyfile(
        """
        import pytest
        import coordinator.local.broker as broker_mod

        def test_unmarked():
            broker_mod._start_mosquitto("unmarked")

        @pytest.mark.broker
        def test_marked():
            broker_mod._start_mosquitto("marked")
        """
    )
    result = pytester.runpytest_inprocess(plugins=[BrokerMarkers()])
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*test_unmarked starts Mosquitto but is not marked broker*"])
    assert started == [("marked",)]
    assert broker_mod._start_mosquitto.__name__ == "<lambda>"  # unguarded again after the run
