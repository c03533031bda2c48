"""What stage 0 reads each step: a seeded, epoch-wise shuffled sampler over a dataset.

Batch ``t`` of a job is a pure function of ``(dataset, batch_size, seed, t)``:
epoch ``e = t // batches_per_epoch`` is a permutation drawn from a generator
seeded with ``(seed, e)``, and batch ``t`` is the ``t mod batches_per_epoch``-th
slice of it (the tail that does not fill a batch is dropped). So any device
can reproduce any step, a restarted job reads the same data from the step it
resumes at, and the single-device reference sees the same batches as the
pipeline.

A dataset that lives on the device ([Note: local data] in :mod:`edge.models.local_data`)
is read the same way: :func:`open_local` gives it by name with its sampler.

The sampler holds an epoch's order whole, :data:`ORDER_BYTES` a sample, so a
dataset's size is memory on the device that reads it: :func:`data_bytes` counts it
(with what the dataset keeps resident), and :func:`check_data_fits` refuses a
dataset that would not fit before anything is allocated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset

from edge.errors import UserError
from edge.models.local_data import LocalData

__all__ = [
    "ORDER_BYTES",
    "EpochSampler",
    "check_data_fits",
    "collate",
    "data_bytes",
    "load_batch",
    "open_local",
]

ORDER_BYTES = 8
"""Bytes an :class:`EpochSampler` holds per sample: the epoch's order, as int64."""


class EpochSampler:
    """Indices of the samples of step ``t`` (see the module docstring)."""

    def __init__(self, size: int, batch_size: int, seed: int) -> None:
        if batch_size > size:
            raise ValueError(f"batch size {batch_size} is larger than the dataset ({size})")
        self.size = size
        self.batch_size = batch_size
        self.seed = seed
        self.batches_per_epoch = size // batch_size
        self._epoch = -1
        self._perm = torch.empty(0, dtype=torch.int64)

    def indices(self, step: int) -> torch.Tensor:
        epoch, k = divmod(step, self.batches_per_epoch)
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.size, generator=gen)
            self._epoch = epoch
        return self._perm[k * self.batch_size : (k + 1) * self.batch_size]


def data_bytes(dataset: Dataset[Any]) -> int:
    """Bytes a stage that reads ``dataset`` holds for it before its first batch: the
    epoch's order (:data:`ORDER_BYTES` a sample) and what the dataset keeps in memory
    (its ``resident_bytes``, where it tells: the built-in datasets do)."""
    resident = getattr(dataset, "resident_bytes", 0)
    return ORDER_BYTES * len(dataset) + (resident if isinstance(resident, int) else 0)  # type: ignore[arg-type]


def check_data_fits(
    dataset: Dataset[Any], name: str, usable_bytes: int, whose: str = "this device has free"
) -> None:
    """A one-line :class:`UserError` when reading ``dataset`` (named ``name``) needs more
    than ``usable_bytes`` (see :func:`data_bytes`), the bytes ``whose`` says."""
    need = data_bytes(dataset)
    if need > usable_bytes:
        samples = len(dataset)  # type: ignore[arg-type]
        raise UserError(
            f"dataset {name!r}: reading it takes {need:,} bytes (the order of {samples:,} "
            f"samples at {ORDER_BYTES} bytes each, and its resident data), more than the "
            f"{usable_bytes:,} bytes {whose}"
        )


def _stack(items: tuple[Any, ...]) -> torch.Tensor:
    if isinstance(items[0], torch.Tensor):
        return torch.stack(items)
    return torch.stack([torch.as_tensor(x) for x in items])


def collate(samples: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack ``(input, target)`` samples into a batch."""
    xs, ys = zip(*samples, strict=True)
    return _stack(xs), _stack(ys)


def load_batch(
    dataset: Dataset[Any], sampler: EpochSampler, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs and targets of step ``step``."""
    return collate([dataset[i] for i in sampler.indices(step).tolist()])


def open_local(
    local: LocalData, name: str, batch_size: int, seed: int
) -> tuple[Dataset[Any], EpochSampler]:
    """The local dataset ``name`` this device holds, and its sampler: batch ``t`` is
    ``load_batch(dataset, sampler, t)``, as for a zoo dataset.

    Raises a one-line :class:`UserError` for a name not held here or a batch larger
    than the dataset.
    """
    held = local[name]
    try:
        sampler = EpochSampler(len(held.dataset), batch_size, seed)  # type: ignore[arg-type]
    except ValueError as exc:
        raise UserError(f"local dataset {name!r}: {exc}") from None
    return held.dataset, sampler
