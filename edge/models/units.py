"""Building blocks of the zoo: every class here is one *unit* (one tensor in, one out).

A unit is the smallest piece a plan can place on a device, so anything with an
internal skip connection (a residual block, a transformer block) is one unit and
a cut between any two units is valid.

[Note: normalisation in pipelines]
Batch normalisation computes statistics over the samples it sees. In a pipeline a
stage sees one microbatch at a time, so a BatchNorm model trained with M
microbatches differs from the same model trained on the whole batch on one device.
Zoo models therefore default to ``norm="group"`` (GroupNorm, per-sample
statistics), which makes pipelined training equal single-device training; pass
``norm="batch"`` for the classic architecture, knowing that equality then holds
only with one microbatch.

Tested in tests/unit/edge/models/test_zoo.py (every cut of every model equals the whole;
the norm variants), tests/unit/edge/models/test_unit_costs.py (a transformer block's
FLOPs) and tests/unit/edge/models/test_attention.py (the fused attention against the
explicit one).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ATTENTIONS",
    "BasicBlock",
    "CausalSelfAttention",
    "ConvNormAct",
    "InvertedResidual",
    "LMHead",
    "TokenEmbedding",
    "TransformerBlock",
    "make_norm",
]


def make_norm(kind: str, channels: int) -> nn.Module:
    """A 2-d normalisation layer: ``group`` (GroupNorm), ``batch`` or ``none``."""
    if kind == "group":
        groups = math.gcd(channels, 32)
        return nn.GroupNorm(groups, channels)
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"norm: unknown normalisation {kind!r} (expected group, batch or none)")


class ConvNormAct(nn.Sequential):
    """Conv2d, normalisation, activation, and an optional 2x2 max-pool."""

    def __init__(
        self,
        cin: int,
        cout: int,
        kernel: int = 3,
        stride: int = 1,
        *,
        groups: int = 1,
        norm: str = "group",
        act: type[nn.Module] | None = nn.ReLU,
        pool: bool = False,
    ) -> None:
        layers: list[nn.Module] = [
            nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=norm == "none"),
            make_norm(norm, cout),
        ]
        if act is not None:
            layers.append(act())
        if pool:
            layers.append(nn.MaxPool2d(2))
        super().__init__(*layers)


class BasicBlock(nn.Module):
    """ResNet basic block (two 3x3 convolutions and a shortcut) as one unit."""

    def __init__(self, cin: int, cout: int, stride: int, norm: str) -> None:
        super().__init__()
        self.body = nn.Sequential(
            ConvNormAct(cin, cout, 3, stride, norm=norm),
            ConvNormAct(cout, cout, 3, 1, norm=norm, act=None),
        )
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = ConvNormAct(cin, cout, 1, stride, norm=norm, act=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.shortcut(x))


class InvertedResidual(nn.Module):
    """MobileNetV2 block: 1x1 expand, 3x3 depthwise, 1x1 project, residual when shapes allow."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int, norm: str) -> None:
        super().__init__()
        hidden = cin * expand
        layers: list[nn.Module] = []
        if expand != 1:
            layers.append(ConvNormAct(cin, hidden, 1, norm=norm, act=nn.ReLU6))
        layers += [
            ConvNormAct(hidden, hidden, 3, stride, groups=hidden, norm=norm, act=nn.ReLU6),
            ConvNormAct(hidden, cout, 1, norm=norm, act=None),
        ]
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        return x + out if self.residual else out


class TokenEmbedding(nn.Module):
    """Token plus learned position embedding: int64 ``[B, T]`` to ``[B, T, d]``."""

    def __init__(self, vocab_size: int, block_size: int, d_model: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, d_model)
        self.positions = nn.Embedding(block_size, d_model)
        nn.init.normal_(self.tokens.weight, std=0.02)
        nn.init.normal_(self.positions.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[-1], device=idx.device)
        return self.tokens(idx) + self.positions(pos)


ATTENTIONS = ("auto", "fused", "explicit")
"""How :class:`CausalSelfAttention` computes; see [Note: fused attention]."""


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention, fused or with explicit matmuls.

    [Note: fused attention]
    ``fused`` computes with ``torch.nn.functional.scaled_dot_product_attention(...,
    is_causal=True)``: flash attention on a GPU, which never holds the T x T scores,
    so it saves memory and time there; on the CPU torch's fused kernel was a little
    faster too (``bench/gpu.py --device cpu``, gpt-mini's bench size, the largest
    stage at 16 sequences: 0.651 of the matmul rate fused, 0.633 explicit).
    ``explicit`` computes the scores with matmuls, masks them and takes the softmax in
    the input's precision.
    ``auto``, the default, is fused on every device but ``meta``, where the zoo bounds
    a model's largest tensor: there the explicit scores are counted, the most a job
    that asks for ``explicit`` makes ([Note: bounded zoo options] in
    :mod:`edge.models.zoo`). The two give the same result to float rounding
    (tests/unit/edge/models/test_attention.py), and the unit-cost profile counts the
    same FLOPs for both: the explicit matmuls, which it counts for the fused kernels
    too (:data:`edge.models.unit_costs.ATTENTION_FLOPS`).
    """

    def __init__(self, d_model: int, n_head: int, block_size: int, attention: str = "auto") -> None:
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_head ({n_head})")
        if attention not in ATTENTIONS:
            raise ValueError(f"attention {attention!r} is not one of {', '.join(ATTENTIONS)}")
        self.n_head = n_head
        self.attention = attention
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.mask: torch.Tensor
        mask = torch.tril(torch.ones(block_size, block_size, dtype=torch.bool))
        self.register_buffer("mask", mask, persistent=False)

    def fused_on(self, device: torch.device) -> bool:
        """Whether this module computes with the fused kernel on ``device``."""
        return self.attention == "fused" or (self.attention == "auto" and device.type != "meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.n_head
        q, k, v = self.qkv(x).split(d, dim=-1)
        q = q.view(b, t, h, d // h).transpose(1, 2)
        k = k.view(b, t, h, d // h).transpose(1, 2)
        v = v.view(b, t, h, d // h).transpose(1, 2)
        if self.fused_on(x.device):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // h))
            scores = scores.masked_fill(~self.mask[:t, :t], float("-inf"))
            out = scores.softmax(dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class TransformerBlock(nn.Module):
    """Pre-norm decoder block: attention and a 4x MLP, each with a residual."""

    def __init__(self, d_model: int, n_head: int, block_size: int, attention: str = "auto") -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, block_size, attention)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class LMHead(nn.Module):
    """Final LayerNorm and the projection to vocabulary logits."""

    def __init__(self, d_model: int, vocab_size: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))
