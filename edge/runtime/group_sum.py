"""A stage group's once-a-step sum of its gradients (and loss), through its transport.

The members of a group ([Note: groups on the wire] in :mod:`edge.wire.groups`)
each hold the gradients of their own share of the step's samples. Before the
optimizer steps, :class:`GroupSum` flattens them (in parameter order, then the
member's share of the loss on the last stage), zero-pads the vector to ``g``
equal chunks and runs a reduce-scatter then an all-gather on the ``reduce``
channel: member ``i`` sends chunk ``k`` to member ``k``; member ``k`` adds the
``g`` contributions in member order and sends the sum to every other member.
Every member then holds the very same bits, the whole batch's gradients, and
steps the same optimizer; each sends ``2 (g - 1)`` chunks a step.

This is the MQTT-side counterpart of :class:`edge.server.data_parallel.DataParallel`
(which averages copies of a stage over torch.distributed), and runs at the same
place: once, after the step's last backward.
"""

from __future__ import annotations

import torch

from edge.transport.base import Expected, Inbox, Transport
from edge.wire.frames import Codec, Kind, encode_frame
from edge.wire.groups import chunk_size
from edge.wire.messages import StageAssignment

__all__ = ["GroupSum"]


class GroupSum:
    """Sums ``params``' gradients (and the loss) over the group of stage ``a``."""

    def __init__(
        self,
        a: StageAssignment,
        transport: Transport,
        params: list[torch.nn.Parameter],
    ) -> None:
        self.a = a
        self.transport = transport
        self.params = params
        self.members = a.group_size
        numel = sum(p.numel() for p in params) + int(a.is_last)
        self.chunk = chunk_size(numel, self.members)
        """Elements of each member's chunk of the flat vector."""
        self.bytes_sent = 0
        """Bytes sent by the last :meth:`sum`."""

    @property
    def expected(self) -> dict[Kind, Expected]:
        """What the group's members send this one: a chunk per member and kind."""
        chunk = Expected((self.chunk,), frozenset({torch.float32}))
        return {Kind.REDUCE: chunk, Kind.GATHER: chunk}

    def sum(self, inbox: Inbox, step: int, loss: float | None) -> float | None:
        """Replace every gradient by the group's sum; the group's loss (``None`` off the
        last stage). A parameter without a gradient counts as zeros, so every member
        sums the same vector."""
        a, g, me, c = self.a, self.members, self.a.member, self.chunk
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        parts = [t.detach().reshape(-1).float().cpu() for t in grads]
        if loss is not None:
            parts.append(torch.tensor([loss], dtype=torch.float32))
        numel = sum(t.numel() for t in parts)
        vector = torch.zeros(c * g, dtype=torch.float32)
        torch.cat(parts, out=vector[:numel])
        self.bytes_sent = 0
        for k in range(g):  # reduce-scatter: chunk k to its owner
            if k != me:
                self._send(Kind.REDUCE, step, vector[k * c : (k + 1) * c], k)
        timeout = a.recv_timeout_s
        mine = torch.zeros(c, dtype=torch.float32)
        for i in range(g):  # in member order, on every owner: the same bits everywhere
            own = i == me
            mine += vector[me * c : (me + 1) * c] if own else self._take(inbox, step, i, timeout)
        for k in range(g):  # all-gather: the owner's sum to everyone else
            if k != me:
                self._send(Kind.GATHER, step, mine, k)
        for i in range(g):
            got = mine if i == me else inbox.take(Kind.GATHER, step, i, timeout).tensor
            vector[i * c : (i + 1) * c] = got
        at = 0
        for p, t in zip(self.params, grads, strict=True):
            summed = vector[at : at + t.numel()].view_as(t).to(t.dtype)
            if p.grad is None:
                p.grad = summed.to(p.device, copy=True)
            else:
                p.grad.copy_(summed)
            at += t.numel()
        return float(vector[at].item()) if loss is not None else None

    def _send(self, kind: Kind, step: int, chunk: torch.Tensor, member: int) -> None:
        """One chunk, to ``member`` of the stage; the frame's microbatch names the sender."""
        a = self.a
        frame = encode_frame(kind, a.job, step, a.member, chunk, Codec.RAW)
        self.transport.send(a.job, a.stage, "reduce", frame, member)
        self.bytes_sent += len(frame)

    @staticmethod
    def _take(inbox: Inbox, step: int, member: int, timeout: float) -> torch.Tensor:
        return inbox.take(Kind.REDUCE, step, member, timeout).tensor
