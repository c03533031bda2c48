"""`edgetrain devices list / show / validate`, run as the real command.

Corrupted copies of a profile are refused by `edgetrain devices validate` with
status 2 and one stderr line naming the file and the field; those refusals run in
this process through the command's entry point (support.cli), an unknown name for
`show` as a real process. The catalogue itself
is tests/unit/edge/profiling/test_catalog.py's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.catalog import TESTBED_NAMES, rpi4_data, shipped_files
from support.cli import edgetrain as edgetrain_here
from support.paths import ROOT

from edge.problem import DeviceSpec
from edge.profiling.catalog import (
    POWER_NOTE,
    all_resolved,
    catalogue_dir,
    load_catalogue,
    resolve,
)


def edgetrain(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the real `edgetrain` command (its root app and its error handling)."""
    return subprocess.run(
        [sys.executable, "-m", "edgetrain.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


# --- the command line ------------------------------------------------------------


def test_cli_list_json_has_every_variant() -> None:
    done = edgetrain("devices", "list", "--json")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    ids = [row["id"] for row in rows]
    assert {resolve(name).name for name in TESTBED_NAMES} <= set(ids)
    assert len(ids) == len(set(ids)) == len(all_resolved(load_catalogue()))
    row = next(r for r in rows if r["id"] == "rpi4-4gb")
    assert row["default"] is True and row["kind"] == "sbc"
    assert row["usable_memory_gib"] == resolve("rpi4-4gb").sizes.usable_gib
    assert row["link"]["bandwidth_mbps"] > 0
    assert row["power"] == {"busy_w": 6.4, "idle_w": 2.7, "note": POWER_NOTE}
    assert all(0 < r["power"]["idle_w"] <= r["power"]["busy_w"] for r in rows)


def test_cli_list_table_shows_predicted_busy_and_idle_watts() -> None:
    done = edgetrain("devices", "list")
    assert done.returncode == 0, done.stderr
    header = next(line for line in done.stdout.splitlines() if "busy/idle W" in line)
    pi = next(line for line in done.stdout.splitlines() if "rpi4-4gb *" in line)
    cells = [c.strip() for c in pi.split("│")]
    assert cells[[c.strip() for c in header.split("┃")].index("busy/idle W")] == "6.4/2.7"
    assert f"busy/idle W: power while training / while idle, {POWER_NOTE}." in done.stdout


def test_cli_show_as_device_with_power_carries_the_watts() -> None:
    done = edgetrain("devices", "show", "jetson-nano", "--as-device", "--power")
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert shown == resolve("jetson-nano").to_device_spec(power=True).model_dump(
        mode="json", exclude_none=True
    )
    assert (shown["watts_busy"], shown["watts_idle"]) == (10.0, 1.5)


@pytest.mark.slow
def test_cli_show_as_device_prints_the_planning_device() -> None:
    done = edgetrain("devices", "show", "rpi5-8gb", "--as-device", "--device-id", "pi-a")
    assert done.returncode == 0, done.stderr
    expected = resolve("rpi5-8gb").to_device_spec("pi-a")
    assert json.loads(done.stdout) == expected.model_dump(mode="json", exclude_none=True)
    assert DeviceSpec.model_validate_json(done.stdout) == expected
    full = edgetrain("devices", "show", "h100-sxm", "--json")
    assert full.returncode == 0, full.stderr
    shown = json.loads(full.stdout)
    assert shown["profile"]["sources"]["training"]
    assert shown["device"]["gflops"] == resolve("h100-sxm").profile.training.sustained_gflops


def test_cli_show_unknown_name_exits_2_with_one_line() -> None:
    done = edgetrain("devices", "show", "jetson-nan")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "jetson-nano" in lines[0]


@pytest.mark.slow
def test_cli_validate_accepts_the_shipped_catalogue() -> None:
    done = edgetrain("devices", "validate", *map(str, shipped_files()))
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("ok: ") == len(shipped_files())
    assert edgetrain("devices", "validate").returncode == 0


# --- corrupted profiles ----------------------------------------------------------


def _delete_bandwidth(d: dict[str, Any]) -> None:
    del d["link"]["bandwidth_mbps"]


def _negative_bandwidth(d: dict[str, Any]) -> None:
    d["link"]["bandwidth_mbps"] = -5


def _string_number(d: dict[str, Any]) -> None:
    d["training"]["sustained_gflops"] = "7.2"


def _unknown_field(d: dict[str, Any]) -> None:
    d["power"]["colour"] = "red"


def _sustained_above_peak(d: dict[str, Any]) -> None:
    d["training"]["sustained_gflops"] = 100.0


def _idle_above_busy(d: dict[str, Any]) -> None:
    d["power"]["idle_w"] = 9.0


def _no_busy_power(d: dict[str, Any]) -> None:
    del d["power"]["busy_w"]


CORRUPTIONS = [
    (_delete_bandwidth, "link.bandwidth_mbps", "Field required"),
    (_negative_bandwidth, "link.bandwidth_mbps", "greater than 0 (got -5)"),
    (_string_number, "training.sustained_gflops", "valid number"),
    (_unknown_field, "power.colour", "Extra inputs are not permitted"),
    (_sustained_above_peak, "training.sustained_gflops", "exceeds the peak cpu.peak_fp32_gflops"),
    (_idle_above_busy, "power", "idle_w (9.0) exceeds busy_w (6.4)"),
    (_no_busy_power, "power.busy_w", "Field required"),
]


@pytest.mark.parametrize(
    ("corrupt", "field", "why"),
    CORRUPTIONS,
    ids=[
        "missing-field",
        "negative-bandwidth",
        "string-number",
        "unknown-field",
        "above-peak",
        "idle-above-busy",
        "no-busy-power",
    ],
)
def test_cli_validate_refuses_a_corrupted_copy(
    tmp_path: Path, corrupt: Any, field: str, why: str
) -> None:
    data = rpi4_data()
    corrupt(data)
    path = tmp_path / "rpi4.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    done = edgetrain_here("devices", "validate", str(path))
    assert done.returncode == 2
    assert "ok:" not in done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"error: {path}: {field}: ")
    assert why in lines[0]


def test_cli_validate_reports_each_bad_file_and_passes_the_good(tmp_path: Path) -> None:
    good, bad = tmp_path / "rpi4.yaml", tmp_path / "bad" / "rpi4.yaml"
    bad.parent.mkdir()
    good.write_text((catalogue_dir() / "rpi4.yaml").read_text())
    data = rpi4_data()
    _negative_bandwidth(data)
    bad.write_text(yaml.safe_dump(data))
    done = edgetrain_here("devices", "validate", str(good), str(bad))
    assert done.returncode == 2
    assert done.stdout.strip() == f"ok: {good} (rpi4, 3 variants)"
    assert done.stderr.strip().splitlines() == [
        f"error: {bad}: link.bandwidth_mbps: Input should be greater than 0 (got -5)"
    ]
