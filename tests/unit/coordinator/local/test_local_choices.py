"""The choices ``edgetrain train`` offers are the job's own (coordinator/local/choices.py).

The job's choices are declared where the job is (:class:`JobSpec`, :class:`OptimizerSpec`,
:class:`DataPlacement`); the command's parser offers them from the torch-free copies in
:mod:`coordinator.local.choices`, which must not drift from them.
"""

from __future__ import annotations

from typing import Any, get_args

import pytest

from coordinator.engine.spec import DataPlacement, JobSpec
from coordinator.local import choices
from edge.config import OptimizerSpec


def _values(model: Any, field: str) -> tuple[Any, ...]:
    return get_args(model.model_fields[field].annotation)


@pytest.mark.parametrize(
    ("offered", "model", "field"),
    [
        (choices.Partition, JobSpec, "partition"),
        (choices.Objective, JobSpec, "objective"),
        (choices.UnitTimes, JobSpec, "unit_times"),
        (choices.OptimizerName, OptimizerSpec, "name"),
        (choices.Labels, DataPlacement, "labels"),
    ],
)
def test_the_command_offers_exactly_the_jobs_choices(offered: Any, model: Any, field: str) -> None:
    assert get_args(offered) == _values(model, field)
