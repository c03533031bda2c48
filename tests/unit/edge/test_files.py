"""write_atomic: the target holds the old content or the new, never part of either."""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import pytest

from edge.files import PRIVATE, write_atomic


@pytest.fixture
def umask() -> Iterator[None]:
    """A umask that would narrow 0o644 and widen nothing: the mode must not depend on it."""
    old = os.umask(0o077)
    yield
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_bytes_and_text_replace_the_file_with_the_mode_asked(tmp_path: Path, umask: None) -> None:
    target = tmp_path / "deep" / "model.safetensors"  # its folder is made
    write_atomic(target, b"\x00first")
    assert target.read_bytes() == b"\x00first" and _mode(target) == 0o644
    write_atomic(target, "second é", mode=PRIVATE)
    assert target.read_text() == "second é" and _mode(target) == 0o600
    assert sorted(p.name for p in target.parent.iterdir()) == ["model.safetensors"]


def test_a_producer_writes_into_the_file(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    write_atomic(target, lambda f: f.write(b'{"a": 1}'))
    assert target.read_bytes() == b'{"a": 1}'


def test_a_producer_that_fails_midway_leaves_the_old_content_and_no_temporary(
    tmp_path: Path,
) -> None:
    target = tmp_path / "weights.safetensors"
    target.write_bytes(b"old weights")
    target.chmod(0o640)

    def half(f: BinaryIO) -> None:
        f.write(b"new wei")
        f.flush()
        raise RuntimeError("the producer died")

    with pytest.raises(RuntimeError, match="the producer died"):
        write_atomic(target, half, mode=PRIVATE)
    assert target.read_bytes() == b"old weights" and _mode(target) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["weights.safetensors"]


def test_a_rename_that_fails_leaves_the_target_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "out"
    target.mkdir()  # a directory where the file should go: the rename fails at the end
    (target / "kept").write_text("x")
    with pytest.raises(IsADirectoryError):
        write_atomic(target, b"data")
    assert [p.name for p in target.iterdir()] == ["kept"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_concurrent_writers_never_mix(tmp_path: Path) -> None:
    """Threads of one process writing one target: each temporary is its own, so the file is
    one writer's content whole."""
    target = tmp_path / "replica.safetensors"
    blobs = [bytes([i]) * 300_000 for i in range(8)]
    threads = [threading.Thread(target=write_atomic, args=(target, b)) for b in blobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert target.read_bytes() in blobs
    assert [p.name for p in tmp_path.iterdir()] == ["replica.safetensors"]
