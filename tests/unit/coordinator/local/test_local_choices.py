"""The choices ``edgetrain train`` offers are the job's own (coordinator/local/choices.py).

The job's choices are declared once, where the job is (:class:`JobSpec`,
:class:`OptimizerSpec`, :class:`DataPlacement`); :mod:`coordinator.local.choices`
gathers them for the command. What the command's parser offers is read from its
own signature, so a flag that declares a choice of its own is caught.
"""

from __future__ import annotations

from typing import Annotated, Any, get_args, get_origin, get_type_hints

import pytest

from coordinator.engine.spec import DataPlacement, JobSpec
from edge.config import OptimizerSpec
from edgetrain.cli.train import train_command


def _offered(parameter: str) -> tuple[Any, ...]:
    """The values ``train``'s parser offers for ``parameter`` (its ``Literal``)."""
    hint = get_type_hints(train_command, include_extras=True)[parameter]
    assert get_origin(hint) is Annotated, hint
    return get_args(get_args(hint)[0])


@pytest.mark.parametrize(
    ("parameter", "model", "field"),
    [
        ("partition", JobSpec, "partition"),
        ("objective", JobSpec, "objective"),
        ("optimizer_name", OptimizerSpec, "name"),
        ("labels", DataPlacement, "labels"),
    ],
)
def test_the_command_offers_exactly_the_jobs_choices(
    parameter: str, model: Any, field: str
) -> None:
    job = get_args(model.model_fields[field].annotation)
    assert job, f"{model.__name__}.{field} is not a choice"
    assert _offered(parameter) == job
