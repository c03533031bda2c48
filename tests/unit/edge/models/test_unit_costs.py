"""Unit-cost profiling: counted FLOPs against hand computation, measured saved bytes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edge.models.unit_costs import profile_model
from edge.models.units import TransformerBlock
from edge.models.zoo import ModelSpec, UnitDef, get_model
from edge.problem import UnitSpec


def _spec(shape: tuple[int, ...], *units: tuple[str, nn.Module]) -> ModelSpec:
    # Fresh modules per build, as the zoo does; the lambdas return prepared instances.
    return ModelSpec(
        "hand",
        "hand-built",
        tuple(UnitDef(n, lambda m=m: m) for n, m in units),
        shape,
        torch.float32,
        10,
        "synthetic-images",
    )


def _close(measured: float, expected: float) -> bool:
    return abs(measured - expected) <= 0.01 * expected


def test_linear_flops_match_hand_computation() -> None:
    spec = _spec((64,), ("a", nn.Linear(64, 128)), ("b", nn.Linear(128, 32)))
    prof = profile_model(spec, batch_size=4, timing=False)
    a, b = prof.units
    assert _close(a.fwd_flops, 2 * 64 * 128)
    assert _close(a.bwd_flops, 2 * 64 * 128)  # first unit: weight gradient only
    assert _close(b.fwd_flops, 2 * 128 * 32)
    assert _close(b.bwd_flops, 4 * 128 * 32)  # input and weight gradients
    assert a.param_bytes == (64 * 128 + 128) * 4
    assert a.out_bytes == 128 * 4


def test_conv2d_flops_match_hand_computation() -> None:
    spec = _spec(
        (3, 16, 16),
        ("c1", nn.Conv2d(3, 8, 3, padding=1)),
        ("c2", nn.Conv2d(8, 16, 3, stride=2, padding=1)),
    )
    prof = profile_model(spec, batch_size=2, timing=False)
    c1, c2 = prof.units
    assert _close(c1.fwd_flops, 2 * 8 * 16 * 16 * 3 * 9)
    assert _close(c2.fwd_flops, 2 * 16 * 8 * 8 * 8 * 9)
    assert _close(c2.bwd_flops, 2 * c2.fwd_flops)
    assert c1.out_bytes == 8 * 16 * 16 * 4


def test_transformer_block_flops_match_hand_computation() -> None:
    t, d, h = 32, 64, 4
    spec = _spec((t, d), ("pre", nn.Identity()), ("block", TransformerBlock(d, h, t)))
    block = profile_model(spec, batch_size=2, timing=False).units[1]
    # qkv 6Td^2 + proj 2Td^2 + MLP 16Td^2, plus QK^T and AV at 2T^2d each.
    expected = 24 * t * d * d + 4 * t * t * d
    assert _close(block.fwd_flops, expected)
    assert _close(block.bwd_flops, 2 * expected)


def test_saved_activation_bytes_are_measured_not_guessed() -> None:
    spec = _spec((64,), ("pre", nn.Identity()), ("lin", nn.Linear(64, 128)), ("relu", nn.ReLU()))
    pre, lin, relu = profile_model(spec, batch_size=8, timing=False).units
    assert lin.act_bytes == 64 * 4  # Linear keeps its input; its weight is a parameter
    assert relu.act_bytes == 128 * 4  # ReLU keeps its output
    assert pre.act_bytes == 0  # Identity keeps nothing


def test_profile_of_a_zoo_model_is_a_planning_problem_layers_list() -> None:
    spec = get_model("gpt-mini")
    prof = profile_model(spec, batch_size=2, timing=True, warmup=1, repeats=2)
    layers = prof.to_unit_specs()
    assert [unit.name for unit in layers] == spec.unit_names
    assert all(isinstance(unit, UnitSpec) for unit in layers)
    assert all(u.fwd_time_s is not None and u.fwd_time_s > 0 for u in prof.units)
    blocks = [u for u in prof.units if u.name.startswith("block")]
    assert len({u.fwd_flops for u in blocks}) == 1  # identical blocks cost the same
    assert prof.units[-1].out_bytes == 64 * 128 * 4  # logits per sample: T x vocab fp32


def test_flops_do_not_depend_on_batch_size() -> None:
    spec = get_model("cnn-digits")
    small = profile_model(spec, batch_size=1, timing=False)
    large = profile_model(spec, batch_size=16, timing=False)
    for a, b in zip(small.units, large.units, strict=True):
        assert a.fwd_flops == pytest.approx(b.fwd_flops)
        assert a.out_bytes == pytest.approx(b.out_bytes)
