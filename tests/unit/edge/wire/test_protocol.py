"""The wire contract (edge/wire/frames.py): frames round-trip, garbage is refused, topics parse.

Tensors are drawn as a seed plus a shape, a layout (contiguous, transposed, every
other row) and a magnitude, so hypothesis explores shapes and dtypes while torch
makes the values. Codecs that must be exact are checked bit for bit, on random
bit patterns (NaNs, infinities and -0.0 included); the lossy ones on finite values.
"""

from __future__ import annotations

import math
import string

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edge.wire.frames import (
    DTYPES,
    HEADER,
    MAX_ELEMENTS,
    MAX_FRAME_BYTES,
    MAX_NDIM,
    Codec,
    Frame,
    FrameError,
    Kind,
    decode_body,
    decode_frame,
    decoded_dtype,
    encode_frame,
    prefix_size,
    read_header,
)
from edge.wire.topics import (
    TOPIC_ROOT,
    device_cmd,
    device_heartbeat,
    device_profile,
    device_status,
    job_events,
    job_weights,
    parse_events_topic,
    parse_stage_topic,
    stage_access,
    stage_topic,
    valid_device_id,
    valid_job_id,
)

FIELDS = (
    "magic",
    "version",
    "kind",
    "codec",
    "dtype",
    "ndim",
    "job",
    "step",
    "microbatch",
    "lo",
    "hi",
    "scale",
    "length",
    "checksum",
)
REASONS = {
    "bad-magic",
    "bad-version",
    "bad-field",
    "bad-shape",
    "bad-job",
    "bad-rows",
    "truncated",
    "bad-length",
    "too-large",
    "bad-checksum",
}
JOB_CHARS = string.ascii_letters + string.digits + "_-"
JOB_IDS = st.from_regex(r"[A-Za-z0-9_-]{1,16}", fullmatch=True)
SHAPES = st.lists(st.integers(0, 5), max_size=4).map(tuple)
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Lossy float codecs: (rtol, atol). rtol is one unit in the last place; atol covers
# fp16's subnormals (values from 1e-3 * randn underflow there).
TOLERANCE = {Codec.FP16: (2.0**-10, 2.0**-24), Codec.BF16: (2.0**-7, 1e-30)}
HEAVY = settings(deadline=None, max_examples=150)


def header(frame: bytes) -> dict[str, object]:
    return dict(zip(FIELDS, HEADER.unpack_from(frame), strict=True))


def patched(frame: bytes, **changes: object) -> bytes:
    """``frame`` with some header fields replaced (the shape and payload kept)."""
    return HEADER.pack(*(header(frame) | changes).values()) + frame[HEADER.size :]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(BITS[t.dtype.itemsize])


def received_dtype(dtype: torch.dtype, codec: Codec) -> torch.dtype:
    """What a tensor of ``dtype`` sent with ``codec`` decodes to: itself, but int8 never
    decodes to float64 (8x its payload): float32."""
    return torch.float32 if codec is Codec.INT8 and dtype is torch.float64 else dtype


def is_lossy(dtype: torch.dtype, codec: Codec) -> bool:
    """Whether the codec may change a tensor of ``dtype`` (integers always travel raw)."""
    if not dtype.is_floating_point or codec is Codec.RAW:
        return False
    return codec is not Codec.FP32 or dtype is torch.float64


def make(
    shape: tuple[int, ...], dtype: torch.dtype, finite: bool, magnitude: float, gen: torch.Generator
) -> torch.Tensor:
    if finite and dtype.is_floating_point:
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * magnitude).to(dtype)
    n = math.prod(shape) * dtype.itemsize
    return torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8).view(dtype).reshape(shape)


@st.composite
def tensors(draw: st.DrawFn, dtype: torch.dtype, finite: bool) -> torch.Tensor:
    """Random bits, or (``finite``, float dtypes) ``randn * magnitude``; maybe a strided view."""
    shape: tuple[int, ...] = draw(SHAPES)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    magnitude = draw(st.sampled_from([1e-3, 1.0, 1e3]))
    layout = draw(st.sampled_from(["contiguous", "transposed", "strided"]))
    if layout == "transposed" and len(shape) >= 2:
        dims = tuple(reversed(range(len(shape))))
        return make(shape[::-1], dtype, finite, magnitude, gen).permute(dims)
    if layout == "strided" and shape:
        return make((2 * shape[0], *shape[1:]), dtype, finite, magnitude, gen)[::2]
    return make(shape, dtype, finite, magnitude, gen)


def decodes_or_refuses(data: bytes | bytearray) -> None:
    """The fuzzing property: a :class:`Frame` or a :class:`FrameError`, nothing else."""
    try:
        frame = decode_frame(data)
    except FrameError as exc:
        assert exc.reason in REASONS, exc
        return
    assert isinstance(frame, Frame)
    assert frame.nbytes == len(data)
    assert frame.tensor.dtype in DTYPES.values()


def good_frame(codec: Codec = Codec.FP32) -> bytes:
    return encode_frame(Kind.ACTIVATION, "job-7", 3, 1, torch.linspace(-1, 1, 32).view(4, 8), codec)


# -- round trips ---------------------------------------------------------------------


@HEAVY
@given(
    data=st.data(),
    dtype=st.sampled_from(list(DTYPES.values())),
    codec=st.sampled_from(list(Codec)),
    kind=st.sampled_from(list(Kind)),
    job=JOB_IDS,
    step=st.integers(0, 2**64 - 1),
    microbatch=st.integers(0, 2**32 - 1),
)
def test_every_dtype_and_codec_round_trips(
    data: st.DataObject,
    dtype: torch.dtype,
    codec: Codec,
    kind: Kind,
    job: str,
    step: int,
    microbatch: int,
) -> None:
    lossy = is_lossy(dtype, codec)
    t = data.draw(tensors(dtype, finite=lossy))
    frame = encode_frame(kind, job, step, microbatch, t, codec)
    got = decode_frame(frame)

    assert (got.kind, got.job, got.step, got.microbatch) == (kind, job, step, microbatch)
    assert got.samples == ((0, t.shape[0]) if t.ndim else (0, 0))
    assert got.key == (int(kind), step, microbatch, 0)
    assert got.nbytes == len(frame)
    assert got.codec is (codec if dtype.is_floating_point else Codec.RAW)
    assert got.tensor.dtype == received_dtype(dtype, codec)
    assert got.tensor.shape == t.shape
    if t.numel():
        assert got.tensor.data_ptr() % 16 == 0
    stored_scale: float = HEADER.unpack_from(frame)[FIELDS.index("scale")]
    if got.codec is not Codec.INT8:
        assert stored_scale == 0.0

    if not lossy and got.codec is Codec.FP32 and dtype is not torch.float32:
        # fp16/bf16 widened to fp32 and back: the same values (a NaN may be quietened).
        torch.testing.assert_close(got.tensor, t, rtol=0, atol=0, equal_nan=True)
    elif not lossy:
        assert torch.equal(bits(got.tensor), bits(t))
    elif codec is Codec.FP32:  # float64 narrowed to float32
        torch.testing.assert_close(got.tensor, t, rtol=2.0**-23, atol=1e-40)
    elif codec is Codec.INT8:
        peak = float(t.abs().max()) if t.numel() else 0.0
        if peak:  # the smallest float32 step that reaches the peak
            below = float(np.nextafter(np.float32(stored_scale), np.float32(0)))
            assert below * 127 < peak <= stored_scale * 127
        else:
            assert stored_scale == 1.0
        if t.numel():
            # Within half a step, plus the rounding of the result to the tensor's dtype.
            eps = max(torch.finfo(got.tensor.dtype).eps, torch.finfo(torch.float32).eps)
            error = float((got.tensor.double() - t.double()).abs().max())
            assert error <= stored_scale / 2 + 2 * eps * peak
    else:
        rtol, atol = TOLERANCE[codec]
        torch.testing.assert_close(got.tensor.double(), t.double(), rtol=rtol, atol=atol)


@given(dtype=st.sampled_from([d for d in DTYPES.values() if d.is_floating_point]), shape=SHAPES)
def test_int8_keeps_an_all_zero_tensor_zero(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    frame = encode_frame(Kind.GRADIENT, "j", 0, 0, torch.zeros(shape, dtype=dtype), Codec.INT8)
    got = decode_frame(frame)
    assert header(frame)["scale"] == 1.0
    assert got.codec is Codec.INT8 and got.tensor.dtype == received_dtype(dtype, Codec.INT8)
    assert torch.equal(got.tensor, torch.zeros(shape, dtype=got.tensor.dtype))


def test_int8_stores_its_scale() -> None:
    t = torch.tensor([[-2.54, 0.0], [1.0, 0.01]])
    frame = encode_frame(Kind.ACTIVATION, "j", 0, 0, t, Codec.INT8)
    peak = float(np.float32(2.54))
    scale = np.float32(peak / 127)  # a float32 just short of the step: the next one up
    assert float(scale) * 127 < peak
    assert header(frame)["scale"] == float(np.nextafter(scale, np.float32(1)))
    assert header(frame)["length"] == 4  # one byte per element
    got = decode_frame(frame).tensor
    assert float(got[0, 0]) == pytest.approx(-2.54, rel=1e-6)
    assert (got - t).abs().max() <= 0.01 + 1e-7


def test_gradients_scalars_and_parameters_encode() -> None:
    param = torch.nn.Parameter(torch.randn(3, 2))
    for t in (param, param * 2, torch.tensor(1.5), torch.tensor(7)):
        got = decode_frame(encode_frame(Kind.WEIGHTS, "j", 0, 0, t, Codec.FP32)).tensor
        assert torch.equal(got, t.detach()) and got.shape == t.shape and not got.requires_grad


# -- alignment and zero copy -----------------------------------------------------------


def address(buf: bytearray) -> int:
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


@settings(deadline=None)
@given(
    data=st.data(),
    dtype=st.sampled_from(list(DTYPES.values())),
    misalign=st.integers(0, 15),
)
def test_fp32_and_raw_decode_aligned_and_zero_copy(
    data: st.DataObject, dtype: torch.dtype, misalign: int
) -> None:
    """Aligned input: a view of the buffer. Unaligned: an aligned copy. Same bits either way."""
    t = data.draw(tensors(dtype, finite=False).filter(lambda t: t.numel() > 0))
    codec = Codec.FP32 if dtype is torch.float32 else Codec.RAW
    frame = encode_frame(Kind.ACTIVATION, "j", 1, 2, t, codec)
    buf = bytearray(len(frame) + 32)
    start = (-address(buf)) % 16 + misalign  # where the frame goes in buf
    buf[start : start + len(frame)] = frame
    base = address(buf) + start
    got = decode_frame(memoryview(buf)[start : start + len(frame)]).tensor

    assert got.data_ptr() % 16 == 0
    assert torch.equal(bits(got), bits(t))
    inside = base <= got.data_ptr() < base + len(frame)
    assert inside == (misalign == 0)
    if misalign == 0:
        assert got.data_ptr() == base + len(frame) - t.nbytes  # the payload itself
        first = got.data_ptr() - address(buf)
        buf[first] ^= 0xFF  # the tensor shares the buffer's memory
        assert not torch.equal(bits(got), bits(t))


def test_decoding_bytes_is_aligned() -> None:
    """What paho hands over: ``bytes``."""
    for shape in [(1,), (3, 5), (2, 3, 4, 5, 1, 1, 1, 2)]:
        t = torch.randn(shape)
        got = decode_frame(encode_frame(Kind.ACTIVATION, "j", 0, 0, t, Codec.FP32)).tensor
        assert got.data_ptr() % 16 == 0 and torch.equal(got, t)


# -- refusals ----------------------------------------------------------------------------


def reason(data: bytes | bytearray) -> str:
    with pytest.raises(FrameError) as caught:
        decode_frame(data)
    assert str(caught.value).startswith(caught.value.reason + ": ")
    return caught.value.reason


def with_shape(frame: bytes, *dims: int) -> bytes:
    """``frame`` (two dimensions) with its shape overwritten."""
    out = bytearray(frame)
    out[HEADER.size : HEADER.size + 16] = b"".join(d.to_bytes(8, "little") for d in dims)
    return bytes(out)


GOOD = good_frame()
GOOD_LENGTH = 32 * 4
GARBAGE = {
    "bad-magic": [b"XXXX" + GOOD[4:], patched(GOOD, magic=b"ETF2")],
    "bad-version": [patched(GOOD, version=1), patched(GOOD, version=3)],
    "bad-field": [
        patched(GOOD, kind=0),
        patched(GOOD, kind=7),
        patched(GOOD, kind=255),
        patched(GOOD, codec=5),
        patched(GOOD, codec=255),
        patched(GOOD, dtype=8),
        patched(GOOD, dtype=255),
        patched(good_frame(Codec.INT8), dtype=3),  # int8-coded int64: integers travel raw
    ],
    "bad-shape": [
        patched(GOOD, ndim=MAX_NDIM + 1),
        patched(GOOD, ndim=255),
        with_shape(GOOD, 9, 8),
        with_shape(GOOD, 4, 0),
        with_shape(GOOD, 1, 1),
    ],
    "bad-rows": [patched(GOOD, lo=1), patched(GOOD, hi=9), patched(GOOD, lo=3, hi=2)],
    "bad-job": [
        patched(GOOD, job=b""),
        patched(GOOD, job=b"a b"),
        patched(GOOD, job=b"\xff"),
        patched(GOOD, job=b"ab\0cd"),
        patched(GOOD, job=b"abc\n"),
        patched(GOOD, job=b"a/b"),
    ],
    "truncated": [
        b"",
        b"\x00" * 3,
        GOOD[:4],
        GOOD[: HEADER.size - 1],
        GOOD[: HEADER.size],
        GOOD[: HEADER.size + 12],
        GOOD[: HEADER.size + 15],  # inside the shape
    ],
    "bad-length": [
        patched(GOOD, length=GOOD_LENGTH + 1),
        patched(GOOD, length=GOOD_LENGTH - 1),
        patched(GOOD, length=1 << 20),
        GOOD + b"\0",
        GOOD[:-1],
        GOOD[: len(GOOD) - GOOD_LENGTH],
    ],
    "too-large": [
        with_shape(GOOD, 1 << 40, 8),
        with_shape(GOOD, 2**64 - 1, 2**64 - 1),
        with_shape(GOOD, MAX_ELEMENTS + 1, 1),
        with_shape(GOOD, 1 << 16, 1 << 16),
        with_shape(GOOD, 0, 2**64 - 1),
        with_shape(GOOD, 0, MAX_ELEMENTS + 1),
    ],
    "bad-checksum": [
        patched(GOOD, checksum=header(GOOD)["checksum"] ^ 1),  # type: ignore[operator]
        GOOD[:-1] + bytes([GOOD[-1] ^ 0x80]),
    ],
}


@pytest.mark.parametrize(
    ("expected", "data"), [(r, d) for r, frames in GARBAGE.items() for d in frames]
)
def test_garbage_is_refused_with_its_reason(expected: str, data: bytes) -> None:
    assert reason(data) == expected
    assert reason(bytearray(data)) == expected


def test_too_large_is_refused_before_allocating(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_args: object, **_kwargs: object) -> torch.Tensor:
        raise AssertionError("decode_frame allocated a tensor for a refused frame")

    for name in ("empty", "frombuffer", "zeros"):
        monkeypatch.setattr(torch, name, boom)
    for data in GARBAGE["too-large"]:
        assert reason(data) == "too-large"
    # MAX_ELEMENTS itself passes that check; this frame then lacks the bytes it declares.
    at_limit = patched(with_shape(GOOD, MAX_ELEMENTS, 1), length=4 * MAX_ELEMENTS)
    assert reason(at_limit) == "bad-length"


def test_a_frame_over_the_maximum_is_refused_before_its_header_is_read() -> None:
    assert MAX_FRAME_BYTES == 1 << 31
    for data in (GOOD, b"\xff" * (len(GOOD) + 1)):
        with pytest.raises(FrameError, match=rf"^too-large: {len(data)} bytes exceed") as caught:
            decode_frame(data, max_bytes=len(GOOD) - 1)
        assert caught.value.reason == "too-large"
    assert decode_frame(GOOD, max_bytes=len(GOOD)).nbytes == len(GOOD)


def test_the_header_is_checked_without_the_payload() -> None:
    corrupt = GOOD[:-1] + bytes([GOOD[-1] ^ 1])
    head = read_header(corrupt)
    assert (head.kind, head.job, head.step, head.microbatch) == (Kind.ACTIVATION, "job-7", 3, 1)
    assert (head.shape, head.dtype, head.codec) == ((4, 8), torch.float32, Codec.FP32)
    assert head.offset == prefix_size(2) == len(GOOD) - GOOD_LENGTH and head.nbytes == len(GOOD)
    with pytest.raises(FrameError, match=r"^bad-checksum"):  # decode_body's to check
        decode_body(head, corrupt)
    assert torch.equal(
        decode_body(read_header(GOOD), GOOD).tensor, torch.linspace(-1, 1, 32).view(4, 8)
    )


@pytest.mark.parametrize("codec", list(Codec), ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=str)
def test_a_decoded_tensor_is_at_most_four_times_its_payload(
    dtype: torch.dtype, codec: Codec
) -> None:
    """int8 never decodes to float64 (8x): a header's shape bounds what decoding allocates."""
    t = torch.ones(64, dtype=dtype)
    frame = encode_frame(Kind.ACTIVATION, "j", 0, 0, t, codec)
    head = read_header(frame)
    got = decode_frame(frame).tensor
    assert got.dtype == head.dtype == decoded_dtype(head.codec, dtype)
    payload = len(frame) - head.offset
    assert got.nbytes <= 4 * payload
    if head.codec is Codec.INT8:
        assert got.dtype in (torch.float32, torch.float16, torch.bfloat16)
        assert got.dtype == (torch.float32 if dtype is torch.float64 else dtype)


@given(bit=st.integers(0, GOOD_LENGTH * 8 - 1))
def test_one_flipped_payload_bit_fails_the_checksum(bit: int) -> None:
    frame = bytearray(GOOD)
    frame[len(GOOD) - GOOD_LENGTH + bit // 8] ^= 1 << (bit % 8)
    assert reason(frame) == "bad-checksum"


# -- fuzzing ----------------------------------------------------------------------------


@given(st.binary(max_size=300))
def test_random_bytes_never_raise_anything_else(data: bytes) -> None:
    decodes_or_refuses(data)


@given(st.binary(max_size=300))
def test_random_bytes_after_a_valid_magic_never_raise_anything_else(rest: bytes) -> None:
    decodes_or_refuses(b"ETF1\x01" + rest)


@settings(deadline=None, max_examples=300)
@given(
    data=st.data(),
    dtype=st.sampled_from(list(DTYPES.values())),
    codec=st.sampled_from(list(Codec)),
)
def test_mutated_frames_never_raise_anything_else(
    data: st.DataObject, dtype: torch.dtype, codec: Codec
) -> None:
    t = data.draw(tensors(dtype, finite=True))
    frame = bytearray(encode_frame(Kind.GRADIENT, "job", 5, 6, t, codec))
    position = data.draw(st.integers(0, len(frame) - 1))
    frame[position] = data.draw(st.integers(0, 255))
    decodes_or_refuses(bytes(frame))
    decodes_or_refuses(bytes(frame[: data.draw(st.integers(0, len(frame)))]))


@pytest.mark.parametrize(
    "tensor",
    [torch.randn(2, 3), torch.zeros(0, 5), torch.arange(6).view(3, 2), torch.tensor(0.5)],
    ids=["float", "empty", "int64", "scalar"],
)
@pytest.mark.parametrize("codec", list(Codec), ids=lambda c: c.name)
def test_every_single_byte_mutation_of_the_header(tensor: torch.Tensor, codec: Codec) -> None:
    """Exhaustive over the header and shape: each byte set to a few telling values."""
    frame = encode_frame(Kind.LABELS, "job", 1, 2, tensor, codec)
    prefix = len(frame) - header(frame)["length"]  # type: ignore[operator]
    for position in range(prefix):
        for value in {0, 1, 2, 8, 9, 0x7F, 0x80, 0xFF, frame[position] ^ 1}:
            mutated = bytearray(frame)
            mutated[position] = value
            decodes_or_refuses(mutated)


# -- encode_frame refusals ----------------------------------------------------------------


@pytest.mark.parametrize(
    "job", ["", "a" * 17, "a b", "a/b", "job.1", "é", "abc\n", "a" * 16 + "\n"]
)
def test_encode_refuses_bad_job_ids(job: str) -> None:
    with pytest.raises(ValueError, match="job id"):
        encode_frame(Kind.ACTIVATION, job, 0, 0, torch.ones(2), Codec.FP32)


def test_encode_refuses_too_many_dimensions() -> None:
    encode_frame(Kind.ACTIVATION, "j", 0, 0, torch.ones((1,) * MAX_NDIM), Codec.FP32)
    with pytest.raises(ValueError, match="dimensions"):
        encode_frame(Kind.ACTIVATION, "j", 0, 0, torch.ones((1,) * (MAX_NDIM + 1)), Codec.FP32)


@pytest.mark.parametrize("dtype", [torch.bool, torch.int16, torch.complex64, torch.uint16])
def test_encode_refuses_unsupported_dtypes(dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match="cannot be sent"):
        encode_frame(Kind.ACTIVATION, "j", 0, 0, torch.zeros(2, dtype=dtype), Codec.FP32)


# -- topics, job ids, codec names ------------------------------------------------------------


@given(
    job=JOB_IDS,
    stage=st.integers(0, 10**9),
    channel=st.sampled_from(["fwd", "bwd", "reduce", "gather"]),
    member=st.integers(0, 99),
    sender=st.integers(0, 99),
)
def test_stage_topics_round_trip(
    job: str, stage: int, channel: str, member: int, sender: int
) -> None:
    by = sender if channel in ("reduce", "gather") else None
    member = 0 if channel == "gather" else member  # a gather topic names no receiver
    topic = stage_topic(job, stage, channel, member, by)
    assert topic.startswith(f"{TOPIC_ROOT}/jobs/{job}/stage/{stage}/")
    assert ("/member/" in topic) == (member > 0)
    assert topic.endswith(f"/{channel}/{sender}" if by is not None else f"/{channel}")
    receiver = None if channel == "gather" else member
    assert parse_stage_topic(topic) == (job, stage, channel, receiver, by)


def test_a_reduce_or_gather_topic_names_its_sender_and_only_it() -> None:
    with pytest.raises(ValueError, match="a reduce topic needs sender"):
        stage_topic("j", 1, "reduce", 0)
    with pytest.raises(ValueError, match="a gather topic needs sender"):
        stage_topic("j", 1, "gather", 0)
    with pytest.raises(ValueError, match="a fwd topic has no sender"):
        stage_topic("j", 1, "fwd", 0, 1)
    with pytest.raises(ValueError, match="a gather topic names no receiving member"):
        stage_topic("j", 1, "gather", 1, 0)
    assert stage_topic("j", 1, "gather", sender=2) == f"{TOPIC_ROOT}/jobs/j/stage/1/gather/2"
    assert parse_stage_topic(f"{TOPIC_ROOT}/jobs/j/stage/1/member/1/gather/2") is None


@given(
    job=JOB_IDS,
    stage=st.integers(0, 999),
    channel=st.sampled_from(["fwd", "bwd", "reduce", "gather"]),
    member=st.integers(0, 3),
    where=st.integers(0, 70),
    edit=st.sampled_from(["insert", "delete", "replace"]),
    char=st.characters(),
)
def test_only_canonical_stage_topics_parse(
    job: str, stage: int, channel: str, member: int, where: int, edit: str, char: str
) -> None:
    """A topic one edit away from a stage topic parses only if it is one, spelled the same."""
    gather = channel == "gather"
    by = 1 if channel in ("reduce", "gather") else None
    topic = stage_topic(job, stage, channel, 0 if gather else member, by)
    i = where % (len(topic) + 1)
    cut = 0 if edit == "insert" else 1
    mutated = topic[:i] + ("" if edit == "delete" else char) + topic[i + cut :]
    parsed = parse_stage_topic(mutated)
    if parsed is not None:
        j, s, c, m, sender = parsed
        assert (m is None) == (c == "gather")
        assert stage_topic(j, s, c, m or 0, sender) == mutated


@pytest.mark.parametrize(
    "topic",
    [
        device_status("d1"),
        device_profile("d1"),
        device_cmd("d1"),
        device_heartbeat("d1"),
        job_events("j", "d1"),
        job_weights("j", 1),
        "",
        "edgetrain/v1/jobs/j/stage/1",
        f"{TOPIC_ROOT}/jobs/j/stage/1/side",
        f"{TOPIC_ROOT}/jobs/j/stage/-1/fwd",
        f"{TOPIC_ROOT}/jobs/j/stage/01/fwd",
        f"{TOPIC_ROOT}/jobs/j/stage/x/fwd",
        f"{TOPIC_ROOT}/jobs/j/stage/1/fwd/",
        f"{TOPIC_ROOT}/jobs/j/stage/1/reduce",
        f"{TOPIC_ROOT}/jobs/j/stage/1/reduce/",
        f"{TOPIC_ROOT}/jobs/j/stage/1/reduce/01",
        f"{TOPIC_ROOT}/jobs/j/stage/1/reduce/+",
        f"{TOPIC_ROOT}/jobs/j/stage/1/fwd/0",
        f"{TOPIC_ROOT}/jobs/j/stage/1/member/0/fwd",
        f"{TOPIC_ROOT}/jobs/j/stage/1/member/01/fwd",
        f"{TOPIC_ROOT}/jobs/j/stage/1/member//bwd",
        f"{TOPIC_ROOT}/jobs/j/stage/1/fwd\n",
        f"{TOPIC_ROOT}/jobs/j/stage/\u0663/fwd",
        f"/{TOPIC_ROOT}/jobs/j/stage/1/fwd",
        "edgetrain/v2/jobs/j/stage/1/fwd",
        f"{TOPIC_ROOT}/jobs/+/stage/1/fwd",
        f"{TOPIC_ROOT}/jobs/{'a' * 17}/stage/1/fwd",
        f"{TOPIC_ROOT}/jobs/a.b/stage/1/fwd",
        f"{TOPIC_ROOT}/jobs//stage/1/fwd",
        f"{TOPIC_ROOT}/jobs/a b/stage/1/bwd",
        f"{TOPIC_ROOT}/jobs/j\n/stage/1/bwd",
    ],
)
def test_other_topics_do_not_parse(topic: str) -> None:
    assert parse_stage_topic(topic) is None


@given(st.one_of(JOB_IDS, st.text(max_size=20), st.text(JOB_CHARS + "\n\0 ./", max_size=20)))
def test_valid_job_id(job: str) -> None:
    assert valid_job_id(job) == (1 <= len(job) <= 16 and all(c in JOB_CHARS for c in job))


@pytest.mark.parametrize("job", ["abc\n", "a" * 16 + "\n", "\n", "a\0", "a" * 17, ""])
def test_valid_job_id_refuses(job: str) -> None:
    assert not valid_job_id(job)


@given(codec=st.sampled_from(list(Codec)), upper=st.lists(st.booleans(), min_size=4, max_size=4))
def test_codec_names_parse_in_any_case(codec: Codec, upper: list[bool]) -> None:
    name = "".join(c.upper() if up else c.lower() for c, up in zip(codec.name, upper, strict=False))
    assert Codec.parse(name) is codec


@given(st.text(max_size=8).filter(lambda s: s.upper() not in Codec.__members__))
def test_unknown_codec_names_are_refused_with_the_known_ones(name: str) -> None:
    with pytest.raises(ValueError, match="known: fp32, fp16, bf16, int8") as caught:
        Codec.parse(name)
    assert repr(name) in str(caught.value)


def test_a_stage_may_use_exactly_its_own_topics() -> None:
    """What a broker ACL grants the holder of a stage (edge.wire.topics.stage_access)."""
    first = stage_access("j", 0, 3, "pi-a", replicate=True)
    middle = stage_access("j", 1, 3, "pi-b")
    last = stage_access("j", 2, 3, "pi-c", replicate=True)
    root = f"{TOPIC_ROOT}/jobs/j"
    assert set(first.publish) == {
        f"{root}/events/pi-a",
        f"{root}/weights/0",
        f"{root}/stage/1/fwd",
        f"{root}/stage/2/fwd",  # the labels, straight to the last stage
        f"{root}/replica/0",
    }
    assert set(first.read) == {
        f"{root}/stage/0/fwd",
        f"{root}/stage/0/bwd",
        f"{root}/restore/0",
        f"{root}/replica/2",  # stage 0 keeps the last stage's state
    }
    assert set(middle.publish) == {
        f"{root}/events/pi-b",
        f"{root}/weights/1",
        f"{root}/stage/2/fwd",
        f"{root}/stage/0/bwd",
    }
    assert set(middle.read) == {f"{root}/stage/1/fwd", f"{root}/stage/1/bwd", f"{root}/restore/1"}
    assert f"{root}/stage/1/bwd" in last.publish and f"{root}/replica/1" in last.read
    assert not any("devices" in t for t in first.publish + middle.publish + last.publish)
    alone = stage_access("j", 0, 1, "pi-a", replicate=True)
    assert set(alone.read) == {f"{root}/stage/0/fwd", f"{root}/stage/0/bwd", f"{root}/restore/0"}


@pytest.mark.parametrize("device", ["pi-1", "a", "Jetson_Nano.2", "x" * 64])
def test_device_ids_that_are_topic_safe(device: str) -> None:
    assert valid_device_id(device)
    assert parse_events_topic(job_events("j", device)) == ("j", device)


@pytest.mark.parametrize("device", ["", "+", "#", "a/b", "-a", ".a", "x" * 65, "a b", "a\n"])
def test_device_ids_that_could_be_wildcards_or_levels_are_refused(device: str) -> None:
    assert not valid_device_id(device)
