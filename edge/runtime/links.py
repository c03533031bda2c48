"""What a stage's links carry: the shape and dtype of every frame its plan lets it receive.

A stage's assignment fixes its incoming tensors exactly. With batch ``B``, ``M``
microbatches and ``R`` replicas a microbatch has ``b = B / (M R)`` samples, and
for the units ``[start, end)`` of the model:

- an activation (every stage but the first) is the output of unit ``start - 1``
  for ``b`` samples;
- a gradient (every stage but the last) has the shape and dtype of the stage's
  own output, the output of unit ``end - 1``;
- labels (the last stage, when it is not also the first and the labels do not
  stay home) are ``b`` targets of the dataset's samples.

In a group ([Note: groups on the wire] in :mod:`edge.wire.groups`) ``b`` is the
member's own block of the microbatch, and each kind arrives as the pieces the
sending stage's blocks cut it into (:func:`expected_frames` lists their rows).

:func:`expected_frames` works these out once, when the stage is built, by
running the units before its output (the last stage: before its input) on a
microbatch of zeros shaped like the dataset's first sample (what stage 0
feeds), on the host, one unit at a time: a unit is built, run and dropped, so
the stage holds at most one unit beyond its own segment. That costs one
microbatch's forward pass, once. (The ``meta`` device would compute nothing,
but its first use imports sympy and torch's compiler stack: seconds and ~80 MB
on a small device.) The inbox then refuses anything else ([Note: bounded
inboxes] in :mod:`edge.transport.inbox`).

Under ``precision="bf16"`` autocast decides per operation whether an output is
``bfloat16`` or ``float32``, differently on each device type: a floating link
then accepts either. When a model does not run on zeros (a user model), or the
last stage cannot build the dataset (a user dataset that only stage 0 has),
that kind of frame is checked for its step, kind and size only, and a warning
says so.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.utils.data import Dataset

from edge.models.datasets import build_dataset
from edge.models.zoo import ModelSpec
from edge.runtime.data import collate
from edge.transport.inbox import Expected
from edge.wire.frames import Kind
from edge.wire.groups import blocks, pieces
from edge.wire.messages import StageAssignment

__all__ = ["block", "expected_frames", "microbatch_size"]

log = logging.getLogger(__name__)


def microbatch_size(a: StageAssignment) -> int:
    """Samples in one microbatch of one replica (the config checked that they divide)."""
    return a.batch_size // (a.microbatches * a.replicas)


def block(a: StageAssignment) -> tuple[int, int]:
    """The rows ``[lo, hi)`` of every microbatch this member of its stage computes."""
    return blocks(a.samples_of(a.stage))[a.member]


def _pieces(a: StageAssignment, sender: int) -> tuple[tuple[int, int], ...]:
    """The rows of each frame stage ``sender``'s members send this member (groups only)."""
    if a.group_samples is None:
        return ()
    return tuple(rows for _, rows in pieces(a.samples_of(sender), block(a)))


def _dtypes(dtype: torch.dtype, precision: str) -> frozenset[torch.dtype]:
    if precision == "bf16" and dtype.is_floating_point:
        return frozenset({torch.float32, torch.bfloat16})
    return frozenset({dtype})


def _sample(
    a: StageAssignment, dataset: Dataset[Any] | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One collated sample ``(x, y)`` of the job's dataset, as stage 0 reads it.

    ``(None, None)`` if the dataset cannot be built here.
    """
    try:
        if dataset is None:
            dataset = build_dataset(a.dataset, "train", **a.dataset_options)
        return collate([dataset[0]])
    except Exception as exc:  # a user dataset that is not installed here, or broken
        log.warning(
            "job %s stage %d: cannot read a sample of dataset %s (%s); "
            "incoming frames are checked for their step and size, not their shape",
            a.job,
            a.stage,
            a.dataset,
            exc,
            extra={"job": a.job, "stage": a.stage},
        )
        return None, None


def _trace(
    spec: ModelSpec, end: int, x: torch.Tensor, keep: set[int]
) -> dict[int, tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of the outputs of units in ``keep``, running ``[0, end)`` on ``x``.

    Zoo units are built one at a time and dropped after use; a model whose
    units cannot be built alone is built once (it is built whole anyway).
    """
    out: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        whole = spec.build_segment(0, end) if spec.segment_builder is not None else None
        h = x
        for i in range(end):
            unit = whole[i] if whole is not None else spec.build_segment(i, i + 1)
            h = unit.eval()(h)
            if i in keep:
                out[i] = (tuple(h.shape), h.dtype)
            del unit
    return out


def expected_frames(
    a: StageAssignment, spec: ModelSpec, dataset: Dataset[Any] | None = None
) -> dict[Kind, Expected | None]:
    """The frames stage ``a`` of model ``spec`` receives, by kind: shape and dtypes per
    microbatch. ``dataset`` is the job's, if the stage has built it already.

    ``None`` for a kind whose shape could not be worked out here (see the module
    docstring); the only stage of a one-stage job receives nothing.
    """
    kinds: dict[Kind, Expected | None] = {}
    if not a.is_first:
        kinds[Kind.ACTIVATION] = None
    if not a.is_last:
        kinds[Kind.GRADIENT] = None
    if a.is_last and not a.is_first and not a.labels_local:
        kinds[Kind.LABELS] = None
    if not kinds:
        return kinds
    lo, hi = block(a)
    b = hi - lo
    x, y = _sample(a, dataset)
    if y is not None and Kind.LABELS in kinds:
        kinds[Kind.LABELS] = Expected((b, *y.shape[1:]), frozenset({y.dtype}), _pieces(a, 0))
    shape, dtype = (spec.input_shape, spec.input_dtype) if x is None else (x.shape[1:], x.dtype)
    keep = {a.start - 1} if a.is_last else {a.start - 1, a.end - 1}
    keep.discard(-1)
    try:
        traced = _trace(spec, max(keep) + 1, torch.zeros((b, *shape), dtype=dtype), keep)
    except Exception as exc:  # a user model that does not run on zeros
        log.warning(
            "job %s stage %d: cannot run model %s on a batch of zeros (%s); "
            "activations and gradients are checked for their step and size, not their shape",
            a.job,
            a.stage,
            a.model,
            exc,
            extra={"job": a.job, "stage": a.stage},
        )
        return kinds
    links = ((Kind.ACTIVATION, a.start - 1, a.stage - 1), (Kind.GRADIENT, a.end - 1, a.stage + 1))
    for kind, unit, sender in links:
        if kind in kinds:
            out_shape, out_dtype = traced[unit]
            kinds[kind] = Expected(out_shape, _dtypes(out_dtype, a.precision), _pieces(a, sender))
    return kinds
