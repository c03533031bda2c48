"""A step report's timeline (:mod:`edge.wire.timeline`) and the clock that keeps it
(:mod:`edge.runtime.step_clock`).

- the text round-trips every interval to the microsecond, and a report refuses text
  that is not a timeline, with the field named;
- the clock sums what it timed into ``wait_s`` and ``send_s`` and lists each wait and
  send where it happened, from the step's start;
- a step report refuses figures that JSON could not serve once summed.
"""

from __future__ import annotations

import time

import pytest
from pydantic import ValidationError

from edge.runtime.step_clock import StepClock
from edge.wire.messages import MessageError, StepReport, parse_event
from edge.wire.timeline import Interval, format_timeline, parse_timeline


def test_the_text_round_trips_to_the_microsecond() -> None:
    intervals = [
        Interval("w", "A", 0, 0.0, 0.0123456),
        Interval("s", "G", 12, 1.5, 1.5000004),
        Interval("w", "L", 1023, 3600.25, 3600.5),
    ]
    text = format_timeline(intervals)
    assert text == "wA0@0.000+12.346 sG12@1500.000+0.000 wL1023@3600250.000+250.000"
    back = parse_timeline(text)
    for got, want in zip(back, intervals, strict=True):
        assert (got.op, got.what, got.microbatch) == (want.op, want.what, want.microbatch)
        assert got.start_s == pytest.approx(want.start_s, abs=1e-6)
        assert got.seconds == pytest.approx(want.seconds, abs=1e-6)
    assert parse_timeline("") == []


@pytest.mark.parametrize(
    "text", ["xA0@1+1", "wA0@1", "wQ0@1+1", "wA0@-1+1", "wA0@1+1  wA1@1+1", "wA0@1+1 ", "wA@1+1"]
)
def test_a_report_refuses_text_that_is_not_a_timeline(text: str) -> None:
    with pytest.raises(ValueError, match="not a step timeline"):
        parse_timeline(text)
    with pytest.raises(ValidationError, match="timeline"):
        StepReport(job="j1", stage=0, device="d", step=0, timeline=text)


def test_a_report_bounds_its_timeline() -> None:
    one = "wA0@0.000+0.001"
    fits = " ".join([one] * (196608 // (len(one) + 1)))
    assert StepReport(job="j1", stage=0, device="d", step=0, timeline=fits).timeline == fits
    with pytest.raises(ValidationError, match="timeline"):
        StepReport(job="j1", stage=0, device="d", step=0, timeline=fits + " " + one)


def test_the_clock_sums_and_lists_what_it_timed() -> None:
    clock = StepClock()
    before = time.time()
    time.sleep(0.01)
    with clock.waiting("A", 2):
        time.sleep(0.02)
    with clock.sending("G", 2):
        time.sleep(0.01)
    with pytest.raises(RuntimeError), clock.waiting("G", 3):  # a wait that failed is timed too
        raise RuntimeError("timed out")
    wait, send = parse_timeline(clock.timeline())[:2]
    assert clock.started_at <= before
    assert (wait.op, wait.what, wait.microbatch) == ("w", "A", 2)
    assert (send.op, send.what, send.microbatch) == ("s", "G", 2)
    assert 0.01 <= wait.start_s < send.start_s and wait.end_s <= send.start_s + 1e-6
    assert wait.seconds >= 0.02 and send.seconds >= 0.01
    waits = [i for i in parse_timeline(clock.timeline()) if i.op == "w"]
    assert clock.wait_s == pytest.approx(sum(i.seconds for i in waits), abs=1e-5)
    assert clock.send_s == pytest.approx(send.seconds, abs=1e-5)
    assert clock.elapsed() >= send.end_s


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("compute_s", "Infinity"),
        ("wait_s", "NaN"),
        ("step_s", "1e300"),
        ("allreduce_s", "-1"),
        ("started_at", "1e300"),
        ("allreduce_started", "Infinity"),
        ("ts", "NaN"),
        ("timeline", '"wA0@1234567890+1"'),
        ("timeline", '"wA12345@1+1"'),
    ],
)
def test_a_step_report_refuses_figures_json_cannot_serve(field: str, value: str) -> None:
    """What a device reports is summed and served as JSON (the metrics, the anatomy): a
    non-finite, negative or absurd figure, or a timeline number too long to stay finite,
    is refused naming the field."""
    body = '{"type": "step", "job": "j1", "stage": 0, "device": "d", "step": 0, '
    with pytest.raises(MessageError, match=field):
        parse_event(f'{body}"{field}": {value}}}')
    assert parse_event(body + '"loss": NaN}').type == "step"  # a diverged loss is a loss
