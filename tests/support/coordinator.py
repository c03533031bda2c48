"""``edgetrain coordinator`` as a real process for a test, ended by its own pid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

__all__ = ["coordinator_process"]


@contextmanager
def coordinator_process(
    port: int,
    broker: str | None,
    data: Path,
    *,
    token: str | None = None,
    host: str | None = None,
    stderr: IO[bytes] | int = subprocess.DEVNULL,
) -> Iterator[subprocess.Popen[bytes]]:
    """The coordinator on ``port`` (of ``host``, loopback when not given) with ``broker``
    (``None``: its own, secure) and ``data``; an API token only when ``token`` is given.
    SIGTERM when the block ends (SIGKILL after 30 s); a process that ended or the block
    killed is left as it is."""
    env = {k: v for k, v in os.environ.items() if k != "EDGETRAIN_API_TOKEN"}
    if token is not None:
        env["EDGETRAIN_API_TOKEN"] = token
    cmd = [sys.executable, "-m", "edgetrain.cli", "coordinator", "--port", str(port)]
    if host is not None:
        cmd += ["--host", host]
    cmd += ["--data-dir", str(data), *(["--broker", broker] if broker else [])]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
