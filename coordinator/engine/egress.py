"""What leaves each device in a plan: which tensor, after which unit, its shape and codec,
and to whom. A job's page and JSON show it, so that whoever owns the data can see
what crosses the network before a step runs.

Per step, for a plan of stages ``0..S-1`` (a stage on one device or a group):

- every link ``s -> s+1`` carries the activations after the stage's last unit
  forward, and their gradients back (each group member sends the rows it holds);
- stage 0 sends the labels to the last stage, unless they are the same stage or
  the labels stay home (a U-shaped plan: the holders run the last stage too, so
  its links are the helpers' activations back to the holders and the holders'
  gradients of them to the helpers, and no labels leave anyone);
- a group's members exchange sums of their stage's gradients (never samples);
- at the end, and with fault tolerance every few steps, each stage's weights (and
  optimizer state) go to the coordinator.

Samples themselves (the dataset's inputs) leave no device: stage 0 reads them and
sends only what its units made of them. Shapes are per sample, as a microbatch's
rows stack them; they come from the model built on the meta device (no weights).

Tested in tests/e2e/test_local_data_jobs.py (what a job says leaves the holders: their
activations, never samples; round a U, never labels) and tests/e2e/test_demo.py.
"""

from __future__ import annotations

from typing import Any

import torch

from coordinator.engine.spec import JobSpec
from coordinator.planner.score import Plan
from edge.models.datasets import build_dataset
from edge.models.zoo import ModelSpec, get_model

__all__ = ["egress"]


def _sample(spec: JobSpec) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One sample of the job's dataset, ``(input, label)``; ``None`` if it cannot be built."""
    try:
        dataset, options = spec.resolve_data()
        x, y = build_dataset(dataset, "train", **options)[0]
        return torch.as_tensor(x), torch.as_tensor(y)
    except Exception:  # a user dataset that is not allowed or not importable here
        return None


def _output_shapes(model: ModelSpec, x: torch.Tensor) -> list[tuple[int, ...]] | None:
    """The per-sample shape after every unit of ``model`` for input sample ``x``, built on
    the meta device (``None`` for a model that cannot run here, such as a user's)."""
    try:
        shapes = []
        with torch.device("meta"):
            out = x.unsqueeze(0).to("meta")
            for i in range(model.num_units):
                out = model.build_segment(i, i + 1)(out)
                shapes.append(tuple(out.shape[1:]))
        return shapes
    except Exception:  # a user model: its stages check what they can when they build it
        return None


def egress(spec: JobSpec, plan: Plan) -> list[dict[str, Any]]:
    """Everything that leaves a device of ``plan`` in a step, in flow order (see the module
    docstring): ``from`` and ``to`` (device lists), ``what``, ``shape`` (per sample, or
    ``None`` where unknown) and ``codec``."""
    model = get_model(spec.model, seed=spec.seed, **spec.model_options)
    sample = _sample(spec)  # one sample of the data: the shapes after each unit, the label's
    shapes = _output_shapes(model, sample[0]) if sample is not None else None
    names = model.unit_names
    stages = plan.stages
    codecs = list(plan.codecs) if plan.codecs else [spec.link_codec] * (len(stages) - 1)
    rows: list[dict[str, Any]] = []
    for s in range(len(stages) - 1):
        unit = stages[s].end - 1
        shape = list(shapes[unit]) if shapes is not None else None
        here, there = list(stages[s].devices), list(stages[s + 1].devices)
        rows.append(
            {
                "from": here,
                "to": there,
                "what": f"activations after unit {unit} ({names[unit]})",
                "shape": shape,
                "codec": codecs[s],
            }
        )
        rows.append(
            {
                "from": there,
                "to": here,
                "what": f"gradients of those activations (the input of unit {unit + 1})",
                "shape": shape,
                "codec": codecs[s],
            }
        )
    if len(stages) > 1 and not plan.u_shaped:
        rows.append(
            {
                "from": list(stages[0].devices),
                "to": list(stages[-1].devices),
                "what": "labels",
                "shape": list(sample[1].shape) if sample is not None else None,
                "codec": "raw",
            }
        )
    for st in stages:
        if len(st.devices) > 1:
            rows.append(
                {
                    "from": list(st.devices),
                    "to": list(st.devices),
                    "what": f"sums of the gradients of units {st.start}-{st.end - 1}",
                    "shape": None,
                    "codec": "raw",
                }
            )
    for st in stages:
        rows.append(
            {
                "from": [st.device],
                "to": ["coordinator"],
                "what": f"weights of units {st.start}-{st.end - 1} (at the end, and replicas)",
                "shape": None,
                "codec": "raw",
            }
        )
    return rows
