"""Running a function in several spawned processes, as the ranks of a torch.distributed test."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

__all__ = ["run_ranks"]


def run_ranks(fn: Callable[..., None], world: int, *args: Any, timeout: float) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes; kill them at ``timeout``."""
    ctx = mp.start_processes(fn, args=(world, *args), nprocs=world, join=False,
                             start_method="spawn")  # fmt: skip
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
