"""The server tier's wire (edge.transport.dist) on real gloo process groups.

A one-process group checks the refusals; two spawned ranks exchange frames. Which
streams each stage has is tests/unit/edge/transport/test_dist_transport.py's.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from support.ranks import gloo_world, run_ranks

from edge.transport.base import Transport
from edge.transport.dist import DistTransport, Route
from edge.wire.frames import Codec, Kind, encode_frame

# -- DistTransport in a one-process group ----------------------------------------------


def test_it_refuses_stages_that_are_not_its_own(world_of_one: None) -> None:
    transport = DistTransport(Route(3, {0: 0, 1: 1}))  # this process is rank 0: stage 0
    assert isinstance(transport, Transport)
    with pytest.raises(ValueError, match="stage 1 member 0 does not run on rank 0"):
        transport.attach("j", 1)
    with pytest.raises(ValueError, match="stage 0 member 1 does not run on rank 0"):
        transport.attach("j", 0, 1)
    with pytest.raises(ValueError, match=r"stage 2 member 0 is not in this torch\.distributed job"):
        transport.send("j", 2, "fwd", b"x")
    # A group's members are ranks too; its gradient sum is a collective, not a channel.
    group = DistTransport(Route(2, {0: 0, 1: (1, 2)}))
    with pytest.raises(ValueError, match=r"stage 1 member 2 is not in this torch\.distributed"):
        group.send("j", 1, "fwd", b"x", 2)
    with pytest.raises(ValueError, match=r"no 'reduce' channel over torch\.distributed"):
        group.send("j", 1, "reduce", b"x", 1)
    # Stage 0's only peer in this job is stage 1 (rank 1, absent): nothing to start or end.
    transport = DistTransport(Route(3, {0: 0}))
    inbox = transport.attach("j", 0)
    with pytest.raises(ValueError, match="already attached"):
        transport.attach("j", 0)
    transport.close()
    assert inbox.closed


# -- two real processes ----------------------------------------------------------------

JOB = "jdist"
MICROBATCHES = 3


def _activation(mb: int) -> torch.Tensor:
    return torch.arange(12, dtype=torch.float32).reshape(3, 4) * (mb + 1) - 0.5


def _labels(mb: int) -> torch.Tensor:
    return torch.tensor([mb, 2 * mb, 3], dtype=torch.int64)


def _gradient() -> torch.Tensor:
    return torch.linspace(-1, 1, 6, dtype=torch.float32).reshape(2, 3)


def _receivers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("dist-recv-")]


def _exchange_on_rank(rank: int, world: int, store_path: str, out_dir: str) -> None:
    with gloo_world(rank, world, store_path):
        transport = DistTransport(Route(2, {0: 0, 1: 1}), join_timeout_s=15)
        stage = rank
        inbox = transport.attach(JOB, stage)
        receivers = _receivers()
        expected = "dist-recv-1.0-bwd" if stage == 0 else "dist-recv-0.0-fwd"
        assert [t.name for t in receivers] == [expected]
        dist.barrier()  # both stages receive before any frame is sent
        got: dict[str, torch.Tensor] = {}
        if stage == 0:
            for mb in range(MICROBATCHES):
                transport.send(
                    JOB,
                    1,
                    "fwd",
                    encode_frame(Kind.ACTIVATION, JOB, 0, mb, _activation(mb), Codec.FP32),
                )
            transport.send(
                JOB, 1, "fwd", encode_frame(Kind.LABELS, JOB, 0, 0, _labels(0), Codec.FP32)
            )
            got["gradient"] = inbox.take(Kind.GRADIENT, 0, 1, timeout=10).tensor.clone()
        else:
            # Taken by key, not in the order they were sent.
            for mb in reversed(range(MICROBATCHES)):
                got[f"act{mb}"] = inbox.take(Kind.ACTIVATION, 0, mb, timeout=10).tensor.clone()
            got["labels"] = inbox.take(Kind.LABELS, 0, 0, timeout=10).tensor.clone()
            transport.send(
                JOB, 0, "bwd", encode_frame(Kind.GRADIENT, JOB, 0, 1, _gradient(), Codec.FP32)
            )
        transport.detach(JOB, stage)
        alive = [t.name for t in receivers if t.is_alive()]
        torch.save(
            {
                "got": got,
                "alive": alive,
                "closed": inbox.closed,
                "pending": inbox.pending,
                "frames_sent": transport.frames_sent,
                "frames_received": inbox.frames_received,
                "dropped": sum(inbox.dropped.values()),
            },
            Path(out_dir) / f"rank{rank}.pt",
        )


def test_frames_cross_between_two_ranks_and_detach_ends_the_receivers(tmp_path: Path) -> None:
    run_ranks(_exchange_on_rank, 2, str(tmp_path / "store"), str(tmp_path), timeout=60)
    first, last = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    for mb in range(MICROBATCHES):
        assert torch.equal(last["got"][f"act{mb}"], _activation(mb))
    assert torch.equal(last["got"]["labels"], _labels(0))
    assert last["got"]["labels"].dtype == torch.int64
    assert torch.equal(first["got"]["gradient"], _gradient())
    assert (first["frames_sent"], first["frames_received"]) == (MICROBATCHES + 1, 1)
    assert (last["frames_sent"], last["frames_received"]) == (1, MICROBATCHES + 1)
    for rank in (first, last):
        assert rank["alive"] == []  # detach ended every receiver thread
        assert rank["closed"] and rank["pending"] == 0 and rank["dropped"] == 0
