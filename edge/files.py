"""Files that matter, written whole or not at all: :func:`write_atomic`.

[Note: nothing torn]
A trained model, a stage's weights, a neighbour replica, a checkpoint, a job
file, a testbed's state, a JSON file a command writes: whoever reads one (a
user, another process, this program after a crash or a power cut) finds the
old content or the new, never half of either. :func:`write_atomic` writes a
temporary file in the target's own directory (a rename is atomic only within
one file system), fsyncs it, renames it over the target and fsyncs the
directory, so that the rename itself survives a power cut. Whatever fails on
the way (the producer of the content, a full disk), the target keeps its old
content and the temporary file is removed.

Throwaway files (a broker's config in a directory of its own, a process's log,
a readiness marker) are written plainly.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["PRIVATE", "PUBLIC", "Content", "write_atomic"]

PUBLIC = 0o644
"""The mode of a file anyone on the machine may read (models, plans, job files)."""
PRIVATE = 0o600
"""The mode of a file that may hold a secret (a token, a password): its owner only."""

Content = bytes | str | Callable[[BinaryIO], object]
"""Bytes, text (written as UTF-8), or a producer that writes into the open binary file."""


def write_atomic(path: Path | str, data: Content, mode: int = PUBLIC) -> None:
    """Replace ``path`` with ``data`` atomically, the new file with permissions ``mode``.

    See [Note: nothing torn]. The parent directory is created when missing. The
    temporary file has ``mode`` from its creation on (never wider, whatever the
    umask), so a private file is never readable by others, even for a moment.
    Errors (``OSError``, or whatever a producer raises) propagate after the
    temporary file is removed; the target is then as it was.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            if isinstance(data, str):
                f.write(data.encode())
            elif isinstance(data, bytes | bytearray | memoryview):
                f.write(data)
            else:
                data(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(target.parent)


def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable; a file system that cannot sync a directory
    (some network and FUSE ones) still has the file, only without that guarantee."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
