"""The wire contract: MQTT topic names and the binary tensor frame.

Control messages (JSON, validated by pydantic) are in :mod:`edge.messages`;
tensors travel as frames defined here. Nothing on the wire is ever unpickled:
a frame is a fixed little-endian header followed by raw bytes, and decoding
checks every field before a tensor is made.

Frame layout (``<`` little-endian, :data:`HEADER` then ``ndim`` dimensions)::

    magic      4s  b"ETF1"
    version    B   1
    kind       B   Kind (activation, gradient, labels, weights)
    codec      B   Codec (fp32, fp16, bf16, int8, raw)
    dtype      B   the tensor's dtype once decoded (DTYPES)
    ndim       B   at most MAX_NDIM
    reserved   3x
    job        16s job id, ASCII, NUL-padded
    step       Q
    microbatch I
    scale      f   int8 codec: the per-tensor scale; 0 otherwise
    length     Q   payload bytes
    checksum   I   CRC-32 of the payload
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
"""

from __future__ import annotations

import re
import struct
import warnings
import zlib
from dataclasses import dataclass
from enum import IntEnum

import torch

__all__ = [
    "DTYPES",
    "HEADER",
    "MAX_ELEMENTS",
    "MAX_NDIM",
    "TOPIC_ROOT",
    "Codec",
    "Frame",
    "FrameError",
    "Kind",
    "decode_frame",
    "device_cmd",
    "device_heartbeat",
    "device_profile",
    "device_status",
    "encode_frame",
    "job_events",
    "job_weights",
    "parse_stage_topic",
    "stage_topic",
    "valid_job_id",
]

TOPIC_ROOT = "edgetrain/v1"
MAGIC = b"ETF1"
VERSION = 1
HEADER = struct.Struct("<4sBBBBB3x16sQIfQI")
MAX_NDIM = 8
MAX_ELEMENTS = 1 << 31
"""A frame declaring more elements than this is refused before anything is allocated."""

_JOB_ID = re.compile(r"^[A-Za-z0-9_-]{1,16}$")


class Kind(IntEnum):
    ACTIVATION = 1
    GRADIENT = 2
    LABELS = 3
    WEIGHTS = 4


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
_WIRE_DTYPE = {Codec.FP32: torch.float32, Codec.FP16: torch.float16, Codec.BF16: torch.bfloat16,
               Codec.INT8: torch.int8}  # fmt: skip


_ALIGN = 16


def _padding(ndim: int) -> int:
    """Zero bytes after the shape so the payload starts 16-byte aligned."""
    return -(HEADER.size + 8 * ndim) % _ALIGN


def valid_job_id(job: str) -> bool:
    """Job ids are 1-16 characters of ``[A-Za-z0-9_-]``: they fit the frame header."""
    return bool(_JOB_ID.match(job))


def device_status(device: str) -> str:
    return f"{TOPIC_ROOT}/devices/{device}/status"


def device_profile(device: str) -> str:
    return f"{TOPIC_ROOT}/devices/{device}/profile"


def device_cmd(device: str) -> str:
    return f"{TOPIC_ROOT}/devices/{device}/cmd"


def device_heartbeat(device: str) -> str:
    return f"{TOPIC_ROOT}/devices/{device}/heartbeat"


def stage_topic(job: str, stage: int, channel: str) -> str:
    """Frames *for* stage ``stage``: ``fwd`` (activations, labels) or ``bwd`` (gradients)."""
    return f"{TOPIC_ROOT}/jobs/{job}/stage/{stage}/{channel}"


def job_events(job: str) -> str:
    return f"{TOPIC_ROOT}/jobs/{job}/events"


def job_weights(job: str, stage: int) -> str:
    """A stage's trained weights at the end of a job (safetensors bytes)."""
    return f"{TOPIC_ROOT}/jobs/{job}/weights/{stage}"


_STAGE_TOPIC = re.compile(rf"^{TOPIC_ROOT}/jobs/([A-Za-z0-9_-]{{1,16}})/stage/(\d+)/(fwd|bwd)$")


def parse_stage_topic(topic: str) -> tuple[str, int, str] | None:
    """``(job, stage, channel)`` of a stage topic, or ``None`` for any other topic."""
    m = _STAGE_TOPIC.match(topic)
    return (m.group(1), int(m.group(2)), m.group(3)) if m else None


class FrameError(ValueError):
    """A frame that must be dropped; ``reason`` is a short counter key."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class Frame:
    kind: Kind
    job: str
    step: int
    microbatch: int
    codec: Codec
    tensor: torch.Tensor
    nbytes: int
    """Size of the whole frame on the wire."""

    @property
    def key(self) -> tuple[int, int, int]:
        return (int(self.kind), self.step, self.microbatch)


def encode_frame(
    kind: Kind, job: str, step: int, microbatch: int, tensor: torch.Tensor, codec: Codec
) -> bytes:
    """One frame: header, shape, payload. Integer tensors are always sent raw."""
    if not valid_job_id(job):
        raise ValueError(f"job id {job!r} must be 1-16 characters of [A-Za-z0-9_-]")
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype not in _DTYPE_CODES:
        raise ValueError(f"dtype {t.dtype} cannot be sent")
    if t.ndim > MAX_NDIM:
        raise ValueError(f"tensor has {t.ndim} dimensions; at most {MAX_NDIM} can be sent")
    scale = 0.0
    if not t.is_floating_point():
        codec = Codec.RAW
        wire = t
    elif codec is Codec.RAW:
        wire = t
    elif codec is Codec.INT8:
        peak = float(t.abs().max()) if t.numel() else 0.0
        scale = peak / 127.0 if peak > 0 else 1.0
        wire = torch.round(t.float() / scale).clamp_(-127, 127).to(torch.int8)
    else:
        wire = t.to(_WIRE_DTYPE[codec])
    payload: bytes | memoryview = b""
    if wire.numel():
        payload = memoryview(wire.contiguous().view(torch.uint8).reshape(-1).numpy())  # type: ignore[arg-type]
    header = HEADER.pack(
        MAGIC, VERSION, int(kind), int(codec), _DTYPE_CODES[t.dtype], t.ndim,
        job.encode(), step, microbatch, scale, len(payload), zlib.crc32(payload),
    )  # fmt: skip
    shape = struct.pack(f"<{t.ndim}Q", *t.shape) + bytes(_padding(t.ndim))
    # One copy of the payload, straight into the frame.
    return b"".join((header, shape, payload))


def decode_frame(data: bytes | bytearray | memoryview) -> Frame:
    """Check and decode one frame; anything wrong raises :class:`FrameError`."""
    view = memoryview(data)
    if len(view) < HEADER.size:
        raise FrameError("truncated", f"{len(view)} bytes is shorter than the header")
    (magic, version, kind, codec, dtype, ndim, job_raw, step, mb, scale, length,
     checksum) = HEADER.unpack_from(view)  # fmt: skip
    if magic != MAGIC:
        raise FrameError("bad-magic", f"magic {magic!r}")
    if version != VERSION:
        raise FrameError("bad-version", f"version {version}")
    try:
        kind_v, codec_v, dtype_v = Kind(kind), Codec(codec), DTYPES[dtype]
    except (ValueError, KeyError):
        raise FrameError("bad-field", f"kind {kind}, codec {codec} or dtype {dtype}") from None
    if ndim > MAX_NDIM:
        raise FrameError("bad-shape", f"{ndim} dimensions")
    job = job_raw.rstrip(b"\0").decode("ascii", errors="replace")
    if not valid_job_id(job):
        raise FrameError("bad-job", f"job {job!r}")
    start = HEADER.size + 8 * ndim + _padding(ndim)
    if len(view) < start:
        raise FrameError("truncated", "frame ends inside the shape")
    shape = struct.unpack_from(f"<{ndim}Q", view, HEADER.size)
    numel = 1
    for dim in shape:
        numel *= dim
    if numel > MAX_ELEMENTS:
        raise FrameError("too-large", f"shape {shape} declares {numel} elements")
    if len(view) - start != length:
        raise FrameError(
            "bad-length", f"declares {length} payload bytes, carries {len(view) - start}"
        )
    wire_dtype = dtype_v if codec_v is Codec.RAW else _WIRE_DTYPE[codec_v]
    if numel * wire_dtype.itemsize != length:
        need = numel * wire_dtype.itemsize
        raise FrameError("bad-shape", f"shape {shape} needs {need} bytes, payload has {length}")
    payload = view[start:]
    if zlib.crc32(payload) != checksum:
        raise FrameError("bad-checksum", "payload checksum does not match")
    if numel == 0:
        tensor = torch.empty(shape, dtype=dtype_v)
    else:
        with warnings.catch_warnings():
            # The buffer is read-only bytes; see [Note: zero-copy decoding].
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.frombuffer(payload, dtype=wire_dtype).view(shape)
        if tensor.data_ptr() % _ALIGN:
            tensor = tensor.clone()
        if codec_v is Codec.INT8:
            tensor = tensor.to(dtype_v) * scale
        elif wire_dtype != dtype_v:
            tensor = tensor.to(dtype_v)
    return Frame(kind_v, job, step, mb, codec_v, tensor, len(view))
