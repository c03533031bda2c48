"""The malloc tuning for training processes (edge/runtime/allocator.py).

tests/integration/test_allocator_env.py turns it off in a fresh process.
"""

from __future__ import annotations

import platform
import sys

import pytest

from edge.runtime.allocator import tune_malloc

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not GLIBC, reason="mallopt thresholds are a glibc feature")
def test_thresholds_are_set_once_per_process() -> None:
    assert tune_malloc() is True
    assert tune_malloc() is True  # the second call does nothing and says the same
