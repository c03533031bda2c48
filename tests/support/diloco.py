"""An independent DiLoCo loop: what a job with ``diloco`` should train, written plainly.

A non-exact job cannot be checked against single-device training. This loop checks it
instead. It writes [Note: DiLoCo in a group] (``edge/runtime/outer_sync.py``) from its
text, not from that code, over the same model, data order and microbatches as
:mod:`support.reference`:

- the model is cut into three parts at a group's units, ``[0, g0)``, ``[g0, g1)`` and
  ``[g1, n)``. The group's part has one copy per member, and member ``i`` computes
  ``rows[i]`` rows of every microbatch, member after member;
- every step, each microbatch's mean loss divided by ``M`` is backpropagated through
  the whole. Each copy's gradient is divided by its share, ``rows[i] / sum(rows)``.
  Then every part steps its own optimizer (each copy its own);
- every ``every`` steps, and at the last step, each copy's movement since the
  anchor, times its share, is summed in member order. The copies go back to the
  anchor, one Nesterov SGD step is taken on that sum, and every copy takes the result
  as its weights and as the new anchor.

The loss of a step is the microbatches' summed loss, except where the group is the
last part and the step has no sync. There it is member 0's own: its rows' share of
each microbatch's loss, divided by its share, as its agent reports it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from edge.models.datasets import build_dataset
from edge.models.zoo import get_model
from support.reference import (
    ReferenceRun,
    batch_indices,
    one_thread,
    reference_optimizer,
    stack,
)

__all__ = ["train_diloco_reference"]


def train_diloco_reference(
    model: str,
    *,
    steps: int,
    batch_size: int,
    microbatches: int,
    group: tuple[int, int],
    rows: Sequence[int],
    diloco: Mapping[str, Any],
    seed: int = 0,
    optimizer: Mapping[str, Any] | None = None,
    model_options: Mapping[str, Any] | None = None,
    snapshot_every: int = 0,
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> ReferenceRun:
    """Train ``model`` with its units ``group`` on a group whose members take ``rows`` rows
    of every microbatch (see the module docstring); member 0's copy gives the weights.
    ``snapshot_every=K`` (a multiple of ``diloco["every"]``) keeps them after every
    ``K``-th step, each a sync: the weights a job of that many steps ends with.
    ``batch(step)``: the step's batch (data that stays home:
    :func:`support.reference.union_batches`); by default the model's dataset, sampled
    as :mod:`support.reference` samples it."""
    if snapshot_every % diloco["every"]:
        raise ValueError(f"snapshot_every {snapshot_every} is not a multiple of every")
    with one_thread():
        spec = get_model(model, seed=seed, **dict(model_options or {}))
        data = build_dataset(spec.dataset, "train", **dict(spec.dataset_options))
        size = len(data)  # type: ignore[arg-type]
        g0, g1 = group
        n = spec.num_units
        head = spec.build_segment(0, g0).train() if g0 > 0 else None
        copies = [spec.build_segment(g0, g1).train() for _ in rows]
        tail = spec.build_segment(g1, n).train() if g1 < n else None
        parts = [p for p in (head, tail) if p is not None]
        optimizers = [
            reference_optimizer(list(p.parameters()), optimizer or {}) for p in parts + copies
        ]
        shares = [r / sum(rows) for r in rows]
        anchor = [t.detach().clone() for t in copies[0].parameters()]
        outer_params = list(copies[0].parameters())
        momentum = diloco.get("outer_momentum", 0.9)
        outer = torch.optim.SGD(
            outer_params, lr=diloco.get("outer_lr", 0.7), momentum=momentum, nesterov=momentum > 0
        )
        losses = []
        snapshots = {}
        for step in range(steps):
            if batch is not None:
                x, y = batch(step)
            else:
                x, y = stack(
                    [data[i] for i in batch_indices(size, batch_size, seed, step).tolist()]
                )
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            total = own = 0.0
            for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches), strict=True):
                h = head(xm) if head is not None else xm
                pieces = h.split(list(rows))
                out = torch.cat([c(piece) for c, piece in zip(copies, pieces, strict=True)])
                logits = tail(out) if tail is not None else out
                flat = logits.reshape(-1, logits.shape[-1]).float()
                loss = F.cross_entropy(flat, ym.reshape(-1)) / microbatches
                loss.backward()
                total += loss.item()
                first = F.cross_entropy(flat[: _tokens(flat, ym, rows[0])], _first(ym, rows[0]))
                own += first.item() / microbatches
            for copy, share in zip(copies, shares, strict=True):
                for p in copy.parameters():
                    if p.grad is not None:
                        p.grad.div_(share)
            for opt in optimizers:
                opt.step()
            synced = (step + 1) % diloco["every"] == 0 or step == steps - 1
            if synced:
                summed = [torch.zeros_like(a) for a in anchor]
                for copy, share in zip(copies, shares, strict=True):
                    for acc, a, p in zip(summed, anchor, copy.parameters(), strict=True):
                        acc += (a - p.detach()) * share
                with torch.no_grad():
                    for p, a, g in zip(outer_params, anchor, summed, strict=True):
                        p.copy_(a)
                        p.grad = g
                outer.step()
                anchor = [t.detach().clone() for t in outer_params]
                with torch.no_grad():
                    for copy in copies[1:]:
                        for p, a in zip(copy.parameters(), anchor, strict=True):
                            p.copy_(a)
            losses.append(total if tail is not None or synced else own)
            if snapshot_every and (step + 1) % snapshot_every == 0:
                snapshots[step + 1] = _state(head, copies[0], tail)
        return ReferenceRun(losses, _state(head, copies[0], tail), snapshots)


def _state(*parts: torch.nn.Module | None) -> dict[str, torch.Tensor]:
    """The parts' weights as one model's ``state_dict``."""
    weights: dict[str, torch.Tensor] = {}
    for part in [p for p in parts if p is not None]:
        weights |= {k: v.detach().clone() for k, v in part.state_dict().items()}
    return weights


def _tokens(flat: torch.Tensor, target: torch.Tensor, rows: int) -> int:
    """How many of ``flat``'s rows (one per sample, or per token) the first ``rows``
    samples take."""
    return flat.shape[0] * rows // target.shape[0]


def _first(target: torch.Tensor, rows: int) -> torch.Tensor:
    return target[:rows].reshape(-1)
