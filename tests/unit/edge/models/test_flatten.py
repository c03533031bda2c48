"""User models: imported by reference, flattened with torch.fx, refused when they cannot be."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from edge.errors import UserError
from edge.models.zoo import get_model

USER_MODULE = """
import torch
from torch import nn


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 16)
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        h = h + self.mid(h)          # skip connection: no cut inside
        return self.out(torch.tanh(h))


def residual():
    return Residual()
residual.input_shape = (8,)
residual.num_classes = 3


def sequential(hidden=4):
    return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 3))
sequential.input_shape = (8,)


def as_list():
    return [nn.Linear(8, 8), nn.Linear(8, 3)]
as_list.input_shape = (8,)


class Branchy(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x
        return -x


def control_flow():
    return Branchy()
control_flow.input_shape = (8,)


class TwoOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x), x


def two_outputs():
    return TwoOut()
two_outputs.input_shape = (8,)


def not_a_model():
    return 42
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"user_models_{abs(hash(tmp_path)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_residual_model_is_cut_only_where_one_tensor_is_live(user_module: str) -> None:
    spec = get_model(f"{user_module}:residual")
    # inp | relu | (mid + skip) | tanh | out: the add keeps mid and the skip together.
    assert spec.unit_names == ["inp", "relu", "mid", "tanh", "out"]
    x = torch.randn(5, 8)
    whole = spec.build()
    ref = whole(x)
    h = x
    for i in range(spec.num_units):
        h = spec.build_segment(i, i + 1)(h)
    assert torch.equal(h, ref)
    assert spec.num_classes == 3


def test_sequential_and_list_models_become_one_unit_per_element(user_module: str) -> None:
    spec = get_model(f"{user_module}:sequential", hidden=6)
    assert spec.num_units == 3
    assert spec.build_segment(0, 1)[0].out_features == 6
    assert get_model(f"{user_module}:as_list").num_units == 2


def test_same_seed_same_weights_on_every_build(user_module: str) -> None:
    a = get_model(f"{user_module}:residual", seed=3).build().state_dict()
    b = get_model(f"{user_module}:residual", seed=3).build().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        (":control_flow", "cannot be flattened with torch.fx"),
        (":two_outputs", "returns several values"),
        (":not_a_model", "not an nn.Module"),
        (":missing", "has no attribute 'missing'"),
        ("nowhere_module_xyz:fn", "cannot import module 'nowhere_module_xyz'"),
    ],
)
def test_models_that_cannot_be_units_are_refused_with_the_reason(
    user_module: str, ref: str, message: str
) -> None:
    full = ref if not ref.startswith(":") else f"{user_module}{ref}"
    with pytest.raises(UserError, match=message):
        get_model(full)
