"""The software link shaper on its own: rate, latency, order, never blocking, closing.

Timings are asserted with tolerances meant for a loaded two-core machine: a
rate within 0.8x-1.1x of the target, a latency never short and at most a few
tens of milliseconds long.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
from pydantic import ValidationError

from edge.transport.settings import MqttSettings
from edge.transport.shaping import MIN_BURST_BYTES, LinkShaper, ShapedDirection

MBIT = 1e6 / 8  # bytes per second in one Mbit/s
SLACK_S = 0.05  # how late a release may be on a busy machine


class Recorder:
    """A ``release`` callback that keeps ``(item, when)``."""

    def __init__(self) -> None:
        self.got: list[tuple[object, float]] = []
        self._cond = threading.Condition()

    def __call__(self, item: object) -> None:
        with self._cond:
            self.got.append((item, time.monotonic()))
            self._cond.notify_all()

    def wait_for(self, n: int, timeout: float = 5.0) -> bool:
        """Whether ``n`` items were released within ``timeout`` s."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self.got) >= n, timeout)

    @property
    def items(self) -> list[object]:
        return [item for item, _ in self.got]


def _threads(prefix: str = "link-") -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


def test_rate_over_4_mb_at_40_mbit() -> None:
    rec = Recorder()
    link = ShapedDirection[int]("rate", rec, mbps=40, latency_ms=0)
    size, n = 50_000, 80  # 4 MB: 0.8 s at 40 Mbit/s
    t0 = time.monotonic()
    for i in range(n):
        link.put(i, size)
    assert rec.wait_for(n, timeout=5)
    elapsed = rec.got[-1][1] - t0
    rate = size * n / elapsed
    assert 0.8 * 40 * MBIT <= rate <= 1.1 * 40 * MBIT, f"{rate / MBIT:.1f} Mbit/s"
    assert link.frames == n and link.bytes == size * n and link.backlog == 0
    assert 0.6 <= link.wait_s <= 1.2
    link.close()


def test_latency_is_added_to_every_frame_even_spaced_ones() -> None:
    rec = Recorder()
    link = ShapedDirection[int]("delay", rec, mbps=None, latency_ms=100)
    sent = []
    for i in range(3):
        sent.append(time.monotonic())
        link.put(i, 100)
        time.sleep(0.15)  # longer than the latency: frames do not queue behind each other
    assert rec.wait_for(3)
    for (_, released), put_at in zip(rec.got, sent, strict=True):
        assert 0.1 <= released - put_at <= 0.1 + SLACK_S
    link.close()


def test_latency_and_rate_add_up() -> None:
    rec = Recorder()
    link = ShapedDirection[int]("both", rec, mbps=8, latency_ms=200)
    t0 = time.monotonic()
    for i in range(5):
        link.put(i, 100_000)  # 500 kB at 1 MB/s: 0.5 s, less one burst, plus 0.2 s
    assert rec.wait_for(5)
    first, last = rec.got[0][1] - t0, rec.got[-1][1] - t0
    expected_last = 0.2 + (500_000 - link.burst_bytes) / (8 * MBIT)
    assert 0.2 + 0.09 <= first <= 0.2 + 0.1 + SLACK_S  # the first frame waits out its bytes too
    assert expected_last <= last <= expected_last + SLACK_S
    link.close()


def test_an_idle_link_still_takes_time_for_a_big_frame() -> None:
    """The bucket is 10 ms deep, not a frame deep: see [Note: the emulated link]."""
    rec = Recorder()
    link = ShapedDirection[int]("idle", rec, mbps=8)
    assert link.burst_bytes == 10_000
    time.sleep(0.3)  # idle long enough to pass the frame at once with a frame-deep bucket
    t0 = time.monotonic()
    link.put(0, 200_000)
    assert rec.wait_for(1)
    assert 0.19 - 0.01 <= rec.got[0][1] - t0 <= 0.19 + SLACK_S
    small = ShapedDirection[int]("small", Recorder(), mbps=0.1)
    assert small.burst_bytes == MIN_BURST_BYTES
    link.close()


def test_order_is_kept_whatever_the_sizes() -> None:
    rec = Recorder()
    link = ShapedDirection[int]("order", rec, mbps=200, latency_ms=5)
    rng = random.Random(7)
    for i in range(200):
        link.put(i, rng.choice((10, 1_000, 60_000)))
    assert rec.wait_for(200)
    assert rec.items == list(range(200))
    link.close()


def test_put_never_blocks_even_far_behind() -> None:
    link = ShapedDirection[bytes]("slow", Recorder(), mbps=1, latency_ms=1000, max_queued=1000)
    frame = bytes(10)  # the shaper only needs the size; nothing is copied
    t0 = time.monotonic()
    for _ in range(500):
        link.put(frame, 1_000_000)  # 500 MB at 1 Mbit/s: over an hour of link time
    assert time.monotonic() - t0 < 0.5
    assert link.backlog == 500
    link.close(0)


def test_a_full_queue_raises_connection_error_at_once() -> None:
    link = ShapedDirection[int]("tiny", Recorder(), mbps=1, max_queued=3)
    for i in range(3):  # the frame being waited for stays in the queue, so exactly 3 fit
        link.put(i, 1_000_000)
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=r"link tiny: 3 frames already wait.*1 Mbit/s"):
        link.put(3, 1_000_000)
    assert time.monotonic() - t0 < 0.1
    assert link.dropped == 1
    link.close(0)


def test_close_drains_within_the_timeout_still_shaped_and_stops_the_thread() -> None:
    rec = Recorder()
    link = ShapedDirection[int]("drain", rec, mbps=8, latency_ms=0)
    t0 = time.monotonic()
    for i in range(3):
        link.put(i, 100_000)
    assert link.close(timeout=2.0)
    took = time.monotonic() - t0
    assert rec.items == [0, 1, 2] and link.backlog == 0
    assert 0.29 - 0.02 <= took <= 0.29 + 0.2  # shaped, not dumped
    assert not _threads("link-drain")
    with pytest.raises(RuntimeError, match="closed"):
        link.put(3, 1)
    assert link.close()  # idempotent


def test_close_gives_up_at_the_timeout_and_counts_what_it_discarded() -> None:
    rec = Recorder()
    link = ShapedDirection[int]("stuck", rec, mbps=1, latency_ms=0)
    for i in range(10):
        link.put(i, 1_000_000)  # 8 s each
    t0 = time.monotonic()
    assert not link.close(timeout=0.2)
    assert time.monotonic() - t0 < 0.2 + 0.3
    assert not _threads("link-stuck")
    assert link.dropped == 10 - len(rec.got) and link.backlog == 0


def test_a_failing_release_is_counted_and_the_worker_goes_on() -> None:
    rec = Recorder()

    def release(item: int) -> None:
        if item == 1:
            raise OSError("boom")
        rec(item)

    link = ShapedDirection[int]("flaky", release)
    assert link.mbps is None
    for i in range(3):
        link.put(i, 10)
    assert rec.wait_for(2)
    assert rec.items == [0, 2] and link.release_errors == 1 and link.backlog == 0
    link.close()


def test_no_thread_until_the_first_frame() -> None:
    before = len(_threads())
    shaper = LinkShaper[int, int](10, 5, send=Recorder(), deliver=Recorder(), name="lazy")
    assert len(_threads()) == before
    shaper.up.put(1, 10)
    assert [t.name for t in _threads("link-lazy")] == ["link-lazy/up"]
    assert shaper.close(1.0)
    assert not _threads("link-lazy")


def test_the_two_directions_are_shaped_separately() -> None:
    up, down = Recorder(), Recorder()
    shaper = LinkShaper[int, int](8, 0, send=up, deliver=down, name="two")
    for i in range(10):
        shaper.up.put(i, 100_000)  # a second of upload
    t0 = time.monotonic()
    shaper.down.put(0, 1_000)
    assert down.wait_for(1)
    assert down.got[0][1] - t0 < SLACK_S  # not behind the upload
    stats = shaper.stats()
    assert stats["down.frames"] == 1 and stats["down.bytes"] == 1_000
    assert stats["up.backlog"] >= 8 and set(stats) >= {"up.wait_s", "down.held_s", "up.dropped"}
    assert shaper.describe() == "8 Mbit/s, 0 ms"
    shaper.close(0)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"mbps": 0.0}, "mbps must be a positive number"),
        ({"mbps": float("nan")}, "mbps must be a positive number"),
        ({"mbps": 1.0, "latency_ms": -1.0}, "latency_ms must be at least 0"),
        ({"mbps": 1.0, "max_queued": 0}, "max_queued must be at least 1"),
    ],
)
def test_bad_parameters_are_refused(kw: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ShapedDirection[int]("bad", Recorder(), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"link_mbps": 0}, "link_mbps"),
        ({"link_mbps": -3}, "link_mbps"),
        ({"link_mbps": float("inf")}, "link_mbps"),
        ({"link_latency_ms": -1}, "link_latency_ms"),
    ],
)
def test_settings_refuse_a_bad_link(kw: dict[str, float], field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        MqttSettings(**kw)  # type: ignore[arg-type]
    assert MqttSettings().link_mbps is None and MqttSettings().link_latency_ms == 0


def test_an_unshaped_mqtt_transport_has_no_shaper() -> None:
    from edge.transport.mqtt import MqttTransport

    assert MqttTransport(MqttSettings()).link is None
    shaped = MqttTransport(MqttSettings(link_latency_ms=5))
    assert shaped.link is not None and shaped.link.up.mbps is None
    assert shaped.link.up.latency_s == 0.005
