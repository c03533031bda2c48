"""SIGTERM ends a command the way Ctrl-C does: through its cleanup.

Python's default SIGTERM ends the process at once: no ``finally`` block and no
context manager's exit runs, so the broker and the agents a command started
(``edgetrain demo``, ``train``, ``coordinator``) would outlive it, and a
supervisor (systemd, docker, a CI runner) stops commands with SIGTERM. The
handler :func:`exit_on_sigterm` installs raises ``SystemExit(143)`` in the main
thread instead: the blocks that started the broker and the agents stop them as
they unwind, and the process ends with 143, the status a shell gives a process
ended by SIGTERM. Further SIGTERMs are ignored while that cleanup runs (a
second one would cut it short); SIGKILL still ends it at once. A cleanup still
running :data:`STACKS_AFTER_S` seconds after the signal writes every thread's stack to
standard error (:func:`faulthandler.dump_traceback_later`, which runs even while
the main thread is stuck), so a supervisor's log says where it hangs.

A command that serves until stopped installs its own handler over this one
(``edgetrain agent`` stops its daemon; uvicorn, under ``edgetrain coordinator``,
shuts its server down, then restores this handler and raises the signal again).

Tested in tests/e2e/test_sigterm.py, tests/integration/test_sigterm_cleanup.py and
tests/integration/test_event_stream_shutdown.py.
"""

from __future__ import annotations

import faulthandler
import signal
from types import FrameType

__all__ = ["TERMINATED", "exit_on_sigterm"]

TERMINATED = 128 + signal.SIGTERM
"""The exit status of a command ended by SIGTERM (143)."""

STACKS_AFTER_S = 30.0
"""Seconds of cleanup after SIGTERM before every thread's stack is written to stderr."""


def _cleaning_up(_signum: int, _frame: FrameType | None) -> None:
    """Further SIGTERMs while the first one's cleanup runs: ignored."""


def _terminate(_signum: int, _frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, _cleaning_up)
    faulthandler.dump_traceback_later(STACKS_AFTER_S, exit=False)
    raise SystemExit(TERMINATED)


def exit_on_sigterm() -> None:
    """Make SIGTERM raise ``SystemExit(143)`` in the main thread (see the module docstring).
    Call it from the main thread, once, before the command runs."""
    signal.signal(signal.SIGTERM, _terminate)
