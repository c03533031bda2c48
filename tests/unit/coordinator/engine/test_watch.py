"""The one device subscription (coordinator/engine/watch.py): validated, checked, undone.

:class:`~coordinator.engine.watch.DeviceFeed` hands on a device's status, profile
and heartbeat only when the message is well formed and names the device whose
topic it came on; :class:`~coordinator.engine.watch.DeviceWatch` turns a last
will into a death once it is confirmed. Messages are delivered by hand
(:class:`support.control.HandDelivered`), as the broker would.
"""

from __future__ import annotations

import time

from support.control import HandDelivered

from coordinator.engine.watch import CONFIRM_S, DeviceFeed, DeviceWatch
from edge.problem import DeviceSpec
from edge.wire.messages import DeviceStatus, Heartbeat
from edge.wire.topics import device_heartbeat, device_profile, device_status


class _Control(HandDelivered):
    """A connection that is up and never reconnected, as DeviceWatch reads it."""

    connected = True
    reconnects = 0


def _spec(device: str) -> DeviceSpec:
    return DeviceSpec(
        id=device, gflops=10.0, memory_bytes=2**30, bandwidth_mbps=100.0, latency_ms=1.0
    )


def test_the_feed_hands_on_checked_messages_and_drops_the_rest() -> None:
    control = _Control()
    got: list[tuple[str, str, object]] = []
    feed = DeviceFeed(
        control,
        on_status=lambda d, s: got.append(("status", d, s.state)),
        on_profile=lambda d, p: got.append(("profile", d, p.gflops)),
        on_heartbeat=lambda d, b: got.append(("heartbeat", d, b.step)),
    )
    with feed:
        control.publish(
            device_status("pi-1"),
            DeviceStatus(device="pi-1", state="online").model_dump_json().encode(),
        )
        control.publish(device_profile("pi-1"), _spec("pi-1").model_dump_json().encode())
        control.publish(
            device_heartbeat("pi-1"), Heartbeat(device="pi-1", step=3).model_dump_json().encode()
        )
        # Another device's status or heartbeat on pi-1's topic: dropped.
        control.publish(
            device_status("pi-1"),
            DeviceStatus(device="pi-2", state="offline").model_dump_json().encode(),
        )
        control.publish(
            device_heartbeat("pi-1"), Heartbeat(device="pi-2").model_dump_json().encode()
        )
        # Not a status, not a profile, not JSON: dropped.
        control.publish(device_status("pi-1"), b'{"device": "pi-1", "state": "dancing"}')
        control.publish(device_profile("pi-1"), b'{"id": "pi-1", "gflops": -1}')
        control.publish(device_heartbeat("pi-1"), b"\xff")
    assert got == [
        ("status", "pi-1", "online"),
        ("profile", "pi-1", 10.0),
        ("heartbeat", "pi-1", 3),
    ]
    assert control.subscriptions == []  # stop() undid every subscription
    control.publish(
        device_status("pi-1"), DeviceStatus(device="pi-1", state="busy").model_dump_json().encode()
    )
    assert len(got) == 3


def test_only_the_callbacks_given_are_subscribed() -> None:
    control = _Control()
    with DeviceFeed(control, on_status=lambda _d, _s: None):
        assert [pattern for pattern, _ in control.subscriptions] == [device_status("+")]


def test_a_last_will_is_a_death_once_confirmed_and_a_spoofed_one_is_not() -> None:
    control = _Control()
    with DeviceWatch(control, ["pi-1", "pi-2"], heartbeat_timeout_s=60.0) as watch:
        spoof = DeviceStatus(device="pi-2", state="offline")
        control.publish(device_status("pi-1"), spoof.model_dump_json().encode())
        will = DeviceStatus(device="pi-2", state="offline")
        control.publish(device_status("pi-2"), will.model_dump_json().encode())
        assert watch.dead_among(["pi-1", "pi-2"]) == []  # not confirmed yet
        time.sleep(CONFIRM_S + 0.05)
        assert watch.dead_among(["pi-1", "pi-2"]) == ["pi-2"]
        assert watch.alive(["pi-1", "pi-2"]) == ["pi-1"]
        assert "last will" in watch.dead["pi-2"][1]
