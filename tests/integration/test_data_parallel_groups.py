"""The replicas' all-reduce (edge.server.data_parallel), on real gloo process groups.

One test spawns two processes that rendezvous through a FileStore and check the
all-reduce really averages across processes; the rest run in a one-process group.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.ranks import gloo_world, run_ranks

from edge.server.data_parallel import DataParallel

# -- DataParallel in a one-process group -----------------------------------------------


def _params() -> list[torch.nn.Parameter]:
    """fp32 and fp64 parameters, one frozen, in a fixed order (the same on every rank)."""
    g = torch.Generator().manual_seed(0)
    shapes: list[tuple[tuple[int, ...], torch.dtype]] = [
        ((3, 4), torch.float32),
        ((5,), torch.float32),
        ((2, 2), torch.float64),
        ((3,), torch.float32),
        ((4,), torch.float32),
    ]
    params = [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dt)) for s, dt in shapes]
    params[3].requires_grad_(False)
    return params


def _grad(p: torch.Tensor, rank: int, index: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + index)
    return torch.randn(p.shape, generator=g, dtype=p.dtype)


def _grad_of(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None
    return p.grad


def test_one_replica_leaves_gradients_unchanged(world_of_one: None) -> None:
    params = _params()
    before = {i: _grad(params[i], 0, i) for i in (0, 1, 2)}
    for i, grad in before.items():
        params[i].grad = grad.clone()
    dp = DataParallel(None, 1, bucket_mb=40 / 2**20)  # several buckets
    dp.average_gradients(params)
    for i, grad in before.items():
        assert torch.equal(_grad_of(params[i]), grad)
    assert params[3].grad is None  # frozen: skipped, not given zeros
    assert torch.equal(_grad_of(params[4]), torch.zeros(4))  # no gradient: zeros
    trainable = [p for p in params if p.requires_grad]
    assert dp.bytes_reduced == sum(p.numel() * p.element_size() for p in trainable)
    assert dp.average(2.5) == 2.5


def test_gradients_are_divided_by_the_replicas(world_of_one: None) -> None:
    # A world of one process standing for two replicas: the sum is its own gradient,
    # so what comes back is half of it.
    params = _params()[:3]
    grads = [_grad(p, 0, i) for i, p in enumerate(params)]
    for p, grad in zip(params, grads, strict=True):
        p.grad = grad.clone()
    expected = [grad / 2 for grad in grads]
    dp = DataParallel(None, 2)
    dp.average_gradients(params)
    for p, want in zip(params, expected, strict=True):
        assert torch.equal(_grad_of(p), want)
    assert dp.average(3.0) == 1.5


def test_a_frozen_parameter_with_a_gradient_is_left_alone(world_of_one: None) -> None:
    params = _params()
    params[3].grad = torch.full((3,), 7.0)
    DataParallel(None, 2).average_gradients(params)
    assert torch.equal(_grad_of(params[3]), torch.full((3,), 7.0))


# -- two real processes ----------------------------------------------------------------

WORLD = 2
NO_GRAD_ON = 0
"""The rank whose last parameter has no gradient (unused in its step)."""


def _average_on_rank(rank: int, world: int, store_path: str, out_dir: str) -> None:
    with gloo_world(rank, world, store_path):
        group = dist.new_group(list(range(world)))
        params = _params()
        for i, p in enumerate(params):
            if not (i == 4 and rank == NO_GRAD_ON):
                p.grad = _grad(p, rank, i)
        dp = DataParallel(group, world, bucket_mb=40 / 2**20)
        dp.average_gradients(params)
        loss = dp.average(float(rank + 1))
        torch.save(
            {"grads": [p.grad for p in params], "loss": loss, "bytes": dp.bytes_reduced},
            Path(out_dir) / f"rank{rank}.pt",
        )


def test_two_processes_end_with_the_mean_gradient(tmp_path: Path) -> None:
    run_ranks(_average_on_rank, WORLD, str(tmp_path / "store"), str(tmp_path), timeout=60)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    params = _params()
    for i, p in enumerate(params):
        if not p.requires_grad:  # frozen: each rank keeps what it had, nothing is reduced
            for r in range(WORLD):
                assert torch.equal(got[r]["grads"][i], _grad(p, r, i))
            continue
        grads = [
            torch.zeros_like(p) if (i == 4 and r == NO_GRAD_ON) else _grad(p, r, i)
            for r in range(WORLD)
        ]
        mean = sum(grads[1:], grads[0]) / WORLD
        for r in range(WORLD):
            torch.testing.assert_close(got[r]["grads"][i], mean, rtol=0, atol=1e-12)
        assert torch.equal(got[0]["grads"][i], got[1]["grads"][i])  # the copies stay equal
    assert [g["loss"] for g in got] == [1.5, 1.5]
    trainable = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    assert [g["bytes"] for g in got] == [trainable, trainable]


def test_an_armed_group_sum_starts_each_bucket_as_its_gradients_become_final(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group's sum armed before the last backward ([Note: the sum overlapped with the
    backward]): each layer's bucket starts its all-reduce from the hooks, before the
    backward returns, the last layer's first; the sums and the loss are what the plain
    path gives."""
    started: list[tuple[float, int]] = []
    all_reduce = dist.all_reduce

    def recording(tensor: torch.Tensor, *args: Any, **kw: Any) -> Any:
        started.append((time.perf_counter(), tensor.numel()))
        return all_reduce(tensor, *args, **kw)

    def run(armed: bool) -> tuple[list[torch.Tensor], float | None, float, DataParallel]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 9), torch.nn.Linear(9, 10), torch.nn.Linear(10, 11)
        )
        dp = DataParallel(None, 1, bucket_mb=500 / 2**20)  # a bucket a layer
        loss = model(torch.randn(3, 8)).square().sum()
        if armed:
            dp.arm(model.parameters(), 2.5)
        loss.backward()
        ended = time.perf_counter()
        got = dp.sum_gradients(model.parameters(), 2.5)
        return [p.grad.clone() for p in model.parameters() if p.grad is not None], got, ended, dp

    monkeypatch.setattr(dist, "all_reduce", recording)
    plain, plain_loss, _, _ = run(armed=False)
    started.clear()
    grads, loss, ended, dp = run(armed=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, grads, strict=True))
    assert loss == plain_loss == 2.5
    sizes = [8 * 9 + 9, 9 * 10 + 10, 10 * 11 + 11 + 1]  # each layer's bucket; the loss last
    assert [n for _, n in started] == sizes[::-1]
    assert all(when < ended for when, _ in started)
    assert dp.early_bytes == dp.bytes_reduced == 4 * sum(sizes)
