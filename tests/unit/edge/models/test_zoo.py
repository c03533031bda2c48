"""The zoo's core promise: segments built apart equal the whole model, bit for bit."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import torch.nn.functional as F

from edge.errors import UserError
from edge.models.zoo import UnitDef, get_model, list_models, parse_options

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
    with pytest.raises(UserError, match="known options"):
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
