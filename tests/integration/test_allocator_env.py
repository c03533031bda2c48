"""The malloc tuning turned off from the environment, in a fresh process.

tests/unit/edge/runtime/test_allocator.py tests the tuning in this process.
"""

from __future__ import annotations

import os
import subprocess
import sys


def test_it_can_be_turned_off() -> None:
    code = "from edge.runtime.allocator import tune_malloc; print(tune_malloc())"
    env = {**os.environ, "EDGETRAIN_MALLOC_TUNE": "0"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
