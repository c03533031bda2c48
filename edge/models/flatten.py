"""User models: import ``package.module:function`` and turn the result into units.

The function returns an ``nn.Sequential``, a list of modules, or any other
``nn.Module``. A sequence is used as it is, one element per unit. Any other
module is traced with ``torch.fx`` and cut at every point where exactly one
tensor is live (the only places a pipeline can cut): a residual block becomes
one unit because its skip connection keeps two tensors live across it. A model
that cannot be traced (data-dependent control flow), that takes more than one
input or returns more than one tensor, or that has no cut point at all, is
refused with a message saying which.

Unlike zoo models, a user model is built whole on every device (the function
decides how it is built) under ``seeded(seed)``, so every device gets the same
initial weights; a segment keeps only its own units.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module

from edge.errors import UserError
from edge.models.user_code import ANY_CODE, CodeAllowance, import_reference
from edge.models.zoo import ModelSpec, UnitDef, seeded

__all__ = ["flatten_module", "user_model"]


def _unit_name(raw: str, taken: set[str]) -> str:
    name = re.sub(r"\W", "_", raw).strip("_") or "unit"
    if name[0].isdigit():
        name = f"unit{name}"
    base, n = name, 1
    while name in taken:
        n += 1
        name = f"{base}_{n}"
    taken.add(name)
    return name


def flatten_module(module: nn.Module, what: str = "model") -> list[tuple[str, nn.Module]]:
    """Cut ``module`` into units at every point where exactly one tensor is live."""
    if isinstance(module, nn.Sequential):
        taken: set[str] = set()
        return [(_unit_name(n, taken), m) for n, m in module.named_children()]
    try:
        traced = fx.symbolic_trace(module)
    except Exception as exc:  # fx raises many types; all mean "cannot trace"
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"{what}: cannot be flattened with torch.fx ({first})") from None
    nodes = list(traced.graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    if len(inputs) != 1:
        raise UserError(f"{what}: forward takes {len(inputs)} inputs; a unit chain needs exactly 1")
    output = nodes[-1]
    if not isinstance(output.args[0], fx.Node):
        raise UserError(f"{what}: forward returns several values; a unit chain needs one tensor")
    order = {n: i for i, n in enumerate(nodes)}
    last_use = {n: max((order[u] for u in n.users), default=order[n]) for n in nodes}
    # A cut after node i is valid when the only value still needed later is node i itself.
    partition: dict[str, int] = {}
    part = 0
    for i, node in enumerate(nodes[:-1]):
        partition[node.name] = part
        if node.op in ("placeholder", "get_attr") or nodes[i + 1].op == "output":
            continue
        live = [n for n in nodes[: i + 1] if last_use[n] > i]
        if live == [node]:
            part += 1
    if part == 0:
        raise UserError(f"{what}: has no point where a single tensor is live, so it cannot be cut")
    split = split_module(traced, module, lambda n: partition[n.name])
    taken = set()
    units: list[tuple[str, nn.Module]] = []
    for child_name, child in split.named_children():
        assert isinstance(child, fx.GraphModule)
        first = next(n for n in child.graph.nodes if n.op not in ("placeholder", "get_attr"))
        target = first.target
        label = target if isinstance(target, str) else getattr(target, "__name__", child_name)
        units.append((_unit_name(label, taken), child))
    return units


def user_model(
    ref: str, seed: int = 0, *, allow_code: CodeAllowance = ANY_CODE, **options: Any
) -> ModelSpec:
    """A :class:`ModelSpec` for the user function ``package.module:function``, imported
    only if ``allow_code`` lets its module in ([Note: user code on devices]).

    The function may take the model options as keyword arguments. The spec's
    ``input_shape`` comes from the function's ``input_shape`` attribute or the
    ``input_shape`` option; its default dataset from ``dataset`` likewise.
    """
    fn = import_reference(ref, "model", allow_code)
    if not callable(fn):
        raise UserError(f"model: {ref} is not callable")
    meta = {k: options.pop(k) for k in ("input_shape", "dataset", "num_classes") if k in options}
    params = inspect.signature(fn).parameters
    accepts_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    unknown = [k for k in options if k not in params and not accepts_any]
    if unknown:
        raise UserError(f"model {ref}: unknown option {unknown[0]!r}")

    def build_all() -> list[tuple[str, nn.Module]]:
        with seeded(seed):
            made = fn(**options)
        if isinstance(made, list | tuple):
            if not all(isinstance(m, nn.Module) for m in made):
                raise UserError(f"model {ref}: the list it returned holds something not a Module")
            made = nn.Sequential(*made)
        if not isinstance(made, nn.Module):
            raise UserError(f"model {ref}: returned {type(made).__name__}, not an nn.Module")
        return flatten_module(made, f"model {ref}")

    probe = build_all()

    def not_alone() -> nn.Module:
        raise RuntimeError("units of a user model are built with their segment")

    def build_segment(start: int, end: int) -> list[tuple[str, nn.Module]]:
        return build_all()[start:end]

    shape = meta.get("input_shape", getattr(fn, "input_shape", None))
    if shape is None:
        raise UserError(f"model {ref}: give input_shape (an attribute of the function or option)")
    return ModelSpec(
        name=ref,
        description=(inspect.getdoc(fn) or ref).splitlines()[0],
        units=tuple(UnitDef(name, not_alone) for name, _ in probe),
        segment_builder=build_segment,
        input_shape=tuple(int(s) for s in shape),
        input_dtype=torch.float32,
        num_classes=int(meta.get("num_classes", getattr(fn, "num_classes", 0))),
        dataset=str(meta.get("dataset", getattr(fn, "dataset", "synthetic-images"))),
        seed=seed,
    )
