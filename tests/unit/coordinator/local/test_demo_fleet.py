"""The demo's ``--fleet``: catalogue names, each with its link's rate or the
``--link-mbps`` one; a bad item is one line naming it."""

from __future__ import annotations

import pytest

from coordinator.local.demo import DemoFleet, job_body
from edge.errors import UserError


def test_each_device_takes_its_own_rate_else_the_fleets_else_its_catalogue_devices() -> None:
    fleet = DemoFleet.parse("rpi4-4gb@20,rpi4-4gb, rpi4-4gb@2.5 ,laptop", link_mbps=50)
    assert fleet.names == ("rpi4-4gb",) * 3 + ("laptop",)
    assert fleet.links == (20.0, 50.0, 2.5, 50.0)
    assert fleet.roles().links == fleet.links
    assert fleet.slowdowns[3] == 1.0 and fleet.slowdowns[0] > 1
    plain = DemoFleet.parse("rpi4-4gb,rpi4-4gb,rpi4-4gb,laptop")
    assert plain.links == (None,) * 4  # each shapes to its catalogue device's link


@pytest.mark.parametrize("item", ["rpi4-4gb@", "rpi4-4gb@fast", "rpi4-4gb@0", "rpi4-4gb@-1"])
def test_a_bad_rate_is_one_line_naming_the_item(item: str) -> None:
    with pytest.raises(UserError, match=f"--fleet: '{item}': expected NAME@MBPS") as got:
        DemoFleet.parse(f"{item},rpi4-4gb,rpi4-4gb,laptop")
    assert "\n" not in str(got.value)


def test_the_job_takes_its_codec() -> None:
    assert job_body(10, 48, "auto", 0.05)["codec"] == "fp32"
    assert job_body(10, 48, "auto", 0.05, "auto")["codec"] == "auto"
