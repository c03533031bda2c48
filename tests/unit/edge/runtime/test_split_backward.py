"""A backward split into ``B`` and ``W`` gives a whole backward's gradients, bit for bit.

Each zoo model is cut in two, and its second half runs three microbatches both ways:
whole backwards, and the split, with every ``B`` first and the ``W``s after them (the
order zero-bubble schedules put them in). The input gradients and the accumulated
weight gradients must be equal, and every weight's post-accumulate-grad hook must fire
once per microbatch, in its ``W`` and not in its ``B``.
"""

from __future__ import annotations

import pytest
import torch

from edge.models.zoo import get_model
from edge.runtime.split_backward import WeightBackward, input_backward

MICROBATCHES = 3


def _twins(model: str) -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    """The second half of ``model`` twice, with the same weights, and an input for it."""
    spec = get_model(model, seed=0)
    cut = spec.num_units // 2
    whole = spec.build_segment(cut, spec.num_units)
    split = spec.build_segment(cut, spec.num_units)
    split.load_state_dict(whole.state_dict())
    with torch.no_grad():
        x = spec.build_segment(0, cut)(spec.example_input(4))
    return whole, split, x


def _count_accumulations(module: torch.nn.Module) -> list[int]:
    counts = [0]

    def seen(_param: torch.Tensor) -> None:
        counts[0] += 1

    for p in module.parameters():
        p.register_post_accumulate_grad_hook(seen)
    return counts


@pytest.mark.parametrize("model", ["mlp", "cnn-digits", "gpt-mini", "resnet18", "vgg11"])
def test_the_split_equals_a_whole_backward(model: str) -> None:
    whole, split, x = _twins(model)
    params = list(split.parameters())
    accumulated = _count_accumulations(split)
    torch.manual_seed(1)
    pending: list[WeightBackward] = []
    for _ in range(MICROBATCHES):
        a = x.clone().requires_grad_()
        out = whole(a)
        grad = torch.randn_like(out)
        out.backward(grad)
        b = x.clone().requires_grad_()
        pending.append(input_backward(split(b), grad, b, params))
        assert torch.equal(a.grad, b.grad)
    assert accumulated[0] == 0 and all(p.grad is None for p in params), "B touched a weight"
    assert any(w.exits for w in pending), "the split ran as a whole backward"
    for w in pending:
        w.run()
    for (name, p), q in zip(whole.named_parameters(), params, strict=True):
        assert torch.equal(p.grad, q.grad), f"{model}: {name}'s gradient differs"
    assert accumulated[0] == MICROBATCHES * len(params)


def test_a_weight_pass_runs_once() -> None:
    _, split, x = _twins("mlp")
    b = x.clone().requires_grad_()
    w = input_backward(split(b).sum(), None, b, list(split.parameters()))
    w.run()
    once = [p.grad.clone() for p in split.parameters()]
    w.run()
    assert all(torch.equal(p.grad, g) for p, g in zip(split.parameters(), once, strict=True))


class _Tied(torch.nn.Module):
    """One linear layer used twice: its weight is reached from two frontier nodes."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 8)
        self.mid = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(torch.tanh(self.mid(self.layer(x))))


def test_tied_weights_get_their_gradient_once() -> None:
    torch.manual_seed(0)
    whole, split = _Tied(), _Tied()
    split.load_state_dict(whole.state_dict())
    x = torch.randn(4, 8)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    whole(a).square().sum().backward()
    w = input_backward(split(b).square().sum(), None, b, list(split.parameters()))
    assert w.shared, "the tied weight should take the clamped pass"
    w.run()
    assert torch.equal(a.grad, b.grad)
    for p, q in zip(whole.parameters(), split.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_an_input_without_a_gradient_leaves_everything_to_w() -> None:
    """Stage 0 (data) and a stage fed token ids: ``B`` does nothing, ``W`` is the whole."""
    spec = get_model("gpt-mini", seed=0)
    whole, split = spec.build_segment(0, 2), spec.build_segment(0, 2)
    split.load_state_dict(whole.state_dict())
    tokens = spec.example_input(2)
    out = whole(tokens)
    grad = torch.randn_like(out)
    out.backward(grad)
    w = input_backward(split(tokens), grad, tokens, list(split.parameters()))
    assert w.whole is not None and all(p.grad is None for p in split.parameters())
    w.run()
    for p, q in zip(whole.parameters(), split.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
