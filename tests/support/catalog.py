"""The shipped device catalogue and a device file, as the catalogue's tests read them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from edge.profiling.catalog import catalogue_dir

__all__ = ["DEVICE", "TESTBED_NAMES", "rpi4_data", "shipped_files"]

DEVICE: dict[str, Any] = {
    "id": "from-the-file",
    "gflops": 12.5,
    "memory_bytes": 4_000_000_000,
    "bandwidth_mbps": 40.0,
    "latency_ms": 3.0,
    "details": {"emulated": True},
}
"""A planning-problem device, as ``edgetrain agent --profile FILE.json`` reads it."""


def shipped_files() -> list[Path]:
    """Every profile file in device_profiles/."""
    return sorted(catalogue_dir().glob("*.yaml"))


def rpi4_data() -> dict[str, Any]:
    """The shipped rpi4 profile as plain data, to corrupt a copy of."""
    data = yaml.safe_load((catalogue_dir() / "rpi4.yaml").read_text())
    assert isinstance(data, dict)
    return data


TESTBED_NAMES = ["rpi4-4gb", "rpi5-8gb", "jetson-nano", "laptop", "h100-sxm"]
"""Catalogue names the testbed's examples use."""
