"""What the bench charts need from the machine, set up before the unit guard starts.

matplotlib builds its font cache the first time it is imported on a machine (a new
user's, or CI's with an empty ``HOME``), and building it runs ``fc-list`` in a
subprocess, which the unit suite's guard refuses (tests/unit/conftest.py). The
session fixture below builds the cache once, before any test's guard is in place,
so a chart test meets the same matplotlib on a fresh machine as on a used one.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def matplotlib_font_cache() -> None:
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.font_manager  # building the cache is the import
