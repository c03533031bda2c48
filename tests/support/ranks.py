"""Running a function in several spawned processes, as the ranks of a torch.distributed test."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["gloo_world", "run_ranks"]


@contextmanager
def gloo_world(rank: int, world: int, store_path: str) -> Iterator[None]:
    """Inside a rank of :func:`run_ranks`: join a gloo world of ``world`` processes through
    a file store at ``store_path``, on one torch thread (as agents run), for the block."""
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., None], world: int, *args: Any, timeout: float) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes; kill them at ``timeout``."""
    ctx = mp.start_processes(
        fn, args=(world, *args), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} ranks did not finish within {timeout} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(10)
