"""Data parallelism across pipeline replicas: averaging one stage's gradients and loss.

With ``R`` replicas of an ``S``-stage pipeline, the copies of stage ``s`` form
one process group. Each replica trains on its own ``1/R`` share of every step's
batch (:meth:`edge.runtime.stage.StageRuntime.run_step`), and before the
optimizer steps, :class:`DataParallel` all-reduces the stage's gradients over
that group and divides by ``R``: every copy then holds the gradient of the mean
loss over the whole batch, steps identically and stays identical. The last
stages also average their losses, so each replica reports the whole batch's.

[Note: why not DistributedDataParallel]
``torch.nn.parallel.DistributedDataParallel`` starts its bucketed all-reduce
from autograd hooks during the backward that follows a *synchronising*
forward, and skips it under ``no_sync()``. Under 1F1B a stage runs the forward
of the step's last microbatch before the backwards of earlier ones, so DDP
would reduce part-accumulated gradients (or, with every forward under
``no_sync``, never). The all-reduce therefore runs once, after the step's last
backward, over gradients bucketed the way DDP buckets them (flat tensors of at
most ``bucket_mb`` MiB per dtype and device, in parameter order) -- the
schedule Megatron-LM's pipeline engine uses too.

A stage *group* over torch.distributed ([Note: groups on the wire] in
:mod:`edge.wire.groups`) uses the same bucketed all-reduce over its members'
process group, as :meth:`DataParallel.sum_gradients`: its members already
scaled their losses by their shares of the samples, so the group *sums* (no
division), and the member's share of the step's loss rides in the last bucket,
so a step costs one bucketed all-reduce. It replaces
:class:`edge.runtime.group_sum.GroupSum`, the same sum through the ``reduce``
channel of an MQTT or in-process transport.

A group's sum overlaps the step's last backward as the MQTT one does ([Note: the sum
overlapped with the backward] in :mod:`edge.runtime.group_sum`): armed
(:meth:`DataParallel.arm`) just before it, each bucket's all-reduce starts
(``async_op``) from its parameters' post-accumulate-grad hooks once they are all
final, the last bucket (the last units, and the loss) first. Every member runs the
same segment, so autograd makes its gradients final in the same order on each, and
the members start the same collectives in the same order, as DDP relies on too.
:meth:`DataParallel.sum_gradients` starts what is left, waits for all of them and
copies the sums back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.utils.hooks import RemovableHandle

__all__ = ["DataParallel", "buckets"]

DEFAULT_BUCKET_MB = 25.0
"""DDP's default bucket size."""


def buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of ``tensors`` of one dtype and device, each at most ``bucket_bytes``.

    A tensor larger than ``bucket_bytes`` gets a bucket of its own. The order is
    kept, so every replica (same model, same parameter order) builds the same
    buckets and the collectives match.
    """
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        last = out[-1] if out else None
        if (
            last is None
            or last[0].dtype != t.dtype
            or last[0].device != t.device
            or size + nbytes > bucket_bytes
        ):
            out.append([t])
            size = nbytes
        else:
            last.append(t)
            size += nbytes
    return out


class DataParallel:
    """Averages over the ``replicas`` copies of one stage in ``group``, or sums over the
    members of a stage's group (see the module)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        replicas: int,
        *,
        bucket_mb: float = DEFAULT_BUCKET_MB,
    ) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {replicas}")
        self.group = group
        self.replicas = replicas
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.bytes_reduced = 0
        self.early_bytes = 0
        """Bytes of the last group sum whose all-reduce started while its last backward
        still ran (see the module docstring)."""
        self._armed: _Armed | None = None

    def arm(self, params: Iterable[torch.nn.Parameter], loss: float | torch.Tensor | None) -> None:
        """Before a group's last backward of a step: start each bucket's all-reduce as soon
        as its parameters' gradients are final (``loss``: the member's share of the step's
        loss on the last stage, else ``None``; a tensor stays where it is, so the GPU's
        work is not waited for before the last backward)."""
        self.disarm()
        self.early_bytes = 0
        trainable = [p for p in params if p.requires_grad]
        armed = _Armed(trainable, loss, self.bucket_bytes)
        self._armed = armed
        for i, p in enumerate(trainable):
            armed.handles.append(p.register_post_accumulate_grad_hook(self._final(i)))

    def disarm(self) -> None:
        """Stop starting all-reduces on gradients' hooks."""
        if self._armed is not None:
            for handle in self._armed.handles:
                handle.remove()
            self._armed = None

    def average_gradients(self, params: Iterable[torch.nn.Parameter]) -> float:
        """All-reduce the gradients of ``params`` and divide by the replicas; seconds taken.

        A parameter without a gradient gets zeros first, so every copy reduces the
        same buckets.
        """
        t0 = time.perf_counter()
        self._all_reduce(_grads(params), self.replicas)
        return time.perf_counter() - t0

    def sum_gradients(
        self, params: Iterable[torch.nn.Parameter], loss: float | None = None
    ) -> float | None:
        """Replace the gradients of ``params`` by their sum over the group, with one
        bucketed all-reduce that also sums ``loss`` (the member's share of the step's
        loss, on the last stage); the group's loss, ``None`` without one. Armed
        (:meth:`arm`), the buckets already started are waited for, the rest started."""
        armed, self._armed = self._armed, None
        if armed is not None:
            for handle in armed.handles:
                handle.remove()
            return self._finish(armed)
        self.early_bytes = 0
        grads = _grads(params)
        extra = []
        if loss is not None:
            where = grads[-1].device if grads else torch.device("cpu")
            extra.append(torch.tensor([loss], dtype=torch.float32, device=where))
        self._all_reduce(grads + extra, 1)
        return float(extra[0].item()) if extra else None

    def _final(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            armed = self._armed
            if armed is None:
                return
            armed.final.add(index)
            for b in range(len(armed.waiting)):
                if b not in armed.started and armed.waiting[b] <= armed.final:
                    self.early_bytes += self._start(armed, b)

        return hook

    def _start(self, armed: _Armed, b: int) -> int:
        """Start bucket ``b``'s all-reduce; its bytes."""
        tensors = armed.bucket_tensors(b)
        flat = _flatten_dense_tensors(tensors)
        armed.started[b] = (flat, tensors, dist.all_reduce(flat, group=self.group, async_op=True))
        return flat.numel() * flat.element_size()

    def _finish(self, armed: _Armed) -> float | None:
        """Start the buckets not started yet (in bucket order: on every member the same),
        wait for every one, and copy the sums back."""
        for b in range(len(armed.waiting)):
            if b not in armed.started:
                self._start(armed, b)
        for b in sorted(armed.started):
            flat, tensors, work = armed.started[b]
            work.wait()
            for t, reduced in zip(tensors, _unflatten_dense_tensors(flat, tensors), strict=True):
                t.copy_(reduced)
            self.bytes_reduced += flat.numel() * flat.element_size()
        return float(armed.loss_tensor.item()) if armed.loss_tensor is not None else None

    def _all_reduce(self, tensors: list[torch.Tensor], divide: int) -> None:
        """Sum ``tensors`` in place over the group, bucket by bucket; divide by ``divide``."""
        for bucket in buckets(tensors, self.bucket_bytes):
            flat = _flatten_dense_tensors(bucket)
            dist.all_reduce(flat, group=self.group)
            if divide != 1:
                flat.div_(divide)
            for g, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
                g.copy_(reduced)
            self.bytes_reduced += flat.numel() * flat.element_size()

    def average(self, value: float) -> float:
        """The mean of ``value`` over the replicas (float64 on the host)."""
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, group=self.group)
        return float(t.item()) / self.replicas


def _grads(params: Iterable[torch.nn.Parameter]) -> list[torch.Tensor]:
    """The gradients of the trainable ``params``; a missing one becomes zeros first, so
    every copy reduces the same buckets."""
    grads = []
    for p in params:
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    return grads


class _Armed:
    """A group's sum while its last backward runs: its buckets (as :func:`buckets` makes
    them, the loss in the last), the parameters each waits for, those final so far, and
    the all-reduces started."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        loss: float | torch.Tensor | None,
        bucket_bytes: int,
    ) -> None:
        self.params = params
        self.loss_tensor: torch.Tensor | None = None
        slots: list[Any] = list(range(len(params)))  # a parameter's index, or the loss
        shapes = [p.detach() for p in params]
        if loss is not None:
            where = params[-1].device if params else torch.device("cpu")
            self.loss_tensor = torch.as_tensor(loss, dtype=torch.float32, device=where).reshape(1)
            slots.append("loss")
            shapes.append(self.loss_tensor)
        order = {id(t): i for i, t in enumerate(shapes)}
        self.slots = [
            [slots[order[id(t)]] for t in bucket] for bucket in buckets(shapes, bucket_bytes)
        ]
        self.waiting = [{i for i in bucket if i != "loss"} for bucket in self.slots]
        self.final: set[int] = set()
        self.started: dict[int, tuple[torch.Tensor, list[torch.Tensor], Any]] = {}
        self.handles: list[RemovableHandle] = []

    def bucket_tensors(self, b: int) -> list[torch.Tensor]:
        """The tensors of bucket ``b``: its parameters' gradients (zeros where a parameter
        got none) and the loss."""
        out = []
        for slot in self.slots[b]:
            if slot == "loss":
                assert self.loss_tensor is not None
                out.append(self.loss_tensor)
                continue
            p = self.params[slot]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(p.grad)
        return out
