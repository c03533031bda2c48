"""Gradient buckets and the replicas' arguments (edge.server.data_parallel).

tests/integration/test_data_parallel_groups.py runs the all-reduce on real gloo groups.
"""

from __future__ import annotations

import pytest
import torch

from edge.server.data_parallel import DataParallel, buckets

# -- buckets ---------------------------------------------------------------------------


def _ids(out: list[list[torch.Tensor]], tensors: list[torch.Tensor]) -> list[list[int]]:
    """Each bucket as the indices of its tensors in ``tensors``."""
    index = {id(t): i for i, t in enumerate(tensors)}
    return [[index[id(t)] for t in bucket] for bucket in out]


def test_buckets_keep_the_order_and_fill_up_to_the_cap() -> None:
    ts = [torch.zeros(4) for _ in range(5)]  # 16 bytes each
    assert _ids(buckets(ts, 40), ts) == [[0, 1], [2, 3], [4]]
    assert _ids(buckets(ts, 32), ts) == [[0, 1], [2, 3], [4]]  # an exact fit stays
    assert _ids(buckets(ts, 31), ts) == [[0], [1], [2], [3], [4]]
    assert _ids(buckets(ts, 1 << 20), ts) == [[0, 1, 2, 3, 4]]
    assert buckets([], 40) == []


def test_buckets_respect_the_cap_on_mixed_sizes() -> None:
    ts = [torch.zeros(n) for n in (1, 2, 3, 4, 5, 6, 1)]
    out = buckets(ts, 24)
    assert [t for bucket in out for t in bucket] == ts  # nothing lost, nothing reordered
    for bucket in out:
        assert len(bucket) == 1 or sum(t.numel() * 4 for t in bucket) <= 24
    assert _ids(out, ts) == [[0, 1, 2], [3], [4], [5], [6]]


def test_a_dtype_change_starts_a_new_bucket() -> None:
    ts = [torch.zeros(2), torch.zeros(2), torch.zeros(2, dtype=torch.float64), torch.zeros(2)]
    assert _ids(buckets(ts, 1 << 20), ts) == [[0, 1], [2], [3]]
    assert all(len({t.dtype for t in b}) == 1 for b in buckets(ts, 1 << 20))


def test_a_device_change_starts_a_new_bucket() -> None:
    ts = [torch.zeros(2), torch.empty(2, device="meta"), torch.zeros(2)]
    assert _ids(buckets(ts, 1 << 20), ts) == [[0], [1], [2]]


def test_an_oversize_tensor_gets_a_bucket_of_its_own() -> None:
    ts = [torch.zeros(2), torch.zeros(100), torch.zeros(2), torch.zeros(2)]
    assert _ids(buckets(ts, 40), ts) == [[0], [1], [2, 3]]


def test_replicas_must_be_positive() -> None:
    with pytest.raises(ValueError, match="replicas must be at least 1"):
        DataParallel(None, 0)
