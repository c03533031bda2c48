"""The server tier's wire: which streams each stage has, and frames over real gloo ranks."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from support.ranks import gloo_world, run_ranks

from edge.transport.base import Channel, Transport
from edge.transport.dist import DistTransport, Route
from edge.wire.frames import Codec, Kind, encode_frame

Stream = tuple[int, Channel]


def _route(stages: int, in_job: set[int] | None = None) -> Route:
    members = sorted(range(stages) if in_job is None else in_job)
    return Route(stages, {s: rank for rank, s in enumerate(members)})


def _same(got: list[Stream], want: list[Stream]) -> bool:
    """Equal as sets, and no stream twice (a stream twice would get two receivers)."""
    return len(got) == len(set(got)) and set(got) == set(want)


# Per number of stages: every stage's (incoming, outgoing) streams. The last stage of
# three or more also receives stage 0's labels on ``fwd``.
ROUTES: dict[int, list[tuple[list[Stream], list[Stream]]]] = {
    1: [([], [])],
    2: [
        ([(1, "bwd")], [(1, "fwd")]),
        ([(0, "fwd")], [(0, "bwd")]),
    ],
    3: [
        ([(1, "bwd")], [(1, "fwd"), (2, "fwd")]),
        ([(0, "fwd"), (2, "bwd")], [(2, "fwd"), (0, "bwd")]),
        ([(1, "fwd"), (0, "fwd")], [(1, "bwd")]),
    ],
    4: [
        ([(1, "bwd")], [(1, "fwd"), (3, "fwd")]),
        ([(0, "fwd"), (2, "bwd")], [(2, "fwd"), (0, "bwd")]),
        ([(1, "fwd"), (3, "bwd")], [(3, "fwd"), (1, "bwd")]),
        ([(2, "fwd"), (0, "fwd")], [(2, "bwd")]),
    ],
}


@pytest.mark.parametrize("stages", sorted(ROUTES))
def test_streams_of_every_stage(stages: int) -> None:
    route = _route(stages)
    for stage, (incoming, outgoing) in enumerate(ROUTES[stages]):
        assert _same(route.incoming(stage), incoming), (stage, route.incoming(stage))
        assert _same(route.outgoing(stage), outgoing), (stage, route.outgoing(stage))


def test_a_hybrid_route_keeps_only_the_stages_in_the_job() -> None:
    # Stages 0 and 1 are edge devices (MQTT); 2 and 3 are ranks 0 and 1 of this job.
    route = Route(4, {2: 0, 3: 1})
    assert _same(route.incoming(2), [(3, "bwd")])  # not stage 1's activations
    assert _same(route.outgoing(2), [(3, "fwd")])  # not stage 1's gradients
    assert _same(route.incoming(3), [(2, "fwd")])  # not stage 0's labels
    assert _same(route.outgoing(3), [(2, "bwd")])


@pytest.mark.parametrize("stages", range(1, 7))
def test_every_stream_has_both_ends_in_every_sub_job(stages: int) -> None:
    for size in range(1, stages + 1):
        for members in itertools.combinations(range(stages), size):
            route = _route(stages, set(members))
            sent = {(s, d, c) for s in members for d, c in route.outgoing(s)}
            received = {(s, d, c) for d in members for s, c in route.incoming(d)}
            assert sent == received, (stages, members)
            assert all(s in members and d in members for s, d, _ in sent)
            for s in members:  # within a stage, no stream twice
                assert len(route.outgoing(s)) == len(set(route.outgoing(s)))
                assert len(route.incoming(s)) == len(set(route.incoming(s)))
            if set(members) == set(range(stages)):
                # The full pipeline: fwd goes down a stage (or from 0 to the last with
                # the labels), bwd goes up one.
                fwd = {(s, s + 1) for s in range(stages - 1)}
                if stages > 2:
                    fwd.add((0, stages - 1))
                assert {(s, d) for s, d, c in sent if c == "fwd"} == fwd
                assert {(s, d) for s, d, c in sent if c == "bwd"} == {
                    (d, s) for s, d in fwd if d == s + 1
                }


# -- DistTransport in a one-process group ----------------------------------------------


def test_it_needs_an_initialised_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="not initialised"):
        DistTransport(Route(2, {0: 0, 1: 1}))


def test_it_refuses_stages_that_are_not_its_own(world_of_one: None) -> None:
    transport = DistTransport(Route(3, {0: 0, 1: 1}))  # this process is rank 0: stage 0
    assert isinstance(transport, Transport)
    with pytest.raises(ValueError, match="stage 1 does not run on rank 0"):
        transport.attach("j", 1)
    with pytest.raises(ValueError, match=r"stage 2 is not in this torch\.distributed job"):
        transport.send("j", 2, "fwd", b"x")
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
        expected = "dist-recv-1-bwd" if stage == 0 else "dist-recv-0-fwd"
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
