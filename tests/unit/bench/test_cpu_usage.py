"""bench/cpu_usage.py's pure parts: a process's CPU seconds, a cgroup's throttled time
(v1 and v2 files), and a series read at any time between its samples."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import ModuleType

import pytest
from support.bench import load_bench


@pytest.fixture(scope="module")
def usage() -> ModuleType:
    return load_bench("cpu_usage")


def test_a_process_cpu_seconds_grow_as_it_computes(usage: ModuleType) -> None:
    before = usage._process_cpu_s(os.getpid())
    end = time.process_time() + 0.1
    while time.process_time() < end:
        pass
    assert usage._process_cpu_s(os.getpid()) - before >= 0.05
    assert usage._process_cpu_s(2**22 + 1) == 0.0  # no such process


def test_throttled_time_from_v1_and_v2_cpu_stat(usage: ModuleType, tmp_path: Path) -> None:
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    v1.mkdir()
    v2.mkdir()
    (v1 / "cpu.stat").write_text("nr_periods 10\nnr_throttled 4\nthrottled_time 2500000000\n")
    (v2 / "cpu.stat").write_text("usage_usec 9\nthrottled_usec 1500000\n")
    assert usage._throttled_s(v1) == 2.5
    assert usage._throttled_s(v2) == 1.5
    assert usage._throttled_s(tmp_path / "none") == 0.0


def test_a_series_is_interpolated_between_samples(usage: ModuleType) -> None:
    series = usage._Series([10.0, 12.0, 14.0], [1.0, 2.0, 4.0], [0.0, 0.0, 1.0])
    assert series.at(11.0, series.cpu) == 1.5
    assert series.at(13.0, series.cpu) == 3.0
    assert series.at(9.0, series.cpu) == 1.0 and series.at(20.0, series.cpu) == 4.0
    assert series.at(13.5, series.throttled) == 0.75
