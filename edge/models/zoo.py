"""The model zoo: every model is an ordered list of named units built one at a time.

A :class:`ModelSpec` knows a model's units as *definitions* (a name and a
builder), not as modules, so :meth:`ModelSpec.build_segment` constructs only the
units of ``[start, end)``: a small device never allocates layers it does not run.
Each unit is built under its own seed derived from ``(seed, unit index)``, so a
unit's initial weights are the same whichever segment it is built in, and
segments built on different devices equal the whole model built in one place.

Vocabulary: a *unit* is one element of the list; a *segment* is the contiguous
range ``[start, end)`` that one stage runs.

[Note: bounded zoo options] Options reach :func:`get_model` from the REST API,
job files and the command line, so a zoo model's options are bounded before
anything is built: every integer option has a range (:data:`OPTION_BOUNDS`,
generous for real use), and a model built with options must stay within
:data:`MAX_MODEL_ELEMENTS` parameters and buffers (2^31, about 8.6 GB in fp32;
the GPU tier's 1.4 B-parameter gpt-mini fits) and within
:data:`MAX_SAMPLE_ELEMENTS` elements in any one tensor its forward pass makes
for one sample (2^28, 1 GiB in fp32; gpt-mini's T x T attention scores, which
its explicit attention makes, count even where a fused kernel would not). Both are
counted on the ``meta`` device,
where modules have shapes but no storage, so checking a model allocates and
computes nothing. A refused option is a one-line :class:`UserError` naming it
and its bound; nothing loops or allocates first.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from edge.errors import UserError
from edge.models.options import MODEL_RESERVED, check_options, check_reserved
from edge.models.units import (
    ATTENTIONS,
    BasicBlock,
    ConvNormAct,
    InvertedResidual,
    LMHead,
    TokenEmbedding,
    TransformerBlock,
)
from edge.models.user_code import ANY_CODE, CodeAllowance

__all__ = [
    "MAX_MODEL_ELEMENTS",
    "MAX_SAMPLE_ELEMENTS",
    "MODELS",
    "OPTION_BOUNDS",
    "ModelSpec",
    "Segment",
    "UnitDef",
    "check_model_options",
    "get_model",
    "list_models",
    "model_size",
    "parse_options",
    "seeded",
    "unit_seed",
]


def unit_seed(seed: int, index: int) -> int:
    """The seed unit ``index`` of a model seeded ``seed`` is built under."""
    return (seed * 1_000_003 + index * 7_919 + 17) % (2**63 - 1)


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run a block under ``torch.manual_seed(seed)`` without disturbing the caller's RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


@dataclass(frozen=True)
class UnitDef:
    """A unit not yet built: its name (a valid module name) and how to build it."""

    name: str
    build: Callable[[], nn.Module]


class Segment(nn.Sequential):
    """The units ``[start, end)`` of a model, keyed by unit name.

    Keys are unit names, so the state dicts of the segments of a plan together
    are exactly the state dict of the whole model.
    """

    def __init__(self, model: str, start: int, end: int, units: Sequence[tuple[str, nn.Module]]):
        super().__init__(OrderedDict(units))
        self.model_name = model
        self.start = start
        self.end = end


@dataclass(frozen=True)
class ModelSpec:
    """A model as an ordered list of unit definitions plus what it eats and predicts."""

    name: str
    description: str
    units: tuple[UnitDef, ...]
    input_shape: tuple[int, ...]
    """Shape of one input sample."""
    input_dtype: torch.dtype
    num_classes: int
    """Output classes (or vocabulary size): the last unit's last dimension."""
    dataset: str
    """The dataset this model trains on by default."""
    dataset_options: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    segment_builder: Callable[[int, int], list[tuple[str, nn.Module]]] | None = None
    """Builds a whole segment at once, for models whose units cannot be built alone."""

    @property
    def num_units(self) -> int:
        return len(self.units)

    @property
    def unit_names(self) -> list[str]:
        return [u.name for u in self.units]

    def build_segment(self, start: int, end: int) -> Segment:
        """Build units ``[start, end)`` and nothing else, each under its own seed."""
        if not 0 <= start < end <= self.num_units:
            raise UserError(
                f"segment [{start}, {end}) is not a non-empty range of the "
                f"{self.num_units} units of {self.name}"
            )
        if self.segment_builder is not None:
            return Segment(self.name, start, end, self.segment_builder(start, end))
        built = []
        for i in range(start, end):
            with seeded(unit_seed(self.seed, i)):
                built.append((self.units[i].name, self.units[i].build()))
        return Segment(self.name, start, end, built)

    def build(self) -> Segment:
        """The whole model (all units)."""
        return self.build_segment(0, self.num_units)

    def example_input(self, batch_size: int, seed: int = 0) -> torch.Tensor:
        """A seeded random batch with this model's input shape and dtype."""
        gen = torch.Generator().manual_seed(seed)
        shape = (batch_size, *self.input_shape)
        if self.input_dtype.is_floating_point:
            return torch.randn(shape, generator=gen, dtype=self.input_dtype)
        return torch.randint(0, self.num_classes, shape, generator=gen, dtype=self.input_dtype)


def _mlp(
    seed: int, in_features: int = 64, hidden: int = 128, depth: int = 3, num_classes: int = 10
) -> ModelSpec:
    units = [
        UnitDef(
            "fc1", lambda: nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU())
        )
    ]
    for i in range(2, depth):
        units.append(UnitDef(f"fc{i}", lambda: nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU())))
    units.append(UnitDef("out", lambda: nn.Linear(hidden, num_classes)))
    shape = (1, 8, 8) if in_features == 64 else (in_features,)
    return ModelSpec(
        name="mlp",
        description="multilayer perceptron for 8x8 digits",
        units=tuple(units),
        input_shape=shape,
        input_dtype=torch.float32,
        num_classes=num_classes,
        dataset="digits",
        seed=seed,
    )


def _cnn_digits(seed: int, width: int = 16, num_classes: int = 10, norm: str = "none") -> ModelSpec:
    w = width
    units = (
        UnitDef("conv1", lambda: ConvNormAct(1, w, norm=norm)),
        UnitDef("conv2", lambda: ConvNormAct(w, 2 * w, norm=norm, pool=True)),
        UnitDef("fc1", lambda: nn.Sequential(nn.Flatten(), nn.Linear(2 * w * 16, 64), nn.ReLU())),
        UnitDef("out", lambda: nn.Linear(64, num_classes)),
    )
    return ModelSpec(
        name="cnn-digits",
        description="small CNN for 8x8 digits (two convolutions, two linear layers)",
        units=units,
        input_shape=(1, 8, 8),
        input_dtype=torch.float32,
        num_classes=num_classes,
        dataset="digits",
        seed=seed,
    )


_IMAGE_DATA = {"shape": (3, 32, 32)}


def _linear_head(features: int, classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(features, classes))


def _pooled_head(channels: int, classes: int) -> nn.Module:
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes))


def _vgg11(seed: int, num_classes: int = 10, norm: str = "group", width: int = 64) -> ModelSpec:
    # (out channels as a multiple of width, pool after) for the eight 3x3 convolutions.
    cfg = [
        (1, True),
        (2, True),
        (4, False),
        (4, True),
        (8, False),
        (8, True),
        (8, False),
        (8, True),
    ]
    units, cin = [], 3
    for i, (mult, pool) in enumerate(cfg, start=1):
        cout = mult * width
        units.append(UnitDef(f"conv{i}", partial(ConvNormAct, cin, cout, norm=norm, pool=pool)))
        cin = cout
    units.append(UnitDef("head", partial(_linear_head, cin, num_classes)))
    return ModelSpec(
        name="vgg11",
        description="VGG-11 for 32x32 images (CIFAR layout, one linear classifier)",
        units=tuple(units),
        input_shape=(3, 32, 32),
        input_dtype=torch.float32,
        num_classes=num_classes,
        dataset="synthetic-images",
        dataset_options=dict(_IMAGE_DATA),
        seed=seed,
    )


def _resnet18(seed: int, num_classes: int = 10, norm: str = "group", width: int = 64) -> ModelSpec:
    w = width
    units = [UnitDef("stem", lambda: ConvNormAct(3, w, norm=norm))]
    cin = w
    for stage, (mult, stride) in enumerate([(1, 1), (2, 2), (4, 2), (8, 2)], start=1):
        cout = mult * w
        for block in range(2):
            s = stride if block == 0 else 1
            units.append(UnitDef(f"layer{stage}_{block}", partial(BasicBlock, cin, cout, s, norm)))
            cin = cout
    units.append(UnitDef("head", partial(_pooled_head, cin, num_classes)))
    return ModelSpec(
        name="resnet18",
        description="ResNet-18 for 32x32 images (CIFAR stem; each basic block is one unit)",
        units=tuple(units),
        input_shape=(3, 32, 32),
        input_dtype=torch.float32,
        num_classes=num_classes,
        dataset="synthetic-images",
        dataset_options=dict(_IMAGE_DATA),
        seed=seed,
    )


# (expansion, out channels, repeats, first stride): MobileNetV2 with CIFAR strides.
_MBV2 = [
    (1, 16, 1, 1),
    (6, 24, 2, 1),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
]


def _mobilenetv2(seed: int, num_classes: int = 10, norm: str = "group") -> ModelSpec:
    units = [UnitDef("stem", lambda: ConvNormAct(3, 32, norm=norm, act=nn.ReLU6))]
    cin, index = 32, 0
    for t, c, n, s in _MBV2:
        for r in range(n):
            stride = s if r == 0 else 1
            build = partial(InvertedResidual, cin, c, stride, t, norm)
            units.append(UnitDef(f"block{index}", build))
            cin, index = c, index + 1
    units.append(UnitDef("conv_last", lambda: ConvNormAct(320, 1280, 1, norm=norm, act=nn.ReLU6)))
    units.append(UnitDef("head", partial(_pooled_head, 1280, num_classes)))
    return ModelSpec(
        name="mobilenetv2",
        description="MobileNetV2 for 32x32 images (CIFAR strides; each block is one unit)",
        units=tuple(units),
        input_shape=(3, 32, 32),
        input_dtype=torch.float32,
        num_classes=num_classes,
        dataset="synthetic-images",
        dataset_options=dict(_IMAGE_DATA),
        seed=seed,
    )


def _gpt_mini(
    seed: int,
    vocab_size: int = 128,
    block_size: int = 64,
    d_model: int = 128,
    n_head: int = 4,
    n_layer: int = 4,
    attention: str = "auto",
) -> ModelSpec:
    units = [UnitDef("embed", lambda: TokenEmbedding(vocab_size, block_size, d_model))]
    block = partial(TransformerBlock, d_model, n_head, block_size, attention)
    for i in range(n_layer):
        units.append(UnitDef(f"block{i}", block))
    units.append(UnitDef("head", lambda: LMHead(d_model, vocab_size)))
    return ModelSpec(
        name="gpt-mini",
        description="small decoder-only transformer, char-level (pre-norm blocks)",
        units=tuple(units),
        input_shape=(block_size,),
        input_dtype=torch.int64,
        num_classes=vocab_size,
        dataset="text",
        dataset_options={"block_size": block_size},
        seed=seed,
    )


NORMS = ("group", "batch", "none")
"""Normalisation choices; see [Note: normalisation in pipelines] in :mod:`edge.models.units`."""

MODELS: dict[str, Callable[..., ModelSpec]] = {
    "mlp": _mlp,
    "cnn-digits": _cnn_digits,
    "vgg11": _vgg11,
    "resnet18": _resnet18,
    "mobilenetv2": _mobilenetv2,
    "gpt-mini": _gpt_mini,
}

_CLASSES = (1, 1 << 20)
OPTION_BOUNDS: dict[str, dict[str, tuple[int, int]]] = {
    "mlp": {"in_features": (1, 1 << 20), "hidden": (1, 1 << 16), "depth": (2, 1024)},
    "cnn-digits": {"width": (1, 4096)},
    "vgg11": {"width": (1, 1024)},
    "resnet18": {"width": (1, 1024)},
    "mobilenetv2": {},
    "gpt-mini": {
        "vocab_size": (1, 1 << 20),
        "block_size": (1, 8192),
        "d_model": (1, 1 << 15),
        "n_head": (1, 1024),
        "n_layer": (1, 1024),
    },
}
"""Per zoo model, the inclusive range of each integer option (``num_classes`` of every
classifier: 1 to 2^20); ``norm`` is one of :data:`NORMS`, gpt-mini's ``attention`` one
of :data:`~edge.models.units.ATTENTIONS`. See [Note: bounded zoo options]."""
for _name, _bounds in OPTION_BOUNDS.items():
    if _name != "gpt-mini":
        _bounds["num_classes"] = _CLASSES

MAX_MODEL_ELEMENTS = 1 << 31
"""Most parameters and buffers a zoo model built with options may have."""
MAX_SAMPLE_ELEMENTS = 1 << 28
"""Most elements of any one tensor the forward pass of one sample may make."""


def list_models() -> list[str]:
    """Names of the zoo models."""
    return list(MODELS)


def get_model(
    name: str, seed: int = 0, *, allow_code: CodeAllowance = ANY_CODE, **options: Any
) -> ModelSpec:
    """The spec of a zoo model, or of a user model named ``package.module:function``
    whose module ``allow_code`` lets in ([Note: user code on devices]).

    ``options`` are the model's keyword arguments (``num_classes``, ``norm``,
    ``width``...); an unknown option is refused with the list of known ones.
    """
    if ":" in name:
        from edge.models.flatten import user_model

        check_model_options(name, options)
        return user_model(name, seed=seed, allow_code=allow_code, **options)
    check_model_options(name, options)
    try:
        spec = MODELS[name](seed, **options)
    except ValueError as exc:
        raise UserError(f"model {name}: {exc}") from None
    if options:  # the defaults are within bounds (a test keeps them so)
        elements, largest = model_size(name, tuple(sorted(options.items())))
        if elements > MAX_MODEL_ELEMENTS:
            raise UserError(
                f"model {name}: these options make more than {MAX_MODEL_ELEMENTS:,} "
                "parameters and buffers (the zoo's bound)"
            )
        if largest > MAX_SAMPLE_ELEMENTS:
            raise UserError(
                f"model {name}: these options make a tensor of {largest:,} elements for one "
                f"sample, more than the zoo's bound of {MAX_SAMPLE_ELEMENTS:,}"
            )
    return spec


def check_model_options(name: str, options: Mapping[str, Any]) -> None:
    """A one-line :class:`UserError` unless ``name`` is a zoo model (or a user model's
    ``package.module:function``) and ``options`` are what it takes, within bounds
    ([Note: options are data], [Note: bounded zoo options]); nothing is built or imported.

    Call it before passing options on as keywords: a reserved name (``seed``,
    ``name``, ``allow_code``) would clash with the call itself.
    """
    if ":" in name:
        check_reserved(f"model {name}", "model_options", options, MODEL_RESERVED)
        return
    if name not in MODELS:
        import difflib

        close = difflib.get_close_matches(name, MODELS, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise UserError(f"model: unknown model {name!r} (known: {', '.join(MODELS)}){hint}")
    check_options(f"model {name}", "model_options", MODELS[name], options, MODEL_RESERVED)
    if options.get("norm", "group") not in NORMS:
        raise UserError(f"model {name}: norm: {options['norm']!r} is not one of {', '.join(NORMS)}")
    if options.get("attention", "auto") not in ATTENTIONS:
        raise UserError(
            f"model {name}: attention: {options['attention']!r} is not one of "
            f"{', '.join(ATTENTIONS)}"
        )
    _check_bounds(name, options)


def _check_bounds(name: str, options: Mapping[str, Any]) -> None:
    """A :class:`UserError` naming the first integer option outside its range."""
    for key, (low, high) in OPTION_BOUNDS[name].items():
        value = options.get(key, low)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise UserError(
                f"model {name}: {key} must be an integer from {low} to {high} (got {value!r})"
            )


class _LargestTensor(TorchFunctionMode):
    """Notes the most elements of any tensor a torch function returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.elements = 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for item in out if isinstance(out, tuple | list) else (out,):
            if isinstance(item, torch.Tensor):
                self.elements = max(self.elements, item.numel())
        return out


@functools.lru_cache(maxsize=64)
def model_size(name: str, options: tuple[tuple[str, Any], ...] = ()) -> tuple[int, int]:
    """``(parameters and buffers, largest tensor of one sample's forward)`` of zoo model
    ``name`` built with ``options``, counted on the ``meta`` device (nothing is allocated).

    Counting stops at the first unit that takes the total past
    :data:`MAX_MODEL_ELEMENTS` (the largest tensor is then 0: nothing ran). Options must
    already be within :data:`OPTION_BOUNDS`; options that cannot make a model raise
    :class:`UserError`.
    """
    spec = MODELS[name](0, **dict(options))
    try:
        units, elements = [], 0
        with torch.device("meta"):
            for unit in spec.units:
                units.append(unit.build())
                elements += sum(t.numel() for t in (*units[-1].parameters(), *units[-1].buffers()))
                if elements > MAX_MODEL_ELEMENTS:
                    return elements, 0
            x = torch.zeros((1, *spec.input_shape), dtype=spec.input_dtype)
        with torch.no_grad(), _LargestTensor() as largest:
            for module in units:
                x = module(x)
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        why = str(exc).replace("\n", " ")
        raise UserError(f"model {name}: these options do not make a model ({why})") from None
    return elements, largest.elements


def parse_options(pairs: Sequence[str]) -> dict[str, Any]:
    """Parse ``key=value`` command-line options; values become int, float, bool or str."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise UserError(f"option {pair!r} is not of the form key=value")
        value: Any = raw
        for convert in (int, float):
            try:
                value = convert(raw)
                break
            except ValueError:
                continue
        if raw in ("true", "false"):
            value = raw == "true"
        out[key] = value
    return out
