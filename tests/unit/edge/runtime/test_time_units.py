"""A device's answer to a ``time-units`` request (edge.runtime.time_units).

Times at the device's throttle, or no times and why: busy, a model it may not import, a
model it cannot build. tests/integration/test_agent_unit_times.py asks real agents.
"""

from __future__ import annotations

import pytest

from edge.models.user_code import ZOO_ONLY
from edge.models.zoo import get_model
from edge.runtime.time_units import answer_time_units
from edge.wire.messages import TimeUnits


def _ask(model: str, **options: object) -> TimeUnits:
    return TimeUnits(
        request="r1", model=model, batch_size=8, microbatches=2, small_batch_size=4, **options
    )


def test_the_units_are_timed_at_both_batches() -> None:
    answer = answer_time_units(_ask("mlp"), device="pi-1", allow_code=ZOO_ONLY, slowdown=3.0)
    names = [u.name for u in get_model("mlp").units]
    assert (answer.request, answer.device, answer.error) == ("r1", "pi-1", None)
    assert answer.small is not None
    for times in (answer.full, answer.small):
        assert [t.name for t in times] == names
        assert all(t.fwd_s > 0 and t.bwd_s > 0 for t in times)


@pytest.mark.parametrize(
    ("cmd", "busy", "error"),
    [
        (_ask("mlp"), "j7", "busy with job j7"),
        (_ask("nosuch"), None, "UserError: "),
        (
            _ask("mypkg.models:net"),
            None,
            "CodeNotAllowed: model 'mypkg.models:net': module 'mypkg.models' is not allowed here",
        ),
    ],
)
def test_an_answer_without_times_says_why(cmd: TimeUnits, busy: str | None, error: str) -> None:
    answer = answer_time_units(cmd, device="pi-1", allow_code=ZOO_ONLY, slowdown=1.0, busy_job=busy)
    assert answer.error is not None and answer.error.startswith(error), answer.error
    assert (answer.full, answer.small, answer.request) == ([], None, "r1")
