"""The wire contract's binary tensor frame: what carries activations, gradients and weights.

Control messages (JSON, validated by pydantic) are in :mod:`edge.wire.messages`
and topic names in :mod:`edge.wire.topics`; tensors travel as frames defined
here. Nothing on the wire is ever unpickled: a frame is a fixed little-endian
header followed by raw bytes, and decoding checks every field before a tensor
is made.

Frame layout (``<`` little-endian, :data:`HEADER` then ``ndim`` dimensions)::

    magic      4s  b"ETF1"
    version    B   2
    kind       B   Kind (activation, gradient, labels, weights)
    codec      B   Codec (fp32, fp16, bf16, int8, raw)
    dtype      B   the tensor's dtype once decoded (DTYPES)
    ndim       B   at most MAX_NDIM
    reserved   3x
    job        16s job id, ASCII, NUL-padded
    step       Q
    microbatch I   (REDUCE and GATHER frames: the sending member)
    lo, hi     II  the rows [lo, hi) of the microbatch the tensor holds, its first
                   dimension hi - lo ([Note: groups on the wire] in edge.wire.groups);
                   a whole tensor holds [0, rows), a scalar [0, 0)
    scale      f   int8 codec: the per-tensor scale; 0 otherwise
    length     Q   payload bytes
    checksum   I   CRC-32C (Castagnoli) of the payload: hardware-accelerated on x86
                   (SSE 4.2) and ARMv8, several times cheaper than zlib's CRC-32
    shape      ndim x Q
    padding    zero bytes up to a multiple of 16, so the payload is 16-byte aligned

[Note: zero-copy decoding]
For the ``fp32`` and ``raw`` codecs the decoded tensor is a view of the received
buffer (``torch.frombuffer``), not a copy; it keeps the buffer alive and is
read-only in spirit: code that receives one must not modify it in place.
Other codecs must convert, which makes the one copy they need. The payload is
16-byte aligned within the frame, and a view whose address is not 16-byte
aligned is copied: CPU matmul kernels take a different path on unaligned
inputs and round differently, which would break bit-exact pipeline parity.

[Note: what each codec promises]
``raw`` carries the tensor's bytes bit for bit: integers always travel raw.
``fp32``, ``fp16`` and ``bf16`` round each value to the nearest (ties to even)
value of their type, as a cast does, and the receiver widens it back to the
tensor's dtype; a tensor already of that type travels bit for bit. In the type's
normal range the relative error is at most 2^-24, 2^-11 and 2^-8; among its
subnormals the error is at most half the smallest one. A value beyond the
type's largest finite one becomes +-inf, as a cast makes it (fp16's is 65504, so
large gradients must not travel fp16). NaN and +-inf travel as themselves.
``int8`` sends ``q = round(t / scale)``, where ``scale`` is the float32 at or just
above ``max |t| / 127``. So every value comes back within ``scale / 2``, plus the
rounding of ``q * scale`` to the tensor's dtype, at every magnitude float32
holds, subnormal peaks included. It carries finite values that float32 can hold:
a tensor with inf or NaN, or a float64 beyond float32's range, is refused by
:func:`encode_frame` (``ValueError``) rather than sent as zeros or garbage.

[Note: bounded decoding]
A receiver must know what a frame will cost before it pays for it. So decoding
is two calls: :func:`read_header` checks every header field against the bytes
that arrived (and against a maximum frame size) without touching the payload,
and :func:`decode_body` then verifies the checksum and makes the tensor. In
between, the receiver can refuse the frame by its header alone (a step it does
not expect, a shape its plan does not imply; see :class:`edge.transport.inbox.Inbox`).
A decoded tensor is at most 4x its payload: an ``int8`` frame decodes to
``float32`` (or to the narrower dtype its header names), never ``float64``
(:func:`decoded_dtype`).

Tested in tests/unit/edge/wire/test_protocol.py (round trips, refusals, fuzzing) and
tests/unit/edge/wire/test_codec_range.py (each codec over its whole range).
"""

from __future__ import annotations

import math
import struct
import warnings
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch
from crc32c import crc32c

from edge.wire.topics import valid_job_id

__all__ = [
    "DTYPES",
    "HEADER",
    "MAX_ELEMENTS",
    "MAX_FRAME_BYTES",
    "MAX_NDIM",
    "Codec",
    "Frame",
    "FrameError",
    "FrameHeader",
    "Kind",
    "decode_body",
    "decode_frame",
    "decoded_dtype",
    "encode_frame",
    "prefix_size",
    "read_header",
]

MAGIC = b"ETF1"
VERSION = 2
HEADER = struct.Struct("<4sBBBBB3x16sQIIIfQI")
MAX_NDIM = 8
MAX_ELEMENTS = 1 << 31
"""A frame declaring more elements than this is refused before anything is allocated."""
MAX_FRAME_BYTES = 1 << 31
"""The largest frame :func:`read_header` accepts unless told a smaller maximum (2 GiB)."""


class Kind(IntEnum):
    ACTIVATION = 1
    GRADIENT = 2
    LABELS = 3
    WEIGHTS = 4
    REDUCE = 5
    """A group member's part of the gradient chunk another member owns (reduce-scatter)."""
    GATHER = 6
    """An owner's summed gradient chunk, for the group's other members (all-gather)."""


class Codec(IntEnum):
    FP32 = 0
    FP16 = 1
    BF16 = 2
    INT8 = 3
    RAW = 4
    """Integer tensors (labels, token ids) always travel raw."""

    @classmethod
    def parse(cls, name: str) -> Codec:
        try:
            return cls[name.upper()]
        except KeyError:
            known = ", ".join(c.name.lower() for c in cls if c is not cls.RAW)
            raise ValueError(f"unknown codec {name!r} (known: {known})") from None


DTYPES: dict[int, torch.dtype] = {
    0: torch.float32,
    1: torch.float16,
    2: torch.bfloat16,
    3: torch.int64,
    4: torch.int32,
    5: torch.uint8,
    6: torch.int8,
    7: torch.float64,
}
_DTYPE_CODES = {dt: code for code, dt in DTYPES.items()}
_WIRE_DTYPE = {
    Codec.FP32: torch.float32,
    Codec.FP16: torch.float16,
    Codec.BF16: torch.bfloat16,
    Codec.INT8: torch.int8,
}


_ALIGN = 16
_F32_MAX = float(torch.finfo(torch.float32).max)


def _padding(ndim: int) -> int:
    """Zero bytes after the shape so the payload starts 16-byte aligned."""
    return -(HEADER.size + 8 * ndim) % _ALIGN


def prefix_size(ndim: int) -> int:
    """Bytes before the payload of a frame of ``ndim`` dimensions: header, shape, padding."""
    return HEADER.size + 8 * ndim + _padding(ndim)


def decoded_dtype(codec: Codec, dtype: torch.dtype) -> torch.dtype:
    """The dtype a frame of ``codec`` whose header names ``dtype`` decodes to.

    The header's dtype, except that ``int8`` never widens past ``float32``: its
    values carry 8 bits and a ``float32`` scale, and a ``float64`` tensor would
    make a frame 8x its payload (see [Note: bounded decoding]).
    """
    if codec is Codec.INT8 and dtype.itemsize > 4:
        return torch.float32
    return dtype


# Per ndim: the shape and its zero padding, alone and after the header (one pack per frame).
_SHAPES = [struct.Struct(f"<{n}Q{_padding(n)}x") for n in range(MAX_NDIM + 1)]
_PREFIXES = [struct.Struct(HEADER.format + f"{n}Q{_padding(n)}x") for n in range(MAX_NDIM + 1)]
_KINDS = {int(k): k for k in Kind}
_CODECS = {int(c): c for c in Codec}

# Decoding a received ``bytes`` frame makes a tensor over a read-only buffer, on purpose
# (see [Note: zero-copy decoding]). torch warns about that once per process: have it
# here, silenced, and filter it, rather than ``catch_warnings`` on every frame (slower,
# and not thread-safe: it can leave another thread's filters behind).
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    torch.frombuffer(b"\0", dtype=torch.uint8)
warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)


class FrameError(ValueError):
    """A frame that must be dropped; ``reason`` is a short counter key."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class FrameHeader:
    """A frame's header, checked against the bytes that carry it (:func:`read_header`)."""

    kind: Kind
    job: str
    step: int
    microbatch: int
    samples: tuple[int, int]
    """The rows ``[lo, hi)`` of the microbatch the frame holds."""
    codec: Codec
    dtype: torch.dtype
    """The tensor's dtype once decoded (:func:`decoded_dtype`)."""
    shape: tuple[int, ...]
    scale: float
    checksum: int
    offset: int
    """Where the payload starts."""
    nbytes: int
    """Size of the whole frame on the wire."""

    @property
    def key(self) -> tuple[int, int, int, int]:
        """``(kind, step, microbatch, lo)``: what an inbox files the frame under."""
        return (int(self.kind), self.step, self.microbatch, self.samples[0])


@dataclass(frozen=True)
class Frame:
    kind: Kind
    job: str
    step: int
    microbatch: int
    samples: tuple[int, int]
    """The rows ``[lo, hi)`` of the microbatch the tensor holds."""
    codec: Codec
    tensor: torch.Tensor
    nbytes: int
    """Size of the whole frame on the wire."""

    @property
    def key(self) -> tuple[int, int, int, int]:
        """``(kind, step, microbatch, lo)``: what an inbox files the frame under."""
        return (int(self.kind), self.step, self.microbatch, self.samples[0])


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A device tensor on the host, for a frame. From a GPU through pinned memory (torch's
    caching host allocator keeps the buffers): the copy then runs at the bus's speed,
    where pageable memory goes through a staging buffer of the driver first; it is
    waited for here, where the frame leaves the device, and nowhere before."""
    if t.device.type != "cuda":
        return t.cpu()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return host


def encode_frame(
    kind: Kind,
    job: str,
    step: int,
    microbatch: int,
    tensor: torch.Tensor,
    codec: Codec,
    *,
    first: int = 0,
) -> bytes:
    """One frame: header, shape, payload. Integer tensors are always sent raw.

    The tensor holds rows ``[first, first + rows)`` of its microbatch (a piece of
    a group's block, [Note: groups on the wire]); a whole tensor starts at 0.
    The payload is checksummed once and copied once, straight into the frame.
    """
    if not valid_job_id(job):
        raise ValueError(f"job id {job!r} must be 1-16 characters of [A-Za-z0-9_-]")
    dtype_code = _DTYPE_CODES.get(tensor.dtype)
    if dtype_code is None:
        raise ValueError(f"dtype {tensor.dtype} cannot be sent")
    if tensor.ndim > MAX_NDIM:
        raise ValueError(f"tensor has {tensor.ndim} dimensions; at most {MAX_NDIM} can be sent")
    codec = Codec(codec)
    # Attributes are cheap; each torch call that does work is a dispatch and a GIL release.
    t = tensor.detach() if tensor.requires_grad else tensor
    if not t.is_cpu:
        t = _to_host(t)
    scale = 0.0
    if not t.dtype.is_floating_point:
        codec = Codec.RAW
    elif codec is Codec.INT8:
        t, scale = _quantize(t)
    elif codec is not Codec.RAW and t.dtype is not _WIRE_DTYPE[codec]:
        t = t.to(_WIRE_DTYPE[codec])
    payload = _bytes_of(t)
    rows = t.shape[0] if t.ndim else 0
    if first < 0 or (not t.ndim and first):
        raise ValueError(f"rows cannot start at {first} for a tensor of shape {list(t.shape)}")
    prefix = _PREFIXES[t.ndim].pack(
        MAGIC,
        VERSION,
        int(kind),
        int(codec),
        dtype_code,
        t.ndim,
        job.encode(),
        step,
        microbatch,
        first,
        first + rows,
        scale,
        payload.nbytes,
        crc32c(payload),
        *t.shape,
    )
    return b"".join((prefix, payload))


def _quantize(t: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The int8 codec: ``round(t / scale)`` ([Note: what each codec promises]).

    ``scale`` is the float32 the header stores, at or above ``max |t| / 127`` (1 for
    an all-zero tensor), so no value is clipped. Rounding it down, or to zero
    for a subnormal peak, would clip the largest values or zero them all.
    """
    peak = float(t.abs().amax()) if t.numel() else 0.0
    if not peak <= _F32_MAX:  # NaN fails this too
        raise ValueError(
            f"the int8 codec carries finite values float32 can hold; this tensor's peak is {peak}"
        )
    if peak == 0:
        return t.to(torch.int8), 1.0
    scale = np.float32(peak / 127.0)
    if float(scale) * 127.0 < peak:
        scale = np.nextafter(scale, np.float32(np.inf))
    # A float64 tensor is divided as it is: rounding it to float32 first would add that
    # rounding to the codec's error where float32 is coarse (its subnormals).
    wide = t if t.dtype == torch.float64 else t.float()
    return torch.div(wide, float(scale)).round_().clamp_(-127, 127).to(torch.int8), float(scale)


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy when it is contiguous."""
    if not t.numel():
        return memoryview(b"")  # a view with a 0 in its shape cannot be cast
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype is torch.bfloat16:
        t = t.view(torch.int16)  # numpy has no bfloat16; the bytes are the same
    return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]


def decode_frame(data: bytes | bytearray | memoryview, max_bytes: int = MAX_FRAME_BYTES) -> Frame:
    """Check and decode one frame; anything wrong raises :class:`FrameError`.

    Every field is checked before anything is allocated; the checksum is computed
    once. :func:`read_header` then :func:`decode_body`, for a caller with nothing
    to check in between.
    """
    view = memoryview(data)
    return decode_body(read_header(view, max_bytes), view)


def read_header(
    data: bytes | bytearray | memoryview, max_bytes: int = MAX_FRAME_BYTES
) -> FrameHeader:
    """Check a frame's header against its bytes, without reading the payload.

    Raises :class:`FrameError` for a frame over ``max_bytes``, a bad magic,
    version or field, a shape that is too large or does not match the payload's
    length, or a frame that ends early. The checksum is :func:`decode_body`'s.
    """
    view = memoryview(data)
    if len(view) > max_bytes:
        raise FrameError("too-large", f"{len(view)} bytes exceed the maximum of {max_bytes}")
    if len(view) < HEADER.size:
        raise FrameError("truncated", f"{len(view)} bytes is shorter than the header")
    (magic, version, kind, codec, dtype, ndim, job_raw, step, mb, lo, hi, scale, length, crc) = (
        HEADER.unpack_from(view)
    )
    if magic != MAGIC:
        raise FrameError("bad-magic", f"magic {magic!r}")
    if version != VERSION:
        raise FrameError("bad-version", f"version {version}")
    kind_v, codec_v, dtype_v = _KINDS.get(kind), _CODECS.get(codec), DTYPES.get(dtype)
    if kind_v is None or codec_v is None or dtype_v is None:
        raise FrameError("bad-field", f"kind {kind}, codec {codec} or dtype {dtype}")
    if codec_v is not Codec.RAW and not dtype_v.is_floating_point:
        raise FrameError("bad-field", f"codec {codec_v.name} for {dtype_v}: integers travel raw")
    if ndim > MAX_NDIM:
        raise FrameError("bad-shape", f"{ndim} dimensions")
    job = job_raw.rstrip(b"\0").decode("ascii", errors="replace")
    if not valid_job_id(job):
        raise FrameError("bad-job", f"job {job!r}")
    start = HEADER.size + _SHAPES[ndim].size
    if len(view) < start:
        raise FrameError("truncated", "frame ends inside the shape")
    shape = _SHAPES[ndim].unpack_from(view, HEADER.size)
    numel = math.prod(shape)
    # An empty tensor's other dimensions count too: torch cannot make (0, 2**40, 2**40).
    if numel > MAX_ELEMENTS or (numel == 0 and math.prod(d or 1 for d in shape) > MAX_ELEMENTS):
        raise FrameError("too-large", f"shape {shape} declares more than {MAX_ELEMENTS} elements")
    if len(view) - start != length:
        raise FrameError(
            "bad-length", f"declares {length} payload bytes, carries {len(view) - start}"
        )
    wire_dtype = dtype_v if codec_v is Codec.RAW else _WIRE_DTYPE[codec_v]
    if numel * wire_dtype.itemsize != length:
        need = numel * wire_dtype.itemsize
        raise FrameError("bad-shape", f"shape {shape} needs {need} bytes, payload has {length}")
    if hi < lo or hi - lo != (shape[0] if ndim else 0):
        raise FrameError("bad-rows", f"rows [{lo}, {hi}) for shape {list(shape)}")
    return FrameHeader(
        kind=kind_v,
        job=job,
        step=step,
        microbatch=mb,
        samples=(lo, hi),
        codec=codec_v,
        dtype=decoded_dtype(codec_v, dtype_v),
        shape=shape,
        scale=scale,
        checksum=crc,
        offset=start,
        nbytes=len(view),
    )


def decode_body(header: FrameHeader, data: bytes | bytearray | memoryview) -> Frame:
    """Verify the checksum of the frame ``header`` was read from and make its tensor.

    ``data`` must be the very bytes :func:`read_header` checked. A bad checksum
    raises :class:`FrameError`.
    """
    view = memoryview(data)
    start, shape, codec, dtype = header.offset, header.shape, header.codec, header.dtype
    if crc32c(view[start:]) != header.checksum:
        raise FrameError("bad-checksum", "payload checksum does not match")
    numel = math.prod(shape)
    wire_dtype = dtype if codec is Codec.RAW else _WIRE_DTYPE[codec]
    if numel == 0:
        tensor = torch.empty(shape, dtype=dtype)
    else:
        # A view of the frame; see [Note: zero-copy decoding].
        tensor = torch.frombuffer(view, dtype=wire_dtype, count=numel, offset=start)
        if len(shape) != 1:
            tensor = tensor.view(shape)
        if codec is Codec.INT8:
            tensor = tensor.to(dtype).mul_(header.scale)
        elif wire_dtype is not dtype:
            tensor = tensor.to(dtype)  # a new tensor, aligned like any other
        elif tensor.data_ptr() % _ALIGN:
            tensor = tensor.clone()
    return Frame(
        kind=header.kind,
        job=header.job,
        step=header.step,
        microbatch=header.microbatch,
        samples=header.samples,
        codec=codec,
        tensor=tensor,
        nbytes=header.nbytes,
    )
