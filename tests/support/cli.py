"""Run the ``edgetrain`` command in this test process, through its entry point.

A fresh ``python -m edgetrain.cli`` costs a CPU-second or more before the command
parses a thing; the tests of bad input (an exit status and a one-line error) need
none of it. :func:`edgetrain` calls :func:`edgetrain.cli.main` itself, with
``sys.argv`` set and typer's CliRunner isolation around it (stdin, stdout and stderr
swapped, the environment overridden), and answers as ``subprocess.run(...,
capture_output=True, text=True)`` would: the exit status, stdout and stderr.

Use it only for a command that starts no process, broker or server; every command
keeps at least one test of the real entry point in a subprocess. What a command may
change in this process is put back afterwards: the SIGTERM and SIGINT handlers
(``main`` installs one), ``sys.excepthook`` (typer sets its own), ``sys.argv``,
the environment, the working directory, the root logger's handlers and level, and
torch's thread count. glibc's malloc thresholds (``train`` tunes them once past its
checks) stay: they change speed, not behaviour.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from typer.testing import CliRunner

from support.paths import ROOT

__all__ = ["edgetrain"]


def edgetrain(
    *args: str, env: Mapping[str, str | None] | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    """``edgetrain ARGS`` run in this process from ``cwd``, with ``env``'s variables set
    (``None``: unset) for the run; an exception other than ``SystemExit`` propagates."""
    from edgetrain.cli import main

    argv = sys.argv
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    hook = sys.excepthook
    environ = dict(os.environ)
    here = Path.cwd()
    root = logging.getLogger()
    logs = (list(root.handlers), root.level)
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    status: int = 0
    try:
        os.chdir(cwd)
        with CliRunner().isolation(env=env) as (out, err, _):
            sys.argv = ["edgetrain", *args]
            try:
                main()
            except SystemExit as exc:
                status = _status(exc.code)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
            stdout, stderr = out.getvalue().decode(), err.getvalue().decode()
        return subprocess.CompletedProcess(["edgetrain", *args], status, stdout, stderr)
    finally:
        sys.argv = argv
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        sys.excepthook = hook
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(here)
        root.handlers[:] = logs[0]
        root.setLevel(logs[1])
        if threads is not None:
            sys.modules["torch"].set_num_threads(threads)


def _status(code: object) -> int:
    """The exit status Python gives ``SystemExit(code)``; a message is printed as it does."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
