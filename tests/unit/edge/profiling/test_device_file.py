"""A device file (``edgetrain agent --profile FILE.json``), read by edge.profiling.catalog.

tests/integration/test_agent_profile_file.py runs the agent on such files.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.catalog import DEVICE

from edge.errors import UserError
from edge.problem import DeviceSpec
from edge.profiling.catalog import load_device_file


def test_a_device_file_is_read_under_the_given_id(tmp_path: Path) -> None:
    path = tmp_path / "dev.json"
    path.write_text(json.dumps(DEVICE))
    spec = load_device_file(path, "emu-1")
    assert spec == DeviceSpec.model_validate(DEVICE | {"id": "emu-1"})
    path.write_text(json.dumps({k: v for k, v in DEVICE.items() if k != "id"}))
    assert load_device_file(path, "emu-2").id == "emu-2"  # the id may be left out


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (json.dumps(DEVICE | {"gflops": -1}), r"dev\.json: gflops: Input should be greater"),
        (json.dumps(DEVICE | {"bandwith_mbps": 1}), r"dev\.json: bandwith_mbps: Extra inputs"),
        (json.dumps({"gflops": 1.0}), r"dev\.json: memory_bytes: Field required"),
        (json.dumps([DEVICE]), r"dev\.json: expected one JSON object"),
        ("{not json", r"dev\.json: cannot read a device: Expecting"),
    ],
)
def test_a_bad_device_file_is_one_line_naming_it(
    tmp_path: Path, content: str, message: str
) -> None:
    path = tmp_path / "dev.json"
    path.write_text(content)
    with pytest.raises(UserError, match=message) as info:
        load_device_file(path, "emu-1")
    assert "\n" not in info.value.message and info.value.exit_code == 2
