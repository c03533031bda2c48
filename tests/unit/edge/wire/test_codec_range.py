"""Each frame codec over its whole range: [Note: what each codec promises] in edge/wire/frames.py.

The round trips in test_protocol.py draw values of magnitude 1e-3, 1 and 1e3,
which fp16 and bf16 both hold; a codec that rounded to the wrong type, flushed
subnormals or saturated would pass them. Here every value is drawn across the
whole range of the codec's type and of the tensor's dtype, binade by binade:
subnormals, the smallest normal, the largest finite value, just past it, and
the specials. The float codecs must give exactly what a cast to their type
gives, and stay within the error they promise; int8 must hold its half-step
bound at every peak float32 can hold, and refuse what it cannot carry.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from edge.wire.frames import DTYPES, HEADER, Codec, Kind, decode_frame, encode_frame

FLOATS = [d for d in DTYPES.values() if d.is_floating_point]
ROUNDS_TO = {Codec.FP32: torch.float32, Codec.FP16: torch.float16, Codec.BF16: torch.bfloat16}
"""The type each float codec rounds to, written here rather than read from the codec."""
DIGITS = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}
"""Significant bits of each type (IEEE 754 and bfloat16's definition)."""
SCALE_AT = 11
"""The int8 scale's place among the header's fields (edge/wire/frames.py's layout)."""
RANGE = settings(deadline=None, max_examples=200)


def smallest_subnormal(dtype: torch.dtype) -> float:
    return math.ldexp(1.0, math.frexp(torch.finfo(dtype).smallest_normal)[1] - DIGITS[dtype])


def edges(dtype: torch.dtype) -> list[float]:
    """The magnitudes where a codec of ``dtype`` changes behaviour, and either side of them."""
    f = torch.finfo(dtype)
    sub, tiny, big = smallest_subnormal(dtype), f.smallest_normal, f.max
    ulp_max = math.ldexp(1.0, math.frexp(big)[1] - DIGITS[dtype])
    return [sub, sub / 2, 1.5 * sub, 3 * sub, tiny, tiny - sub, tiny / 2, big, big + ulp_max / 2]


def magnitudes(gen: torch.Generator, n: int, low: float, high: float) -> torch.Tensor:
    """``n`` float64 magnitudes log-uniform over [low, high): every binade equally often."""
    lo, hi = math.log2(low), math.log2(high)
    return torch.exp2(lo + (hi - lo) * torch.rand(n, generator=gen, dtype=torch.float64))


def signed(values: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return values * (torch.randint(0, 2, values.shape, generator=gen) * 2 - 1)


def span(dtype: torch.dtype, codec_type: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Values of ``dtype`` over every binade either type has, with both types' edges."""
    low = min(smallest_subnormal(dtype), smallest_subnormal(codec_type))
    high = min(torch.finfo(dtype).max, 4 * torch.finfo(codec_type).max)
    drawn = magnitudes(gen, 256, low, high)
    special = torch.tensor([*edges(dtype), *edges(codec_type), 0.0], dtype=torch.float64)
    values = signed(torch.cat([drawn, special]), gen).to(dtype)
    return torch.cat([values, torch.tensor([math.inf, -math.inf, math.nan, -0.0], dtype=dtype)])


def round_trip(t: torch.Tensor, codec: Codec) -> tuple[torch.Tensor, float]:
    """The decoded tensor, and the scale its frame's header holds."""
    frame = encode_frame(Kind.GRADIENT, "range", 0, 0, t, codec)
    return decode_frame(frame).tensor, HEADER.unpack_from(frame)[SCALE_AT]


# -- fp32, fp16, bf16 ---------------------------------------------------------------------


@RANGE
@given(
    codec=st.sampled_from(list(ROUNDS_TO)),
    dtype=st.sampled_from(FLOATS),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_float_codec_rounds_as_a_cast_to_its_type_at_every_magnitude(
    codec: Codec, dtype: torch.dtype, seed: int
) -> None:
    to = ROUNDS_TO[codec]
    t = span(dtype, to, torch.Generator().manual_seed(seed))
    got, _ = round_trip(t, codec)

    assert got.dtype == dtype
    torch.testing.assert_close(got, t.to(to).to(dtype), rtol=0, atol=0, equal_nan=True)
    assert torch.equal(torch.signbit(got), torch.signbit(t.to(to).to(dtype)))

    # The error it promises, from the types' digits alone. A value that rounds past the
    # largest either type holds (fp16's 65504 sent as bf16 rounds to 65536) is +-inf or
    # that largest value.
    x, y = t.double(), got.double()
    digits = min(DIGITS[to], DIGITS[dtype])
    largest = min(torch.finfo(to).max, torch.finfo(dtype).max)
    held = x.isfinite() & (x.abs() <= largest * (1 - 2.0**-digits))
    floor = torch.tensor(smallest_subnormal(to) / 2, dtype=torch.float64)
    bound = torch.maximum(x.abs() * 2.0**-digits, floor)
    assert bool(((y - x).abs() <= bound)[held].all())
    beyond = x.isfinite() & ~held
    assert bool((y[beyond].abs() >= largest * (1 - 2.0 ** (1 - digits))).all())
    assert torch.equal(torch.signbit(y[beyond]), torch.signbit(x[beyond]))
    assert bool(y[x.isnan()].isnan().all()) and torch.equal(y[x.isinf()], x[x.isinf()])


@pytest.mark.parametrize("codec", list(ROUNDS_TO), ids=lambda c: c.name)
def test_a_float_codec_keeps_what_its_type_holds_and_overflows_past_it(codec: Codec) -> None:
    """The named edges, by hand: the largest finite value, just past it, the smallest subnormal."""
    to = ROUNDS_TO[codec]
    big, sub = torch.finfo(to).max, smallest_subnormal(to)
    t = torch.tensor([big, -big, sub, -sub, 4 * big, sub / 4], dtype=torch.float64)
    got, _ = round_trip(t, codec)
    assert got[:4].tolist() == [big, -big, sub, -sub]
    assert got[4] == math.inf and got[5] == 0.0


# -- int8 --------------------------------------------------------------------------------


def next_float32_down(x: float) -> float:
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    return struct.unpack("<f", struct.pack("<I", bits - 1))[0] if bits else 0.0


@RANGE
@given(
    dtype=st.sampled_from(FLOATS),
    seed=st.integers(0, 2**32 - 1),
    at=st.floats(0.0, 1.0),
    width=st.integers(0, 40),
)
# A float64 tensor whose peak is among float32's subnormals: rounded to float32 before
# the division, a value 380.73 units (of 2^-149) came back 3.27 units off, beyond the
# half step (3 units) of its scale of 6.
@example(dtype=torch.float64, seed=0, at=0.77734375, width=1)
def test_int8_holds_half_a_step_at_every_peak_float32_holds(
    dtype: torch.dtype, seed: int, at: float, width: int
) -> None:
    """A tensor's peak anywhere from the smallest subnormal to float32's largest value."""
    gen = torch.Generator().manual_seed(seed)
    to = torch.float32 if DIGITS[dtype] > 24 else dtype  # int8 decodes to float32 at most
    low, high = smallest_subnormal(dtype), min(torch.finfo(dtype).max, torch.finfo(to).max)
    exponent = math.log2(low) + at * (math.log2(high) - math.log2(low))
    peak = float(torch.tensor(2.0**exponent, dtype=torch.float64).to(dtype))
    peak = peak or low
    below = magnitudes(gen, 64, max(peak * 2.0**-width, low), peak)
    t = torch.cat([signed(below, gen), torch.tensor([peak, -peak, 0.0], dtype=torch.float64)]).to(
        dtype
    )
    real_peak = float(t.double().abs().max())
    got, scale = round_trip(t, Codec.INT8)

    assert got.dtype == to
    assert scale * 127 >= real_peak, "a scale below the peak's step clips the largest values"
    assert next_float32_down(scale) * 127 < real_peak, "the scale is the smallest that fits"
    err = (got.double() - t.double()).abs()
    floor = torch.tensor(low, dtype=torch.float64)
    rounding = torch.maximum(got.double().abs() * 2.0 ** -DIGITS[to], floor)
    assert bool((err <= scale * (0.5 + 2.0**-16) + rounding).all()), float(err.max())


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_int8_refuses_what_it_cannot_carry(dtype: torch.dtype, bad: float) -> None:
    t = torch.tensor([1.0, bad, -2.0], dtype=dtype)
    with pytest.raises(ValueError, match="int8 codec carries finite values"):
        encode_frame(Kind.ACTIVATION, "range", 0, 0, t, Codec.INT8)


def test_int8_refuses_a_float64_beyond_float32() -> None:
    t = torch.tensor([1.0, 1e300], dtype=torch.float64)
    with pytest.raises(ValueError, match="int8 codec carries finite values float32 can hold"):
        encode_frame(Kind.ACTIVATION, "range", 0, 0, t, Codec.INT8)
