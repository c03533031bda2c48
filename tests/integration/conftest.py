"""Fixtures for the integration tests that need more than a broker."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest


@pytest.fixture
def world_of_one() -> Iterator[None]:
    """A one-process gloo group for the test (torch.distributed's default group)."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", rank=0, world_size=1, store=dist.HashStore(), timeout=timedelta(seconds=30)
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
