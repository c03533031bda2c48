"""SIGTERM raises SystemExit(143) in the main thread, and a cleanup that hangs says where.

A child Python process installs :func:`edgetrain.cli.signals.exit_on_sigterm` and
signals itself; its cleanup (a ``finally``) then either ends at once or stays stuck
past :data:`~edgetrain.cli.signals.STACKS_AFTER_S` (made short here), in a function
of a name the test looks for on standard error.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from edgetrain.cli.signals import TERMINATED

CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    from edgetrain.cli import signals
    signals.STACKS_AFTER_S = 0.3
    signals.exit_on_sigterm()

    def stuck_in_cleanup():
        time.sleep(float(sys.argv[1]))

    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the handler raises SystemExit before this ends
    finally:
        print("cleanup", flush=True)
        stuck_in_cleanup()
    """
)


def _run(cleanup_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(cleanup_s)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_sigterm_runs_the_cleanup_and_exits_143() -> None:
    done = _run(0.0)
    assert (done.returncode, done.stdout) == (TERMINATED, "cleanup\n"), done.stderr
    assert "stuck_in_cleanup" not in done.stderr


def test_a_cleanup_that_hangs_writes_every_threads_stack() -> None:
    done = _run(2.0)
    assert done.returncode == TERMINATED, done.stderr
    assert "Timeout (0:00:00" in done.stderr and "stuck_in_cleanup" in done.stderr, done.stderr
