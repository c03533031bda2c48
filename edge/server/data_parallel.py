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
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

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
        loss, on the last stage); the group's loss, ``None`` without one."""
        grads = _grads(params)
        extra = []
        if loss is not None:
            where = grads[-1].device if grads else torch.device("cpu")
            extra.append(torch.tensor([loss], dtype=torch.float32, device=where))
        self._all_reduce(grads + extra, 1)
        return float(extra[0].item()) if extra else None

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
