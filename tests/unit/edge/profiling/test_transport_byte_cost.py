"""The per-byte cost an agent measures through its own transport
(:func:`edge.profiling.fixed_costs.measure_transport_byte_s`).

Claims under test, on an in-memory loopback (the real broker is in
``tests/integration/test_agent_fixed_costs.py``):

- every frame sent comes back decoded, and the cost is the CPU clock's seconds from
  a round's first publish until its last frame is back, over the bytes sent, over
  the share of a core: the median of the rounds after the first, which warms up;
- frames that do not come back raise a one-line :class:`UserError` within the
  timeout, and the subscription is ended either way;
- a device's announced quota (:func:`cpu_quota_of`) is read back only when it is a
  positive number;
- :func:`with_transport_byte_cost` replaces only ``byte_s`` and says so in details,
  and leaves a device without fixed costs alone.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from edge.errors import UserError
from edge.problem import DeviceSpec
from edge.profiling.fixed_costs import (
    FixedCosts,
    cpu_quota_of,
    fixed_costs_of,
    measure_transport_byte_s,
    with_transport_byte_cost,
)
from edge.wire.frames import decode_frame


class _Loopback:
    """Delivers each publish to the subscriber at once (or drops it with ``lose``)."""

    def __init__(self, lose: bool = False) -> None:
        self.lose = lose
        self.callbacks: dict[str, Callable[[str, bytes], None]] = {}
        self.sent: list[bytes] = []
        self.unsubscribed: list[str] = []

    def publish(self, topic: str, payload: bytes | str, qos: int = 1, retain: bool = False) -> None:
        assert isinstance(payload, bytes) and qos == 1 and not retain
        self.sent.append(payload)
        if not self.lose and topic in self.callbacks:
            self.callbacks[topic](topic, payload)

    def subscribe(self, topic: str, callback: Callable[[str, bytes], None], qos: int = 1) -> None:
        self.callbacks[topic] = callback

    def unsubscribe(self, topic: str) -> None:
        self.unsubscribed.append(topic)
        self.callbacks.pop(topic, None)


def test_the_cost_is_the_median_round_after_a_warm_up_over_the_bytes() -> None:
    loop = _Loopback()
    # Each round reads the clock twice: 9 s for the warm-up, then 0.3, 0.9 and 0.5 s.
    reads = iter([0.0, 9.0, 10.0, 10.3, 20.0, 20.9, 30.0, 30.5])
    got = measure_transport_byte_s(
        loop,
        "probe",
        total_bytes=1 << 20,
        piece_bytes=256 << 10,
        rounds=3,
        cpu_share=0.25,
        cpu_clock=lambda: next(reads),
    )
    assert len(loop.sent) == 4 * 4 and loop.unsubscribed == ["probe"]
    assert all(decode_frame(f).tensor.numel() == (256 << 10) // 4 for f in loop.sent)
    per_round = sum(len(f) for f in loop.sent[:4])
    assert got == pytest.approx(0.5 / per_round / 0.25, rel=1e-12)


def test_frames_that_do_not_come_back_fail_clearly() -> None:
    loop = _Loopback(lose=True)
    with pytest.raises(UserError, match=r"0 of 2 frames came back on probe within 0.05 s"):
        measure_transport_byte_s(loop, "probe", total_bytes=2, piece_bytes=1, timeout_s=0.05)
    assert loop.unsubscribed == ["probe"]
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        measure_transport_byte_s(_Loopback(), "probe", rounds=0)
    with pytest.raises(ValueError, match="cpu_share must be positive"):
        measure_transport_byte_s(_Loopback(), "probe", cpu_share=0.0)


def test_the_measured_cost_replaces_only_byte_s() -> None:
    fixed = FixedCosts(0.01, 0.02, 0.003, 1e-9)
    device = DeviceSpec(
        id="pi",
        gflops=7.0,
        memory_bytes=4e9,
        bandwidth_mbps=100.0,
        latency_ms=1.0,
        details={"fixed_costs": fixed.to_json()},
    )
    got = with_transport_byte_cost(device, 2e-8)
    assert fixed_costs_of(got) == FixedCosts(0.01, 0.02, 0.003, 2e-8)
    assert got.details is not None
    assert got.details["transport_byte_ms_per_mib"] == pytest.approx(2e-8 * (1 << 20) * 1e3)
    bare = device.model_copy(update={"details": None})
    assert with_transport_byte_cost(bare, 2e-8) == bare


@pytest.mark.parametrize(
    ("details", "want"),
    [({"cpu_quota": 0.117}, 0.117), ({"cpu_quota": 2}, 2.0), ({}, None), (None, None)]
    + [({"cpu_quota": bad}, None) for bad in (0, -0.5, "0.1", True, None)],
)
def test_the_announced_quota_is_read_back_when_it_is_a_positive_number(
    details: dict[str, object] | None, want: float | None
) -> None:
    device = DeviceSpec(
        id="pi", gflops=7.0, memory_bytes=4e9, bandwidth_mbps=100.0, latency_ms=1.0
    ).model_copy(update={"details": details})
    assert cpu_quota_of(device) == want
