"""The server tier's wire (edge.transport.dist): which streams each stage has.

tests/integration/test_dist_transport_ranks.py sends frames over real gloo ranks.
"""

from __future__ import annotations

import itertools

import pytest
import torch.distributed as dist

from edge.transport.base import Channel
from edge.transport.dist import DistTransport, Route

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


def test_a_group_route_names_every_members_rank() -> None:
    route = Route(3, {0: 0, 1: (1, 2), 2: 3})
    assert route.members == {0: (0,), 1: (1, 2), 2: (3,)}
    assert 1 in route.ranks  # a hybrid route asks whether a stage is in the job
    with pytest.raises(ValueError, match="a stage without ranks"):
        Route(2, {0: 0, 1: ()})


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


# -- DistTransport without a process group ---------------------------------------------


def test_it_needs_an_initialised_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="not initialised"):
        DistTransport(Route(2, {0: 0, 1: 1}))
