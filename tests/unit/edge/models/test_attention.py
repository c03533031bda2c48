"""gpt-mini's fused attention trains as its explicit one does, and costs the same FLOPs.

[Note: fused attention] in :mod:`edge.models.units`: ``fused`` is torch's
``scaled_dot_product_attention(is_causal=True)``, ``explicit`` the masked matmuls and
softmax, ``auto`` the fused kernel but on the ``meta`` device (the zoo's size bound). On the
CPU, the same seeded gpt-mini is trained a few AdamW steps each way on the same
batches: losses agree within 1e-5 at every step, and so do the first step's
gradients, and the fused model did call the fused kernel (else the comparison would
be of one path with itself). Weights after AdamW are not compared: the key's bias
has a gradient of exactly zero in exact arithmetic (softmax ignores a constant added
to a row), so each path's rounding noise there is all Adam sees, and it moves that
bias by the learning rate either way. The unit-cost
profile counts the same FLOPs per unit either way (its own count of the fused
kernels, :data:`edge.models.unit_costs.ATTENTION_FLOPS`).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from edge.errors import UserError
from edge.models.unit_costs import profile_model
from edge.models.units import CausalSelfAttention
from edge.models.zoo import get_model

OPTIONS = {"d_model": 32, "n_head": 4, "n_layer": 2, "block_size": 16, "vocab_size": 20}
FUSED_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


class _Calls(TorchDispatchMode):
    """The aten operators called while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[Any] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.add(func)
        return func(*args, **(kwargs or {}))


def _train(attention: str, steps: int = 4) -> tuple[list[float], dict[str, torch.Tensor], set[Any]]:
    """Losses of ``steps`` AdamW steps, the first step's gradients, the operators called."""
    spec = get_model("gpt-mini", seed=3, attention=attention, **OPTIONS)
    model = spec.build()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(7)
    losses, calls, grads = [], _Calls(), {}
    for step in range(steps):
        x = torch.randint(0, 20, (6, 16), generator=gen)
        y = torch.randint(0, 20, (6, 16), generator=gen)
        with calls:
            loss = F.cross_entropy(model(x).reshape(-1, 20), y.reshape(-1))
            loss.backward()
        if step == 0:
            grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads, calls.ops


def test_fused_attention_trains_as_the_explicit_one() -> None:
    fused_losses, fused_grads, fused_ops = _train("fused")
    losses, grads, ops = _train("explicit")
    assert FUSED_CPU in fused_ops and FUSED_CPU not in ops  # each ran its own path
    assert fused_losses == pytest.approx(losses, abs=1e-5)
    assert len(set(losses)) == len(losses)  # it trained: the loss moved every step
    assert set(fused_grads) == set(grads) and len(grads) == 2 + 2 * 12 + 3
    for name, value in grads.items():
        assert torch.allclose(fused_grads[name], value, atol=1e-5), name


def test_auto_is_fused_but_where_the_zoo_bounds_a_models_tensors() -> None:
    attn = CausalSelfAttention(32, 4, 16)
    assert attn.attention == "auto"
    assert attn.fused_on(torch.device("cpu")) and attn.fused_on(torch.device("cuda"))
    assert not attn.fused_on(torch.device("meta"))
    assert CausalSelfAttention(32, 4, 16, "fused").fused_on(torch.device("meta"))
    assert not CausalSelfAttention(32, 4, 16, "explicit").fused_on(torch.device("cuda"))
    _, _, ops = _train("auto", steps=1)
    assert FUSED_CPU in ops


def test_the_unit_cost_flops_do_not_change_with_the_fused_attention() -> None:
    counted = {
        attention: [
            (u.fwd_flops, u.bwd_flops)
            for u in profile_model(
                get_model("gpt-mini", attention=attention), batch_size=2, timing=False
            ).units
        ]
        for attention in ("fused", "explicit")
    }
    assert counted["fused"] == counted["explicit"]
    assert all(fwd > 0 for fwd, _ in counted["fused"][1:])  # the blocks and head count


def test_an_unknown_attention_is_refused() -> None:
    with pytest.raises(UserError, match="attention: 'flash' is not one of auto, fused, explicit"):
        get_model("gpt-mini", attention="flash")
