"""Unit-cost profiling: what each unit of a model costs to train, per sample.

For every unit this measures, on a real batch pushed through the real units:

- forward and backward FLOPs, counted by ``torch.utils.flop_counter`` (matmuls
  and convolutions; element-wise work is not counted, as in every FLOP model the
  planning literature uses), a fused attention kernel as the matmuls it replaces
  (:data:`ATTENTION_FLOPS`);
- parameter bytes;
- output bytes (what crosses a cut after the unit);
- activation bytes kept for backward, measured with
  ``torch.autograd.graph.saved_tensors_hooks``: the distinct storages autograd
  saves while the unit runs forward, parameters excluded. Each unit is measured
  on a fresh input, as if it began a stage, so a unit that saves its input
  counts it even when the unit before it keeps the same tensor: conservative by
  at most one output per unit, the safe side for a memory limit;
- forward and backward wall time on this machine: the median of ``repeats``
  timed runs after ``warmup`` untimed ones.

Per-sample figures are batch totals divided by the batch size. The result's
:meth:`ModelProfile.to_unit_specs` is the ``layers`` list of a planning problem
(``shared/spec/planning.md``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from edge.models.zoo import ModelSpec
from edge.problem import UnitSpec

__all__ = ["ModelProfile", "UnitCost", "profile_model"]


@dataclass(frozen=True)
class UnitCost:
    """What one unit costs per sample."""

    name: str
    fwd_flops: float
    bwd_flops: float
    param_bytes: int
    out_bytes: float
    act_bytes: float
    fwd_time_s: float | None = None
    """Median forward time of the whole batch on the profiling machine."""
    bwd_time_s: float | None = None

    def to_unit_spec(self) -> UnitSpec:
        return UnitSpec(
            name=self.name,
            fwd_flops=self.fwd_flops,
            bwd_flops=self.bwd_flops,
            param_bytes=self.param_bytes,
            out_bytes=self.out_bytes,
            act_bytes=self.act_bytes,
        )


@dataclass(frozen=True)
class ModelProfile:
    """The per-unit costs of one model at one batch size on one machine."""

    model: str
    batch_size: int
    units: list[UnitCost]
    device: str = "cpu"
    threads: int = 1

    @property
    def train_flops_per_sample(self) -> float:
        return sum(u.fwd_flops + u.bwd_flops for u in self.units)

    def to_unit_specs(self) -> list[UnitSpec]:
        """The ``layers`` list of a planning problem."""
        return [u.to_unit_spec() for u in self.units]

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "batch_size": self.batch_size,
            "device": self.device,
            "threads": self.threads,
            "units": [asdict(u) for u in self.units],
        }


def _attention_forward(q: Any, k: Any, v: Any, *_args: Any, **_kwargs: Any) -> int:
    """Q K^T and the scores times V, as the explicit attention's two matmuls count."""
    b, h, t, d = q
    s, dv = k[2], v[3]
    return 2 * b * h * t * s * d + 2 * b * h * t * s * dv


def _attention_backward(_grad: Any, q: Any, k: Any, v: Any, *_args: Any, **_kwargs: Any) -> int:
    """Twice the forward: each of the explicit attention's matmuls has two in backward."""
    return 2 * _attention_forward(q, k, v)


_aten = torch.ops.aten
ATTENTION_FLOPS: dict[Any, Any] = {
    **dict.fromkeys(
        (
            _aten._scaled_dot_product_flash_attention_for_cpu,
            _aten._scaled_dot_product_flash_attention,
            _aten._scaled_dot_product_efficient_attention,
            _aten._scaled_dot_product_cudnn_attention,
        ),
        _attention_forward,
    ),
    **dict.fromkeys(
        (
            _aten._scaled_dot_product_flash_attention_for_cpu_backward,
            _aten._scaled_dot_product_flash_attention_backward,
            _aten._scaled_dot_product_efficient_attention_backward,
            _aten._scaled_dot_product_cudnn_attention_backward,
        ),
        _attention_backward,
    ),
}
"""FLOPs of torch's fused attention kernels, counted as the explicit matmuls count
([Note: fused attention] in :mod:`edge.models.units`): torch counts none for the CPU
kernel and recomputes the scores in its count of the GPU kernels' backward. The
shapes are ``(batch, heads, tokens, head dim)``; the full T x T is counted, causal or not."""


def _count_flops(fn: Any) -> tuple[Any, int]:
    with FlopCounterMode(display=False, custom_mapping=ATTENTION_FLOPS) as counter:
        result = fn()
    return result, int(counter.get_total_flops())


def _saved_bytes(unit: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Run ``unit(x)`` and sum the distinct non-parameter storages autograd saves."""
    params = {p.untyped_storage().data_ptr() for p in unit.parameters()}
    params |= {b.untyped_storage().data_ptr() for b in unit.buffers()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and ptr != 0:
            seen[ptr] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = unit(x)
    return out, sum(seen.values())


def _median_time(fn: Any, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fresh_input(x: torch.Tensor, needs_grad: bool) -> torch.Tensor:
    x = x.detach().clone()
    return x.requires_grad_(needs_grad and x.is_floating_point())


def profile_model(
    spec: ModelSpec,
    batch_size: int,
    *,
    device: str = "cpu",
    timing: bool = True,
    warmup: int = 2,
    repeats: int = 5,
    seed: int = 0,
) -> ModelProfile:
    """Profile every unit of ``spec`` on a seeded batch of ``batch_size`` samples.

    Units are built and measured one at a time, so profiling a model never holds
    more than one unit's weights plus one activation. With ``timing=False`` only
    the counted figures are produced (fast and exactly reproducible).
    """
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    dev = torch.device(device)
    x = spec.example_input(batch_size, seed).to(dev)
    costs: list[UnitCost] = []
    for i in range(spec.num_units):
        unit = spec.build_segment(i, i + 1).to(dev).train()
        inp = _fresh_input(x, needs_grad=i > 0)
        (out, act_bytes), fwd = _count_flops(lambda u=unit, a=inp: _saved_bytes(u, a))
        grad = torch.ones_like(out)
        # A unit with nothing to train ahead of it (no parameters, input needs no
        # gradient) has no backward at all.
        has_bwd = out.requires_grad
        bwd = _count_flops(lambda o=out, g=grad: o.backward(g))[1] if has_bwd else 0
        fwd_t = bwd_t = None
        if timing:
            with torch.no_grad():
                fwd_t = _median_time(lambda u=unit, a=inp: u(a), warmup, repeats)
            bwd_t = 0.0
            if has_bwd:
                y = unit(inp)
                bwd_t = _median_time(
                    lambda y=y, g=grad: y.backward(g, retain_graph=True), warmup, repeats
                )
        costs.append(
            UnitCost(
                name=spec.units[i].name,
                fwd_flops=fwd / batch_size,
                bwd_flops=bwd / batch_size,
                param_bytes=sum(p.numel() * p.element_size() for p in unit.parameters()),
                out_bytes=out.numel() * out.element_size() / batch_size,
                act_bytes=act_bytes / batch_size,
                fwd_time_s=fwd_t,
                bwd_time_s=bwd_t,
            )
        )
        x = out.detach()
    return ModelProfile(
        model=spec.name,
        batch_size=batch_size,
        units=costs,
        device=str(dev),
        threads=torch.get_num_threads(),
    )
