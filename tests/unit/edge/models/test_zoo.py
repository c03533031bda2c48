"""The zoo's core promise: segments built apart equal the whole model, bit for bit."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from edge.config import TrainConfig
from edge.errors import UserError
from edge.models.units import ATTENTIONS
from edge.models.zoo import (
    MAX_MODEL_ELEMENTS,
    MAX_SAMPLE_ELEMENTS,
    MODELS,
    NORMS,
    OPTION_BOUNDS,
    UnitDef,
    get_model,
    list_models,
    model_size,
    parse_options,
)

REQUIRED = {"mlp", "cnn-digits", "vgg11", "resnet18", "mobilenetv2", "gpt-mini"}


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _batch(spec, n: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    x = spec.example_input(n, seed=1)
    out_shape = (n, *spec.input_shape) if spec.name == "gpt-mini" else (n,)
    y = torch.randint(0, spec.num_classes, out_shape, generator=torch.Generator().manual_seed(2))
    return x, y


def _reference(spec, x, y):
    model = spec.build()
    out = model(x)
    loss = _loss(out, y)
    loss.backward()
    grads = {k: p.grad for k, p in model.named_parameters()}
    return model, out, loss, grads


def _run_chain(spec, cuts: list[int], x, y):
    """Run segments built separately, passing tensors between them as devices would."""
    bounds = [0, *cuts, spec.num_units]
    segments = [spec.build_segment(a, b) for a, b in itertools.pairwise(bounds)]
    inputs, outputs = [], []
    h = x
    for seg in segments:
        h = h.detach().requires_grad_(h.is_floating_point())
        inputs.append(h)
        h = seg(h)
        outputs.append(h)
    loss = _loss(h, y)
    loss.backward()
    # Backward across the cuts, last stage first, as the pipeline sends gradients.
    for i in range(len(segments) - 2, -1, -1):
        outputs[i].backward(inputs[i + 1].grad)
    grads = {}
    for seg in segments:
        grads.update({k: p.grad for k, p in seg.named_parameters()})
    return segments, h, loss, grads


def test_zoo_has_the_required_models() -> None:
    assert set(list_models()) >= REQUIRED


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_every_cut_gives_the_whole_models_output_and_gradients_exactly(name: str) -> None:
    spec = get_model(name)
    x, y = _batch(spec)
    model, ref_out, ref_loss, ref_grads = _reference(spec, x, y)
    assert all(g is not None for g in ref_grads.values())
    cut_sets = [[k] for k in range(1, spec.num_units)] + [list(range(1, spec.num_units))]
    for cuts in cut_sets:
        segments, out, loss, grads = _run_chain(spec, cuts, x, y)
        assert torch.equal(out, ref_out), f"{name} cut at {cuts}: output differs"
        assert torch.equal(loss, ref_loss)
        assert grads.keys() == ref_grads.keys()
        for key, ref in ref_grads.items():
            assert torch.equal(grads[key], ref), f"{name} cut at {cuts}: grad of {key} differs"
    # Initial weights agree too: the segments' state dicts make up the whole one.
    whole = model.state_dict()
    parts: dict[str, torch.Tensor] = {}
    for seg in segments:
        parts.update(seg.state_dict())
    assert parts.keys() == whole.keys()


def test_segment_builds_only_its_own_units() -> None:
    spec = get_model("resnet18")
    built: list[str] = []

    def counting(unit: UnitDef) -> UnitDef:
        def build():
            built.append(unit.name)
            return unit.build()

        return UnitDef(unit.name, build)

    spied = dataclasses.replace(spec, units=tuple(counting(u) for u in spec.units))
    segment = spied.build_segment(3, 6)
    assert built == spec.unit_names[3:6]
    assert list(dict(segment.named_children())) == spec.unit_names[3:6]
    assert (segment.start, segment.end) == (3, 6)


def test_initialisation_does_not_depend_on_the_callers_rng_and_follows_the_seed() -> None:
    torch.manual_seed(123)
    a = get_model("cnn-digits", seed=5).build_segment(1, 2).state_dict()
    torch.manual_seed(999)
    b = get_model("cnn-digits", seed=5).build_segment(1, 2).state_dict()
    c = get_model("cnn-digits", seed=6).build_segment(1, 2).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    before = torch.random.get_rng_state()
    get_model("mlp").build()
    assert torch.equal(before, torch.random.get_rng_state())


def test_bad_model_names_ranges_and_options_are_refused() -> None:
    with pytest.raises(UserError, match=r"unknown model 'resnet19'.*did you mean resnet18"):
        get_model("resnet19")
    with pytest.raises(UserError, match=r"unknown option 'colour' \(takes: in_features, hidden"):
        get_model("mlp", colour="red")
    with pytest.raises(UserError, match=r"segment \[3, 2\)"):
        get_model("mlp").build_segment(3, 2)
    with pytest.raises(UserError, match="norm"):
        get_model("vgg11", norm="layer").build()
    assert parse_options(["norm=batch", "width=32", "p=0.5", "x=true"]) == {
        "norm": "batch",
        "width": 32,
        "p": 0.5,
        "x": True,
    }
    with pytest.raises(UserError, match="key=value"):
        parse_options(["width"])


def test_batchnorm_variant_exists_and_defaults_are_groupnorm() -> None:
    default = get_model("resnet18").build()
    batch = get_model("resnet18", norm="batch").build()
    assert any(isinstance(m, torch.nn.GroupNorm) for m in default.modules())
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in default.modules())
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in batch.modules())


def test_every_option_of_every_zoo_model_is_bounded_and_the_defaults_fit() -> None:
    """See [Note: bounded zoo options]: ``norm`` is one of NORMS, ``attention`` one of
    ATTENTIONS, every other option has a range, the defaults lie in it, and the default
    models are within both size bounds."""
    choices = {"norm": NORMS, "attention": ATTENTIONS}
    for name, builder in MODELS.items():
        params = inspect.signature(builder).parameters
        for option, allowed in choices.items():
            assert option not in params or params[option].default in allowed, (name, option)
        options = {p: params[p].default for p in params if p not in ("seed", *choices)}
        assert set(options) == set(OPTION_BOUNDS[name]), name
        for option, default in options.items():
            low, high = OPTION_BOUNDS[name][option]
            assert low <= default <= high, (name, option)
        elements, largest = model_size(name)
        assert 0 < elements <= MAX_MODEL_ELEMENTS and 0 < largest <= MAX_SAMPLE_ELEMENTS


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("mlp", {"depth": 10**9}, "depth must be an integer from 2 to 1024 (got 1000000000)"),
        ("mlp", {"depth": 1e9}, "option depth: input should be a valid integer (got 1000000000.0)"),
        ("mlp", {"depth": 1}, "depth must be an integer from 2 to 1024 (got 1)"),
        ("mlp", {"hidden": 10**9}, "hidden must be an integer from 1 to 65536 (got 1000000000)"),
        ("mlp", {"hidden": True}, "option hidden: input should be a valid integer (got True)"),
        ("vgg11", {"width": 10**9}, "width must be an integer from 1 to 1024 (got 1000000000)"),
        ("cnn-digits", {"width": 0}, "width must be an integer from 1 to 4096 (got 0)"),
        ("resnet18", {"num_classes": -3}, "num_classes must be an integer from 1 to 1048576"),
        ("gpt-mini", {"n_layer": "4"}, "option n_layer: input should be a valid integer (got '4')"),
        ("gpt-mini", {"block_size": 10**6}, "block_size must be an integer from 1 to 8192"),
        (
            "mlp",
            {"hidden": 65536, "depth": 1024},
            "these options make more than 2,147,483,648 parameters and buffers (the zoo's bound)",
        ),
        (
            "vgg11",
            {"width": 1024},
            "these options make more than 2,147,483,648 parameters and buffers (the zoo's bound)",
        ),
        (
            "gpt-mini",
            {"block_size": 8192, "n_head": 64},  # 64 heads x 8192^2 attention scores
            "these options make a tensor of 4,294,967,296 elements for one sample, more than "
            "the zoo's bound of 268,435,456",
        ),
        (
            "gpt-mini",
            {"d_model": 100, "n_head": 3},
            "these options do not make a model (d_model (100) must be divisible by n_head (3))",
        ),
    ],
)
def test_options_out_of_bounds_are_refused_in_one_line(
    name: str, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(UserError) as refused:
        get_model(name, **options)
    assert refused.value.message.startswith(f"model {name}: {message}"), refused.value.message
    # A job file or the train CLI: the config refuses what it can check without building
    # the model (names, types, ranges), and resolving the data refuses the rest.
    with pytest.raises((ValidationError, UserError), match=f"model {name}: "):
        TrainConfig(model=name, model_options=options, steps=1, batch_size=4).resolve_data()


def test_large_models_within_the_bounds_are_accepted() -> None:
    """The GPU tier's gpt-mini (bench/gpu.py: 1.42 B parameters) and a wide CNN."""
    gpu = {"d_model": 2048, "n_layer": 24, "n_head": 16, "block_size": 1024, "vocab_size": 50304}
    assert get_model("gpt-mini", **gpu).num_units == 26
    elements, largest = model_size("gpt-mini", tuple(sorted(gpu.items())))
    assert 1.4e9 < elements <= MAX_MODEL_ELEMENTS and largest == 1024 * 50304
    assert get_model("mlp", hidden=8192, depth=16).num_units == 16
    assert get_model("resnet18", width=256).num_units == 10
