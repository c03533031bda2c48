"""The inbox keeps only what its stage can use (edge/transport/inbox.py, [Note: bounded inboxes]).

Frames are delivered straight to an :class:`Inbox`, as every transport does; a
refused frame must be counted by its reason and must never stand in for the
real frame of its key.
"""

from __future__ import annotations

import pytest
import torch

from edge.transport.base import Channel
from edge.transport.inbox import Expected, Inbox, InboxClosed
from edge.wire.frames import Codec, Kind, encode_frame, prefix_size

JOB = "job-7"
F32 = frozenset({torch.float32})
ACT = Expected((4, 8), F32)
LABELS = Expected((4,), frozenset({torch.int64}))
PLAN = {Kind.ACTIVATION: ACT, Kind.LABELS: LABELS}


def act(
    step: int, mb: int = 0, tensor: torch.Tensor | None = None, codec: Codec = Codec.FP32
) -> bytes:
    t = torch.full((4, 8), float(step * 10 + mb)) if tensor is None else tensor
    return encode_frame(Kind.ACTIVATION, JOB, step, mb, t, codec)


def labels(step: int, mb: int = 0) -> bytes:
    return encode_frame(Kind.LABELS, JOB, step, mb, torch.arange(4), Codec.RAW)


def planned(step: int = 0, microbatches: int = 2) -> Inbox:
    inbox = Inbox(JOB, 1)
    inbox.expect(PLAN, microbatches=microbatches, step=step)
    return inbox


# -- the step window ---------------------------------------------------------------


def test_before_the_stage_says_its_step_any_step_is_kept() -> None:
    inbox = Inbox(JOB, 1)
    assert inbox.deliver(act(0), "fwd") and inbox.deliver(act(10_000), "fwd")
    assert inbox.pending == 2 and not inbox.dropped


def test_only_the_running_step_and_the_next_are_kept() -> None:
    inbox = planned(step=5)
    assert inbox.deliver(act(5), "fwd")
    assert inbox.deliver(act(6), "fwd")  # sent ahead by a stage one step on: kept
    assert not inbox.deliver(act(7), "fwd")
    assert not inbox.deliver(act(1 << 40), "fwd")
    assert not inbox.deliver(act(4), "fwd")
    assert not inbox.deliver(act(0), "fwd")
    assert inbox.dropped == {"ahead": 2, "late": 2}
    assert inbox.pending == 2


def test_the_window_moves_with_the_stage_and_keeps_early_frames() -> None:
    inbox = planned(step=0)
    for mb in range(2):
        assert inbox.deliver(act(0, mb), "fwd") and inbox.deliver(act(1, mb), "fwd")
    for mb in range(2):
        inbox.take(Kind.ACTIVATION, 0, mb, timeout=0)
    inbox.forget_before(1)  # step 0 done: step 1's frames, sent early, are still there
    assert inbox.pending == 2
    assert torch.equal(
        inbox.take(Kind.ACTIVATION, 1, 1, timeout=0).tensor, torch.full((4, 8), 11.0)
    )
    assert inbox.deliver(act(2), "fwd")  # the new next step
    assert not inbox.deliver(act(3), "fwd") and not inbox.deliver(act(0, 1), "fwd")
    assert inbox.dropped == {"ahead": 1, "late": 1}


def test_forgetting_a_step_drops_its_leftovers_and_refuses_its_repeats() -> None:
    inbox = planned(step=0)
    inbox.deliver(act(0, 0), "fwd")
    inbox.forget_before(1)
    assert inbox.pending == 0 and inbox.held_bytes == 0
    assert not inbox.deliver(act(0, 0), "fwd")
    assert inbox.dropped == {"late": 1}


def test_frames_held_before_the_stage_says_its_step_are_refitted() -> None:
    inbox = Inbox(JOB, 1)
    for step in (2, 3, 4, 9):
        inbox.deliver(act(step), "fwd")
    inbox.deliver(act(3, tensor=torch.ones(5, 8)), "fwd")  # step 3 mb 0 is held already
    inbox.deliver(act(3, 1, tensor=torch.ones(5, 8)), "fwd")
    inbox.deliver(act(3, 7), "fwd")
    inbox.expect(PLAN, microbatches=2, step=3)
    assert inbox.dropped == {"duplicate": 1, "ahead": 1, "wrong-shape": 1, "wrong-microbatch": 1}
    assert inbox.pending == 2  # step 3 mb 0 and step 4 mb 0; step 2 is simply forgotten
    inbox.take(Kind.ACTIVATION, 4, 0, timeout=0)
    assert inbox.deliver(act(3, 1), "fwd")  # the refused one's key is free for the real frame


# -- what the plan implies ---------------------------------------------------------


@pytest.mark.parametrize(
    ("reason", "data", "channel"),
    [
        ("wrong-shape", act(0, tensor=torch.ones(4, 7)), "fwd"),
        ("wrong-shape", act(0, tensor=torch.ones(8, 4)), "fwd"),
        ("wrong-shape", act(0, tensor=torch.ones(32)), "fwd"),
        ("wrong-shape", act(0, tensor=torch.ones(0, 8)), "fwd"),
        ("wrong-dtype", act(0, tensor=torch.ones(4, 8, dtype=torch.float64)), "fwd"),
        (
            "wrong-dtype",
            act(0, tensor=torch.ones(4, 8, dtype=torch.float16), codec=Codec.FP16),
            "fwd",
        ),
        ("wrong-dtype", act(0, tensor=torch.ones(4, 8, dtype=torch.int32)), "fwd"),
        ("too-large", act(0, tensor=torch.ones(4, 9)), "fwd"),  # over the largest it expects
        ("too-large", act(0, tensor=torch.ones(4, 8, dtype=torch.int64)), "fwd"),
        ("wrong-dtype", encode_frame(Kind.LABELS, JOB, 0, 0, torch.ones(4), Codec.FP32), "fwd"),
        ("wrong-shape", encode_frame(Kind.LABELS, JOB, 0, 0, torch.arange(5), Codec.RAW), "fwd"),
        ("wrong-microbatch", act(0, 2), "fwd"),
        ("wrong-microbatch", act(0, 2**32 - 1), "fwd"),
        ("wrong-kind", encode_frame(Kind.GRADIENT, JOB, 0, 0, torch.ones(4, 8), Codec.FP32), "bwd"),
        ("wrong-kind", encode_frame(Kind.WEIGHTS, JOB, 0, 0, torch.ones(4, 8), Codec.FP32), "fwd"),
    ],
)
def test_a_frame_the_plan_does_not_imply_is_dropped(reason: str, data: bytes, channel: str) -> None:
    inbox = planned()
    assert not inbox.deliver(data, channel)  # type: ignore[arg-type]
    assert inbox.dropped == {reason: 1} and inbox.pending == 0 and inbox.frames_received == 0


@pytest.mark.parametrize(
    "forged",
    [
        act(0, tensor=torch.zeros(2, 8)),
        act(0, tensor=torch.zeros(4, 8, dtype=torch.float64)),
        act(0, tensor=torch.zeros(4, 8))[:-1] + b"\x01",  # the right header, a bad checksum
    ],
    ids=["shape", "dtype", "checksum"],
)
def test_a_forged_frame_that_arrives_first_does_not_make_the_real_one_a_duplicate(
    forged: bytes,
) -> None:
    inbox = planned()
    assert not inbox.deliver(forged, "fwd")
    real = torch.randn(4, 8)
    assert inbox.deliver(act(0, tensor=real), "fwd")
    assert torch.equal(inbox.take(Kind.ACTIVATION, 0, 0, timeout=0).tensor, real)
    assert not inbox.deliver(act(0, tensor=real), "fwd")  # its true repeat is one
    assert inbox.dropped["duplicate"] == 1 and sum(inbox.dropped.values()) == 2


def test_the_codec_does_not_change_what_a_link_accepts() -> None:
    inbox = planned()
    x = torch.linspace(-1, 1, 32).view(4, 8)
    for mb, codec in enumerate((Codec.INT8, Codec.FP16)):
        assert inbox.deliver(act(0, mb, x, codec), "fwd")
        got = inbox.take(Kind.ACTIVATION, 0, mb, timeout=0).tensor
        assert got.dtype == torch.float32 and torch.allclose(got, x, atol=1 / 127)
    # A float64 tensor sent as int8 decodes to float32 (8x its payload otherwise): accepted.
    assert inbox.deliver(act(1, 0, x.double(), Codec.INT8), "fwd")
    assert inbox.take(Kind.ACTIVATION, 1, 0, timeout=0).tensor.dtype == torch.float32
    assert not inbox.dropped


def test_a_kind_without_a_known_shape_is_kept_whatever_its_shape() -> None:
    inbox = Inbox(JOB, 1)
    inbox.expect({Kind.ACTIVATION: ACT, Kind.LABELS: None}, microbatches=1, step=0)
    assert inbox.deliver(encode_frame(Kind.LABELS, JOB, 0, 0, torch.ones(3, 3), Codec.FP32), "fwd")
    assert not inbox.deliver(act(0, tensor=torch.ones(3, 3)), "fwd")
    assert inbox.dropped == {"wrong-shape": 1}


# -- totals --------------------------------------------------------------------------


def test_totals_follow_the_plan() -> None:
    inbox = planned(microbatches=3)
    act_bytes = prefix_size(2) + 32 * 4
    label_bytes = prefix_size(1) + 4 * 8
    assert ACT.max_nbytes == act_bytes and LABELS.max_nbytes == label_bytes
    assert inbox.max_frames == 2 * 3 * 2
    assert inbox.max_bytes == 2 * 3 * (act_bytes + label_bytes)
    assert inbox.max_frame_bytes == act_bytes
    # Everything two steps of the plan send fits, exactly.
    for step in (0, 1):
        for mb in range(3):
            assert inbox.deliver(act(step, mb), "fwd") and inbox.deliver(labels(step, mb), "fwd")
    assert inbox.pending == inbox.max_frames and inbox.held_bytes == inbox.max_bytes
    assert not inbox.dropped


def test_a_frame_over_the_largest_the_plan_sends_is_refused_unread() -> None:
    inbox = planned()
    huge = act(0, tensor=torch.zeros(1 << 18))  # 1 MiB
    assert not inbox.deliver(huge, "fwd")
    assert not inbox.deliver(b"\xff" * (inbox.max_frame_bytes + 1), "fwd")
    assert inbox.dropped == {"too-large": 2}


def test_frame_and_byte_totals_bound_an_inbox_without_a_plan() -> None:
    inbox = Inbox(JOB, 1, max_frames=3)
    for mb in range(5):
        inbox.deliver(act(0, mb), "fwd")
    assert inbox.pending == 3 and inbox.dropped == {"inbox-full": 2}
    inbox.take(Kind.ACTIVATION, 0, 0, timeout=0)
    assert inbox.deliver(act(0, 3), "fwd")  # room again, and its key was never recorded

    size = len(act(0))
    inbox = Inbox(JOB, 1, max_bytes=2 * size + 1)
    assert [inbox.deliver(act(0, mb), "fwd") for mb in range(3)] == [True, True, False]
    assert inbox.held_bytes == 2 * size and inbox.dropped == {"inbox-full": 1}

    inbox = Inbox(JOB, 1, max_frame_bytes=size - 1)
    assert not inbox.deliver(act(0), "fwd") and inbox.dropped == {"too-large": 1}


def test_held_bytes_count_a_decoded_tensor_larger_than_its_frame() -> None:
    inbox = Inbox(JOB, 1)
    data = act(0, tensor=torch.zeros(1024), codec=Codec.INT8)
    inbox.deliver(data, "fwd")
    assert inbox.held_bytes == 1024 * 4 > len(data)
    inbox.take(Kind.ACTIVATION, 0, 0, timeout=0)
    assert inbox.held_bytes == 0


# -- counters ------------------------------------------------------------------------


def test_stats_count_every_drop_by_reason() -> None:
    inbox = planned()
    inbox.deliver(act(0), "fwd")
    inbox.deliver(act(0), "fwd")
    inbox.deliver(b"garbage" * 10, "fwd")
    inbox.deliver(act(9), "fwd")
    inbox.deliver(act(1, tensor=torch.ones(2)), "fwd")
    assert inbox.stats() == {
        "frames_received": 1,
        "bytes_received": len(act(0)),
        "pending": 1,
        "held_bytes": len(act(0)),
        "dropped.duplicate": 1,
        "dropped.bad-magic": 1,
        "dropped.ahead": 1,
        "dropped.wrong-shape": 1,
    }


def test_a_closed_inbox_still_refuses_and_counts() -> None:
    inbox = planned()
    inbox.close()
    assert not inbox.deliver(act(7), "fwd") and inbox.dropped == {"ahead": 1}
    with pytest.raises(InboxClosed):
        inbox.take(Kind.ACTIVATION, 0, 0, timeout=0)


def test_expect_refuses_no_microbatches() -> None:
    with pytest.raises(ValueError, match="microbatches"):
        Inbox(JOB, 1).expect(PLAN, microbatches=0, step=0)


# -- groups: pieces of a block, and the group's gradient chunks ------------------------
# Member 1 of a group holds rows [2, 8) of every 8-sample microbatch; the stage before
# it is a group of blocks [0, 4) and [4, 8): its activations come as rows [2, 4) and [4, 8).
BLOCK = Expected((6, 8), F32, ((2, 4), (4, 8)))
CHUNK = Expected((5,), F32)


def piece(step: int, rows: tuple[int, int], mb: int = 0, width: int = 8) -> bytes:
    t = torch.full((rows[1] - rows[0], width), float(rows[0]))
    return encode_frame(Kind.ACTIVATION, JOB, step, mb, t, Codec.FP32, first=rows[0])


def in_group(members: int = 2) -> Inbox:
    inbox = Inbox(JOB, 1, 1)
    plan = {Kind.ACTIVATION: BLOCK, Kind.REDUCE: CHUNK, Kind.GATHER: CHUNK}
    inbox.expect(plan, microbatches=2, step=0, members=members)
    return inbox


def test_a_block_arrives_as_its_pieces_taken_by_their_first_row() -> None:
    inbox = in_group()
    assert inbox.deliver(piece(0, (4, 8)), "fwd") and inbox.deliver(piece(0, (2, 4)), "fwd")
    got = inbox.take(Kind.ACTIVATION, 0, 0, timeout=1, first=2)
    assert got.samples == (2, 4) and got.tensor.shape == (2, 8) and got.tensor[0, 0] == 2
    assert inbox.take(Kind.ACTIVATION, 0, 0, timeout=1, first=4).samples == (4, 8)
    with pytest.raises(TimeoutError):
        inbox.take(Kind.ACTIVATION, 0, 0, timeout=0.01, first=0)


@pytest.mark.parametrize(
    ("reason", "data"),
    [
        ("wrong-rows", piece(0, (0, 4))),  # rows of the sender's block, not of ours
        ("wrong-rows", piece(0, (2, 5))),
        ("wrong-rows", piece(0, (2, 8))),  # the whole block, where the plan sends two pieces
        ("wrong-shape", piece(0, (2, 4), width=7)),
        ("wrong-microbatch", piece(0, (2, 4), mb=2)),
    ],
)
def test_a_piece_the_plan_does_not_imply_is_dropped(reason: str, data: bytes) -> None:
    inbox = in_group()
    assert not inbox.deliver(data, "fwd")
    assert inbox.dropped == {reason: 1}
    assert inbox.deliver(piece(0, (2, 4)), "fwd")  # the real one is no duplicate


def test_a_one_device_link_wants_the_whole_microbatch_from_row_0() -> None:
    inbox = planned()
    moved = encode_frame(Kind.ACTIVATION, JOB, 0, 0, torch.ones(4, 8), Codec.FP32, first=1)
    assert not inbox.deliver(moved, "fwd")
    assert inbox.dropped == {"wrong-rows": 1}


_GROUP_CHANNELS: tuple[tuple[Kind, Channel], ...] = (
    (Kind.REDUCE, "reduce"),
    (Kind.GATHER, "gather"),
)


def test_group_chunks_come_on_their_channels_one_per_member() -> None:
    """``REDUCE`` chunks on ``reduce``, ``GATHER`` chunks on ``gather``, and not across."""
    inbox = in_group(members=3)
    for kind, channel in _GROUP_CHANNELS:
        for sender in (0, 2):
            frame = encode_frame(kind, JOB, 0, sender, torch.ones(5), Codec.RAW)
            assert inbox.deliver(frame, channel, sender)
        stray = encode_frame(kind, JOB, 0, 3, torch.ones(5), Codec.RAW)  # no member 3
        assert not inbox.deliver(stray, channel, 3)
    short = encode_frame(Kind.REDUCE, JOB, 0, 0, torch.ones(4), Codec.RAW)
    assert not inbox.deliver(short, "reduce", 0)
    misrouted = encode_frame(Kind.REDUCE, JOB, 0, 1, torch.ones(5), Codec.RAW)
    assert not inbox.deliver(misrouted, "fwd")
    assert not inbox.deliver(misrouted, "gather", 1)
    crossed = encode_frame(Kind.GATHER, JOB, 0, 1, torch.ones(5), Codec.RAW)
    assert not inbox.deliver(crossed, "reduce", 1)
    assert inbox.dropped == {"wrong-microbatch": 2, "wrong-shape": 1, "wrong-kind": 3}
    assert inbox.take(Kind.GATHER, 0, 2, timeout=1).tensor.tolist() == [1.0] * 5


def test_a_chunk_must_name_the_member_whose_topic_it_came_on() -> None:
    """Member 1 claims member 0's chunk (or a transport cannot say who sent one): dropped
    before its key is recorded, so member 0's own still arrives."""
    inbox = in_group(members=3)
    forged = encode_frame(Kind.REDUCE, JOB, 0, 0, torch.full((5,), 7.0), Codec.RAW)
    assert not inbox.deliver(forged, "reduce", 1)
    assert not inbox.deliver(forged, "reduce")
    assert inbox.dropped == {"wrong-sender": 2}
    real = encode_frame(Kind.REDUCE, JOB, 0, 0, torch.ones(5), Codec.RAW)
    assert inbox.deliver(real, "reduce", 0)
    assert inbox.take(Kind.REDUCE, 0, 0, timeout=1).tensor.tolist() == [1.0] * 5


def test_totals_of_a_group_count_every_piece_and_chunk() -> None:
    inbox = in_group(members=2)
    pieces_bytes = 2 * prefix_size(2) + 6 * 8 * 4
    chunk_bytes = prefix_size(1) + 5 * 4
    assert BLOCK.total_nbytes == pieces_bytes
    assert inbox.max_frames == 2 * (2 * 2 + 2 * 2)  # two steps: 2 pieces x 2 mbs, 2 chunks x 2
    assert inbox.max_bytes == 2 * (2 * pieces_bytes + 2 * 2 * chunk_bytes)
    for step in (0, 1):
        for mb in range(2):
            assert inbox.deliver(piece(step, (2, 4), mb), "fwd")
            assert inbox.deliver(piece(step, (4, 8), mb), "fwd")
        for kind, channel in _GROUP_CHANNELS:
            for sender in range(2):
                frame = encode_frame(kind, JOB, step, sender, torch.ones(5), Codec.RAW)
                assert inbox.deliver(frame, channel, sender)
    assert inbox.pending == inbox.max_frames and inbox.held_bytes == inbox.max_bytes
    assert not inbox.dropped


def test_a_non_exact_group_keeps_the_next_sums_chunks_and_no_further() -> None:
    """A DiLoCo group sums once in ``H`` steps, and a member waiting in the sum of step
    ``k`` may hear a faster member's chunks of step ``k + H``: kept, with their repeats
    refused, while activations keep the two-step window and a chunk past ``k + H`` is
    refused ([Note: bounded inboxes])."""
    inbox = Inbox(JOB, 1, 1)
    plan = {Kind.ACTIVATION: BLOCK, Kind.REDUCE: CHUNK, Kind.GATHER: CHUNK}
    inbox.expect(plan, microbatches=2, step=7, members=3, group_every=8)
    for kind, channel in _GROUP_CHANNELS:
        chunk = encode_frame(kind, JOB, 15, 2, torch.ones(5), Codec.RAW)
        assert inbox.deliver(chunk, channel, 2)
        assert not inbox.deliver(chunk, channel, 2)  # QoS 1's repeat
        beyond = encode_frame(kind, JOB, 16, 2, torch.ones(5), Codec.RAW)
        assert not inbox.deliver(beyond, channel, 2)
    assert not inbox.deliver(piece(9, (2, 4)), "fwd")
    assert inbox.dropped == {"duplicate": 2, "ahead": 3}
    inbox.forget_before(8)  # the held chunks, and their keys, outlive the step
    again = encode_frame(Kind.REDUCE, JOB, 15, 2, torch.ones(5), Codec.RAW)
    assert not inbox.deliver(again, "reduce", 2)
    assert inbox.take(Kind.REDUCE, 15, 2, timeout=0).tensor.tolist() == [1.0] * 5
    exact = in_group(members=3)  # an exact group sums every step: two steps, as before
    early = encode_frame(Kind.REDUCE, JOB, 2, 2, torch.ones(5), Codec.RAW)
    assert not exact.deliver(early, "reduce", 2)
    assert exact.dropped == {"ahead": 1}
    with pytest.raises(ValueError, match="group_every"):
        exact.expect(plan, microbatches=2, step=0, members=3, group_every=0)
