"""The wire contract of stage groups: how a microbatch is split and who sends whom what."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge.wire.groups import blocks, chunk_size, overlap, pieces, split_samples, sum_waits
from edge.wire.topics import TOPIC_ROOT, stage_access

SHARES = st.lists(st.floats(0.01, 100.0, allow_nan=False), min_size=1, max_size=6)


@given(n=st.integers(1, 512), shares=SHARES)
def test_counts_add_up_and_are_within_one_of_the_exact_share(n: int, shares: list[float]) -> None:
    try:
        counts = split_samples(n, shares)
    except ValueError as exc:
        assert "leaves a member without samples" in str(exc)
        return
    total = sum(shares)
    assert sum(counts) == n and min(counts) >= 1
    assert all(abs(c - n * s / total) < 1 for c, s in zip(counts, shares, strict=True))


@pytest.mark.parametrize(
    ("n", "shares", "counts"),
    [
        (8, [1, 1], [4, 4]),
        (8, [0.75, 0.25], [6, 2]),
        (7, [1, 1], [4, 3]),  # a tie goes to the earlier member
        (10, [1, 1, 1], [4, 3, 3]),
        (10, [0.5, 0.3, 0.2], [5, 3, 2]),
        (9, [0.84, 0.16], [8, 1]),  # 7.56 and 1.44: the larger remainder gets the sample
        (5, [1], [5]),
    ],
)
def test_largest_remainder(n: int, shares: list[float], counts: list[int]) -> None:
    assert split_samples(n, shares) == counts


@given(
    n=st.integers(1, 64),
    speeds=st.lists(st.integers(1, 10), min_size=1, max_size=6),
    scale=st.floats(1e-3, 1e3),
)
def test_the_split_does_not_depend_on_the_shares_scale(
    n: int, speeds: list[int], scale: float
) -> None:
    """The planner checks a group's split with its members' speeds and the runtime splits
    by the plan's shares (those speeds over their sum): rounding must not tell them apart,
    as it did when 16 samples over speeds 10, 10, 1, 1, 1, 1 tied within a rounding error
    (a plan the planner accepted that the runtime refused)."""

    def split(of: list[float]) -> list[int] | None:
        try:
            return split_samples(n, of)
        except ValueError:
            return None

    scaled = [s * scale for s in speeds]  # ties in exact arithmetic, not always in floats
    total = sum(scaled)
    assert split([float(s) for s in speeds]) == split(scaled)
    assert split(scaled) == split([s / total for s in scaled])


def test_ties_within_rounding_go_to_the_earlier_member() -> None:
    core = 50.891636708655525  # a testbed's GFLOP/s a core: two devices at 0.625, four at a tenth
    speeds = [0.625 * core] * 2 + [0.0625 * core] * 4
    for of in (speeds, [s / sum(speeds) for s in speeds]):
        with pytest.raises(ValueError, match="leaves a member without samples"):
            split_samples(16, of)  # 6.67 and 0.67 each: the fast members' remainders first


@pytest.mark.parametrize("shares", [[], [1.0, 0.0], [1.0, -1.0], [float("nan")], [float("inf")]])
def test_bad_shares_are_refused(shares: list[float]) -> None:
    with pytest.raises(ValueError, match="shares must be positive numbers"):
        split_samples(8, shares)


def test_a_member_without_samples_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"of 4 samples split by shares \[0.9, 0.1\] leaves"):
        split_samples(4, [0.9, 0.1])


def test_blocks_and_pieces() -> None:
    assert blocks([3, 2, 3]) == [(0, 3), (3, 5), (5, 8)]
    assert overlap((0, 3), (3, 5)) is None and overlap((0, 6), (3, 8)) == (3, 6)
    # Senders [6, 2] to the receiver of rows [4, 8) of a microbatch of 8: two pieces.
    assert pieces([6, 2], (4, 8)) == [(0, (4, 6)), (1, (6, 8))]
    assert pieces([8], (4, 8)) == [(0, (4, 8))]
    assert pieces([4, 4], (0, 4)) == [(0, (0, 4))]


@given(senders=st.lists(st.integers(1, 9), min_size=1, max_size=5), data=st.data())
def test_pieces_cover_a_block_exactly_in_order(senders: list[int], data: st.DataObject) -> None:
    n = sum(senders)
    receivers = data.draw(st.lists(st.integers(1, 9), min_size=1, max_size=5))
    receivers = receivers if sum(receivers) == n else [n]
    for block in blocks(receivers):
        got = [rows for _, rows in pieces(senders, block)]
        assert got[0][0] == block[0] and got[-1][1] == block[1]
        assert all(a[1] == b[0] for a, b in itertools.pairwise(got))


@pytest.mark.parametrize(("numel", "g", "c"), [(10, 2, 5), (11, 2, 6), (1, 3, 1), (0, 2, 1)])
def test_chunks_cover_the_vector(numel: int, g: int, c: int) -> None:
    assert chunk_size(numel, g) == c and c * g >= numel


def test_a_group_member_may_use_exactly_its_own_topics() -> None:
    """Groups 1,2,1: member 1 of stage 1 sends to stage 2 and back to stage 0, reads its
    own member topics, the reduce topic member 0 sends it on and member 0's gather topic,
    may send only on its own reduce topic to member 0 and its own gather topic, and
    publishes no weights; stage 0 sends to both members and the labels to the last."""
    root = f"{TOPIC_ROOT}/jobs/j"
    member = stage_access("j", 1, 3, "pi-c", member=1, group_sizes=[1, 2, 1])
    assert set(member.publish) == {
        f"{root}/events/pi-c",
        f"{root}/stage/2/fwd",
        f"{root}/stage/0/bwd",
        f"{root}/stage/1/reduce/1",
        f"{root}/stage/1/gather/1",
    }
    assert set(member.read) == {
        f"{root}/stage/1/member/1/fwd",
        f"{root}/stage/1/member/1/bwd",
        f"{root}/stage/1/member/1/reduce/0",
        f"{root}/stage/1/gather/0",
        f"{root}/restore/1",
    }
    first = stage_access("j", 0, 3, "pi-a", group_sizes=[1, 2, 1])
    assert set(first.publish) == {
        f"{root}/events/pi-a",
        f"{root}/weights/0",
        f"{root}/stage/1/fwd",
        f"{root}/stage/1/member/1/fwd",
        f"{root}/stage/2/fwd",
    }
    assert not any("reduce" in t or "gather" in t for t in first.publish + first.read)
    last = stage_access("j", 2, 3, "pi-d", group_sizes=[1, 2, 1])
    assert {f"{root}/stage/1/bwd", f"{root}/stage/1/member/1/bwd"} <= set(last.publish)
    with pytest.raises(ValueError, match=r"member 2 of stage 1 is not in groups \[1, 2, 1\]"):
        stage_access("j", 1, 3, "pi-c", member=2, group_sizes=[1, 2, 1])


def test_a_members_wait_in_the_sum_is_the_last_start_less_its_own() -> None:
    assert sum_waits([100.0, 100.25, 99.5]) == [0.25, 0.0, 0.75]
    assert sum_waits([7.0]) == [0.0]
    with pytest.raises(ValueError, match="no members' start times"):
        sum_waits([])
