"""The malloc tuning for training processes (edge/runtime/allocator.py).

Integration, not unit: finding glibc (``ctypes.util.find_library``) runs ``ldconfig``,
and turning the tuning off is checked in a fresh process.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from edge.runtime.allocator import tune_malloc

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not GLIBC, reason="mallopt thresholds are a glibc feature")
def test_thresholds_are_set_once_per_process() -> None:
    assert tune_malloc() is True
    assert tune_malloc() is True  # the second call does nothing and says the same


def test_it_can_be_turned_off() -> None:
    code = "from edge.runtime.allocator import tune_malloc; print(tune_malloc())"
    env = {**os.environ, "EDGETRAIN_MALLOC_TUNE": "0"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
