"""support.cli runs ``edgetrain`` in this process as its entry point does, and leaves the
process as it found it: the SIGTERM handler ``main`` installs, typer's excepthook, the
environment and the working directory are put back."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from support.cli import edgetrain


def test_a_refusal_is_status_2_and_one_line_and_the_process_is_put_back(
    tmp_path: Path,
) -> None:
    handler, hook, here = signal.getsignal(signal.SIGTERM), sys.excepthook, Path.cwd()
    environ = dict(os.environ)
    (tmp_path / "job.toml").write_text("steps = = 4\n")
    done = edgetrain(
        "submit",
        "job.toml",
        env={"EDGETRAIN_COORDINATOR": "http://127.0.0.1:9", "HOME": None},
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("error: job.toml: not valid TOML: ")  # read from cwd
    assert signal.getsignal(signal.SIGTERM) is handler
    assert sys.excepthook is hook
    assert os.environ == environ
    assert Path.cwd() == here


def test_a_usage_error_is_click_s_status_2_and_help_is_0() -> None:
    bad = edgetrain("plan", "--batch-size", "0")
    assert bad.returncode == 2
    assert "Invalid value for '--batch-size' / '-b'" in bad.stderr
    helped = edgetrain("plan", "--help")
    assert (helped.returncode, helped.stderr) == (0, "")
    assert "Usage: edgetrain plan [OPTIONS]" in helped.stdout
