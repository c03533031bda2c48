"""The independent reference: a plain PyTorch training loop over the whole model.

Every parity test compares what edgetrain trained (a pipeline, server-tier
ranks, replicas, a run that survived faults) with :func:`train_reference` as
well as with edgetrain's own one-stage path. The two differ in what they can
catch: the one-stage path runs edgetrain's runtime, so a bug there (a loss
scaled wrongly, a microbatch skipped, a gradient mis-accumulated) changes the
pipeline and its one-stage reference alike and the comparison still passes;
this loop shares none of that code.

It shares only what defines the problem, not how it is trained: the model is
built from the zoo (:func:`edge.models.zoo.get_model`, the same seed) and the
data from the dataset registry (:func:`edge.models.datasets.build_dataset`).
Everything else is written here from the training contract in
``shared/DESIGN.md`` and the README:

- data order: step ``t`` of a job with batch ``B`` and seed ``s`` reads slice
  ``t mod (N // B)`` of epoch ``t // (N // B)``'s permutation, drawn with
  ``torch.randperm(N)`` from a generator seeded ``s * 1_000_003 + epoch``;
  the tail of an epoch that does not fill a batch is dropped;
- one step is one forward and one backward over the whole batch, the loss is
  the mean cross-entropy over every sample (every token for language models),
  then one optimizer step: SGD with momentum, or AdamW, with weight decay, over
  every trainable parameter of the model.

A pipeline splits that batch into ``M`` microbatches and divides each one's
mean loss by ``M``; replicas split it ``R`` ways and average gradients. Both are
the same step up to floating-point rounding, which is what the parity tests'
``1e-5`` allows. AdamW is the exception: it divides each update by the root of
the second moment, so a parameter whose gradient is near zero (a token
embedding row a batch barely touches, an attention weight the softmax is
almost blind to) turns rounding into differences far above ``1e-5``. For it,
``microbatches=M`` makes the loop accumulate gradients over ``M`` equal chunks
of the batch, each chunk's mean loss divided by ``M`` (PyTorch's usual gradient
accumulation, written here, not edgetrain's), which rounds like a pipeline.

The loop runs on one torch thread whatever the caller's setting: the number of
threads changes the order of some reductions (an embedding's backward sums its
rows in another order), which over 60 steps of gpt-mini moved a weight by
1.4e-6; the tests' agents and ranks run one thread each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from edge.models.datasets import build_dataset
from edge.models.zoo import get_model

__all__ = [
    "ReferenceRun",
    "assert_matches",
    "batch_indices",
    "one_thread",
    "reference_optimizer",
    "train_reference",
]


@dataclass(frozen=True)
class ReferenceRun:
    """What the plain loop trained: one loss per step and the final ``state_dict``."""

    losses: list[float]
    weights: dict[str, torch.Tensor]
    snapshots: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    """With ``snapshot_every=K``: the weights after every ``K``-th step, by steps done."""


def batch_indices(size: int, batch_size: int, seed: int, step: int) -> torch.Tensor:
    """The dataset indices that step ``step`` reads (see the module docstring)."""
    per_epoch = size // batch_size
    epoch, k = divmod(step, per_epoch)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(size, generator=gen)[k * batch_size : (k + 1) * batch_size]


def reference_optimizer(
    params: list[torch.nn.Parameter], spec: Mapping[str, Any]
) -> torch.optim.Optimizer:
    name = spec.get("name", "sgd")
    lr = spec.get("lr", 0.05)
    decay = spec.get("weight_decay", 0.0)
    if name == "sgd":
        return torch.optim.SGD(
            params, lr=lr, momentum=spec.get("momentum", 0.9), weight_decay=decay
        )
    if name == "adamw":
        betas = tuple(spec.get("betas", (0.9, 0.999)))
        return torch.optim.AdamW(
            params, lr=lr, betas=betas, eps=spec.get("eps", 1e-8), weight_decay=decay
        )
    raise ValueError(f"the reference knows sgd and adamw, not {name!r}")


@contextmanager
def one_thread() -> Iterator[None]:
    """One torch thread for the block, then the caller's count again: runs in the test process
    that should round like the one-thread agents (see the module docstring)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def train_reference(
    model: str,
    *,
    steps: int,
    batch_size: int,
    seed: int = 0,
    optimizer: Mapping[str, Any] | None = None,
    model_options: Mapping[str, Any] | None = None,
    dataset: str | None = None,
    dataset_options: Mapping[str, Any] | None = None,
    microbatches: int = 1,
    snapshot_every: int = 0,
) -> ReferenceRun:
    """Train ``model`` for ``steps`` steps with a plain loop (see the module docstring).

    Arguments mirror a job's settings (``optimizer`` as the job's optimizer fields);
    ``microbatches`` accumulates gradients over that many chunks (module docstring);
    ``snapshot_every=K`` keeps the weights after every ``K``-th step.
    """
    spec = get_model(model, seed=seed, **dict(model_options or {}))
    name = dataset or spec.dataset
    if dataset_options is None:
        dataset_options = spec.dataset_options if name == spec.dataset else {}
    data = build_dataset(name, "train", **dict(dataset_options))
    size = len(data)  # type: ignore[arg-type]

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return stack([data[i] for i in batch_indices(size, batch_size, seed, step).tolist()])

    return train_on_batches(
        model,
        batch,
        steps=steps,
        seed=seed,
        optimizer=optimizer,
        model_options=model_options,
        microbatches=microbatches,
        snapshot_every=snapshot_every,
    )


def stack(samples: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input, target)`` samples as one batch."""
    x = torch.stack([torch.as_tensor(s[0]) for s in samples])
    y = torch.stack([torch.as_tensor(s[1]) for s in samples])
    return x, y


def train_on_batches(
    model: str,
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    *,
    steps: int,
    seed: int = 0,
    optimizer: Mapping[str, Any] | None = None,
    model_options: Mapping[str, Any] | None = None,
    microbatches: int = 1,
    snapshot_every: int = 0,
) -> ReferenceRun:
    """The plain loop of :func:`train_reference` on the batches ``batch(step)`` gives,
    each cut into ``microbatches`` equal chunks in order (``snapshot_every``: as there)."""
    with one_thread():
        spec = get_model(model, seed=seed, **dict(model_options or {}))
        net = spec.build().train()
        params = [p for p in net.parameters() if p.requires_grad]
        opt = reference_optimizer(params, optimizer or {})
        losses = []
        snapshots = {}
        for step in range(steps):
            x, y = batch(step)
            if len(x) % microbatches:
                raise ValueError(f"batch {len(x)} is not a multiple of {microbatches} microbatches")
            opt.zero_grad(set_to_none=True)
            loss = 0.0
            for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches), strict=True):
                logits = net(xm)
                part = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ym.reshape(-1))
                if microbatches > 1:
                    part = part / microbatches
                part.backward()
                loss += part.item()
            opt.step()
            losses.append(loss)
            if snapshot_every and (step + 1) % snapshot_every == 0:
                snapshots[step + 1] = _state(net)
        return ReferenceRun(losses, _state(net), snapshots)


def _state(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def union_batches(
    holders: Sequence[Mapping[str, Any]],
    name: str,
    counts: Sequence[int],
    microbatches: int,
    seed: int,
) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """Step ``t``'s batch of a job on local data ``name`` (for :func:`train_on_batches`):
    holder ``m`` reads ``counts[m] x microbatches`` samples of its own data with its own
    sampler (:func:`batch_indices`), and microbatch ``j`` is every holder's ``j``-th
    ``counts[m]``, holder after holder (``holders``: each one's registered local data)."""
    datasets = [held[name].dataset for held in holders]

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = []
        for data, n in zip(datasets, counts, strict=True):
            own = batch_indices(len(data), n * microbatches, seed, step)
            x, y = stack([data[i] for i in own.tolist()])
            parts.append((x.chunk(microbatches), y.chunk(microbatches)))
        xs = [torch.cat([p[0][j] for p in parts]) for j in range(microbatches)]
        ys = [torch.cat([p[1][j] for p in parts]) for j in range(microbatches)]
        return torch.cat(xs), torch.cat(ys)

    return batch


def assert_matches(
    losses: list[float],
    weights: Mapping[str, torch.Tensor],
    reference: ReferenceRun,
    *,
    rtol: float = 1e-5,
    atol: float = 1e-7,
) -> None:
    """Every step's loss and every tensor of the trained model equal the reference's.

    Losses within ``rtol`` relative; tensors within ``rtol`` relative plus
    ``atol`` (a parameter that crosses zero has no relative scale).
    """
    assert len(losses) == len(reference.losses), (len(losses), len(reference.losses))
    torch.testing.assert_close(
        torch.tensor(losses, dtype=torch.float64),
        torch.tensor(reference.losses, dtype=torch.float64),
        rtol=rtol,
        atol=0.0,
        msg=lambda m: f"losses differ from the reference: {m}",
    )
    assert set(weights) == set(reference.weights), set(weights) ^ set(reference.weights)
    for key, ref in reference.weights.items():
        torch.testing.assert_close(
            weights[key].to(ref.dtype), ref, rtol=rtol, atol=atol, msg=lambda m, k=key: f"{k}: {m}"
        )
