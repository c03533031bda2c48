"""DiLoCo in a stage group: its members step on their own rows, and sync every ``H`` steps.

[Note: DiLoCo in a group]
An exact group sums its members' gradients every step (:mod:`edge.runtime.group_sum`),
so every member takes the same step and the group trains as one device would. That
sum moves the stage's whole gradient over the members' links once a step, and on
slow links it can cost more than the compute it shares out.

With ``diloco`` set (Douillard et al., "DiLoCo: Distributed Low-Communication Training
of Language Models", 2023), each member keeps the weights it had at the group's last
sync, the *anchor*, and then:

- every step, it steps its own (inner) optimizer on its own gradient. That gradient
  is its rows' share of the microbatch's loss, divided by the share: the mean loss
  over its own rows, the gradient it would have alone;
- every ``every`` steps, and at the job's last step, the group syncs. Each member's
  movement since the anchor, ``anchor - weights`` (its *outer gradient*), is weighted
  by its share. The group sums those by the same reduce-scatter and all-gather as an
  exact step's gradients. Every member then sets its weights back to the anchor and
  takes one outer step, Nesterov SGD (``outer_lr``, ``outer_momentum``), on the sum.
  The weights that step gives become the new anchor.

The sum gives every member the same bits, and every member runs the same outer step
from the same anchor. So after a sync the members hold the same weights, and the
weights a job ends with are the same whichever member sends them.

The stages before and after a group still send activations and gradients every
microbatch, row by row, to the member that holds each row. Only the group's sum is
rarer. Training is **not** single-device training any more, so no parity holds.
The reference is an independent loop with the same arithmetic
(``tests/support/diloco.py``), and the job is judged by the accuracy it reaches in
wall time.

A member's step report carries its own mean loss between syncs; the group's loss
(the sum) only at a sync. The job takes member 0's. The inner optimizers' states stay
each member's own, as DiLoCo keeps them.

Tested in tests/unit/edge/runtime/test_outer_sync.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from edge.config import DiLoCo

__all__ = ["OuterSync"]


class OuterSync:
    """One group member's anchor and outer optimizer (see [Note: DiLoCo in a group])."""

    def __init__(self, params: Sequence[torch.nn.Parameter], spec: DiLoCo, share: float) -> None:
        """Anchor at ``params`` as they are; ``share`` is this member's share of the rows."""
        if not 0 < share <= 1:
            raise ValueError(f"a member's share of the rows is in (0, 1], not {share}")
        self.params = list(params)
        self.spec = spec
        self.share = share
        self.anchor = [p.detach().clone() for p in self.params]
        self.optimizer: torch.optim.Optimizer | None = None
        if self.params:
            momentum = spec.outer_momentum
            self.optimizer = torch.optim.SGD(
                self.params, lr=spec.outer_lr, momentum=momentum, nesterov=momentum > 0
            )

    def due(self, step: int, steps: int) -> bool:
        """Whether the group syncs after ``step`` (of ``steps``): every ``every``, and last."""
        return (step + 1) % self.spec.every == 0 or step == steps - 1

    def own_gradients(self) -> None:
        """Turn this member's part of the microbatches' gradient into its own rows' mean."""
        for p in self.params:
            if p.grad is not None:
                p.grad.div_(self.share)

    def outer_gradients(self) -> None:
        """Set each weight's gradient to this member's share of the movement since the
        anchor, ``share * (anchor - weights)``: what the group sums."""
        for p, a in zip(self.params, self.anchor, strict=True):
            p.grad = (a - p.detach()).mul_(self.share)

    def step(self) -> None:
        """The outer step on the summed outer gradients (in ``.grad``), from the anchor; the
        weights it gives are the new anchor."""
        with torch.no_grad():
            for p, a in zip(self.params, self.anchor, strict=True):
                p.copy_(a)
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.anchor = [p.detach().clone() for p in self.params]
