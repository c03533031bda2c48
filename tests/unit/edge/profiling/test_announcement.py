"""What an agent announces of its device (edge.profiling.announcement), without measuring.

The options are checked with the one-line messages ``edgetrain agent`` prints; a given
profile is announced as it is, a measured one as its link is shaped, an emulated one
as the catalogue device at this machine's speed slowed. Real agents announce in
tests/integration/test_agent_profile_file.py and test_agent_fixed_costs.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from support.catalog import DEVICE

from edge.errors import UserError
from edge.problem import DeviceSpec
from edge.profiling.announcement import (
    AnnounceOptions,
    emulating,
    resolve_announcement,
)
from edge.profiling.catalog import resolve
from edge.transport.settings import MqttSettings

MEASURED = DeviceSpec(
    id="pi-1",
    gflops=80.0,
    memory_bytes=64e9,
    bandwidth_mbps=1000.0,
    latency_ms=0.5,
    details={"hostname": "box"},
)
"""This machine, as a measurement might find it."""


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"link_mbps": 0.0}, "--link-mbps: must be a positive number (got 0)"),
        ({"link_mbps": -3.0}, "--link-mbps: must be a positive number (got -3)"),
        ({"link_mbps": math.inf}, "--link-mbps: must be a positive number (got inf)"),
        ({"link_latency_ms": -5.0}, "--link-latency-ms: must be 0 to 60000 (got -5)"),
        ({"link_latency_ms": 60_001.0}, "--link-latency-ms: must be 0 to 60000 (got 60001)"),
        ({"link_latency_ms": math.nan}, "--link-latency-ms: must be 0 to 60000 (got nan)"),
        ({"device": "tpu"}, "--device: 'tpu' is not cpu, cuda or cuda:N"),
        ({"emulate": "rpi4-4gb", "profile": "laptop"}, "--emulate and --profile: give one"),
    ],
)
def test_a_bad_option_is_one_line(options: dict[str, Any], message: str) -> None:
    with pytest.raises(UserError) as info:
        AnnounceOptions(**options)
    assert info.value.message == message and info.value.exit_code == 2


def test_the_link_is_checked_first() -> None:
    with pytest.raises(UserError, match=r"^--link-mbps"):
        AnnounceOptions(link_mbps=0.0, device="tpu", emulate="rpi4-4gb", profile="laptop")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_a_gpu_that_is_not_there_is_one_line() -> None:
    with pytest.raises(UserError) as info:
        AnnounceOptions(device="cuda:1")
    assert info.value.message == "--device cuda:1: torch sees no CUDA GPU on this machine"


def test_a_catalogue_profile_is_announced_as_it_is() -> None:
    options = AnnounceOptions(profile="rpi4-4gb", link_mbps=5.0, link_latency_ms=20.0)
    a = resolve_announcement("pi-4", options)
    given = resolve("rpi4-4gb").to_device_spec("pi-4", power=True)
    assert a.given == given and given.watts_busy is not None
    # Its frames are shaped, but the profile says what the device's link is.
    assert (a.link_mbps, a.link_latency_ms) == (5.0, 20.0)
    assert a.measure() == given


def test_a_device_file_is_announced_under_the_agents_id(tmp_path: Path) -> None:
    path = tmp_path / "dev.json"
    path.write_text(json.dumps(DEVICE))
    a = resolve_announcement("emu-7", AnnounceOptions(profile=str(path)))
    assert a.measure() == DeviceSpec.model_validate(DEVICE | {"id": "emu-7"})
    plain = tmp_path / "device"  # a file that exists, without the suffix
    plain.write_text(json.dumps(DEVICE))
    assert resolve_announcement("emu-8", AnnounceOptions(profile=str(plain))).given is not None


def test_an_unknown_name_fails_before_anything_is_measured() -> None:
    for options in (AnnounceOptions(emulate="rpi9"), AnnounceOptions(profile="rpi9")):
        with pytest.raises(UserError, match=r"^unknown device profile 'rpi9'"):
            resolve_announcement("pi-1", options)


def test_a_shaped_link_is_announced_capped_and_delayed() -> None:
    a = resolve_announcement("pi-1", AnnounceOptions(link_mbps=5.0, link_latency_ms=20.0))
    assert a.given is None
    spec = a.announced(MEASURED)
    assert (spec.bandwidth_mbps, spec.latency_ms) == (5.0, 20.5)
    fast = resolve_announcement("pi-1", AnnounceOptions(link_mbps=5000.0)).announced(MEASURED)
    assert (fast.bandwidth_mbps, fast.latency_ms) == (1000.0, 0.5)  # a cap, never a boost
    assert resolve_announcement("pi-1", AnnounceOptions()).announced(MEASURED) == MEASURED


def test_a_server_says_so_in_its_details() -> None:
    options = AnnounceOptions(server=True)
    spec = resolve_announcement("gpu-1", options).announced(MEASURED)
    assert spec.details == {"hostname": "box", "server": True, "torch_device": "cpu"}
    given = resolve_announcement("gpu-2", AnnounceOptions(profile="h100-sxm", server=True))
    assert given.given is not None and given.measure().details == {
        "scalar_score": 1260.0,  # the catalogue's (its host CPU's single core)
        "scalar_benchmark": "Geekbench 5 single-core",
        "server": True,
        "torch_device": "cpu",
    }


def test_an_emulated_device_announces_its_link_and_this_machines_speed_slowed() -> None:
    source = resolve("rpi4-4gb").to_device_spec(power=True)
    a = resolve_announcement("pi-2", AnnounceOptions(emulate="rpi4-4gb", slowdown=4.0))
    # Its frames are shaped to the catalogue device's link, which it then announces.
    assert (a.link_mbps, a.link_latency_ms) == (source.bandwidth_mbps, source.latency_ms)
    spec = a.announced(MEASURED)
    assert spec == emulating(MEASURED, "rpi4-4gb", 4.0).model_copy(
        update={"bandwidth_mbps": source.bandwidth_mbps, "latency_ms": source.latency_ms}
    )
    assert spec.gflops == 20.0 and spec.memory_bytes == source.memory_bytes
    assert (spec.watts_busy, spec.watts_idle) == (source.watts_busy, source.watts_idle)
    assert spec.details == {
        "hostname": "box",
        "emulates": "rpi4-4gb",
        "emulated_gflops": source.gflops,
        "measured_gflops": 80.0,
        "slowdown": 4.0,
    }
    # A link option wins over the device's, each on its own.
    options = AnnounceOptions(emulate="rpi4-4gb", link_mbps=7.0)
    own = resolve_announcement("pi-3", options).announced(MEASURED)
    assert (own.bandwidth_mbps, own.latency_ms) == (7.0, source.latency_ms)


def test_the_login_is_shaped_to_the_announced_link() -> None:
    a = resolve_announcement("pi-2", AnnounceOptions(emulate="rpi4-4gb"))
    login = MqttSettings(url="mqtt://broker.lan:1883", username="edge")
    shaped = a.shaped(login)
    assert (shaped.link_mbps, shaped.link_latency_ms) == (a.link_mbps, a.link_latency_ms)
    assert shaped.model_copy(update={"link_mbps": None, "link_latency_ms": 0.0}) == login
