"""The engine plans a job that fits its devices under the job's own schedule
(``_fits_schedule`` in :mod:`coordinator.engine.engine`): the planner checks 1F1B's memory,
and ZB-H1 and GPipe keep more microbatches in flight on the later stages.
"""

from __future__ import annotations

import pytest

from coordinator.engine.engine import plan_over
from coordinator.engine.spec import JobSpec
from coordinator.planner.build import parse_fleet
from edge.errors import UserError


def test_a_plan_that_fits_only_1f1b_is_refused_for_zb_h1_and_gpipe() -> None:
    spec = JobSpec(model="cnn-digits", steps=1, batch_size=64, microbatches=4, stages=3)
    fleet = [
        d.model_copy(update={"id": f"pi-{i}"}) for i, d in enumerate(parse_fleet("rpi4-4gb:3"))
    ]
    planned = plan_over(spec, fleet)
    last = planned.plan.stages[-1].devices[0]
    need = planned.score.memory_bytes[-1]
    tight = [d.model_copy(update={"memory_bytes": need}) if d.id == last else d for d in fleet]
    again = plan_over(spec, tight)
    assert again.plan == planned.plan, "the same plan still fits 1F1B"
    for schedule in ("zb-h1", "gpipe"):
        with pytest.raises(UserError, match=rf"^stage 2 on {last} needs .* under {schedule} "):
            plan_over(spec.model_copy(update={"schedule": schedule}), tight)
    assert plan_over(spec.model_copy(update={"schedule": "zb-h1"}), fleet).plan == planned.plan
