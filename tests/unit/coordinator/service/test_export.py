"""ONNX export: every zoo model exports, passes the checker and matches torch at another batch."""

from __future__ import annotations

import sys
import time
import tomllib
from collections.abc import Callable
from typing import Any

import onnx
import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from packaging.requirements import Requirement
from support.paths import ROOT

from coordinator.service.export import (
    OnnxMismatchError,
    check_onnx,
    export_onnx,
    load_weights,
)
from edge.errors import MissingExtraError, UserError
from edge.models.zoo import get_model, list_models

# Full-size models (all export in under a second); cnn-digits also with BatchNorm
# so running statistics (and num_batches_tracked) go through the export.
CASES: list[tuple[str, dict[str, Any]]] = [
    ("mlp", {}),
    ("cnn-digits", {}),
    ("cnn-digits", {"norm": "batch"}),
    ("vgg11", {}),
    ("resnet18", {}),
    ("mobilenetv2", {}),
    ("gpt-mini", {}),
]


def _trained(model: str, options: dict[str, Any], steps: int = 3) -> dict[str, torch.Tensor]:
    """Weights after a few SGD steps on seeded random data, so they are not the init."""
    spec = get_model(model, **options)
    net = spec.build().train()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(7)
    for step in range(steps):
        x = spec.example_input(4, seed=100 + step)
        logits = net(x)
        target = torch.randint(0, spec.num_classes, logits.shape[:-1], generator=gen)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


@pytest.fixture(scope="module")
def mlp_weights() -> dict[str, torch.Tensor]:
    return _trained("mlp", {}, steps=1)


def test_cases_cover_the_zoo() -> None:
    assert {name for name, _ in CASES} == set(list_models())


@pytest.mark.parametrize(
    ("model", "options"),
    CASES,
    ids=[f"{m}{o or ''}" for m, o in CASES],
)
def test_export_matches_torch(model: str, options: dict[str, Any]) -> None:
    weights = _trained(model, options)
    init = get_model(model, **options).build().state_dict()
    assert any(not torch.equal(weights[k], init[k]) for k in init), "weights are still the init"

    start = time.perf_counter()
    data = export_onnx(model, weights, model_options=options)
    seconds = time.perf_counter() - start

    proto = onnx.load_from_string(data)
    onnx.checker.check_model(proto, full_check=True)
    (inp,) = proto.graph.input
    (out,) = proto.graph.output
    assert (inp.name, out.name) == ("input", "logits")
    assert inp.type.tensor_type.shape.dim[0].dim_param == "batch"
    assert out.type.tensor_type.shape.dim[0].dim_param == "batch"
    spec = get_model(model, **options)
    want_type = (
        onnx.TensorProto.INT64 if spec.input_dtype == torch.int64 else onnx.TensorProto.FLOAT
    )
    assert inp.type.tensor_type.elem_type == want_type

    diff = check_onnx(data, model, weights, model_options=options, batch_size=3)
    assert diff <= 1e-4
    print(f"{model}{options or ''}: max abs diff {diff:.2e}, export {seconds:.2f} s")


def test_weights_as_safetensors_bytes(mlp_weights: dict[str, torch.Tensor]) -> None:
    blob = safetensors.torch.save(mlp_weights)
    data = export_onnx("mlp", blob, batch_size=2, opset=17)
    assert onnx.load_from_string(data).opset_import[0].version == 17
    assert check_onnx(data, "mlp", blob, batch_size=5) <= 1e-4


def test_check_catches_other_weights(mlp_weights: dict[str, torch.Tensor]) -> None:
    data = export_onnx("mlp", mlp_weights)
    other = {k: v + 0.1 for k, v in mlp_weights.items()}
    with pytest.raises(OnnxMismatchError, match="max abs difference"):
        check_onnx(data, "mlp", other)


def _one_line_user_error(call: Any, match: str) -> None:
    with pytest.raises(UserError, match=match) as info:
        call()
    assert "\n" not in info.value.message


def test_missing_key(mlp_weights: dict[str, torch.Tensor]) -> None:
    weights = {k: v for k, v in mlp_weights.items() if k != "out.bias"}
    _one_line_user_error(lambda: export_onnx("mlp", weights), "missing 1 key.*out.bias")


def test_unexpected_key(mlp_weights: dict[str, torch.Tensor]) -> None:
    weights = {**mlp_weights, "fc9.0.weight": torch.zeros(2, 2)}
    _one_line_user_error(lambda: export_onnx("mlp", weights), "unexpected key.*fc9.0.weight")


def test_wrong_shape(mlp_weights: dict[str, torch.Tensor]) -> None:
    weights = {**mlp_weights, "out.weight": torch.zeros(3, 128)}
    _one_line_user_error(
        lambda: export_onnx("mlp", weights),
        r"out.weight has shape \(3, 128\), expected \(10, 128\)",
    )


def test_weights_of_another_variant(mlp_weights: dict[str, torch.Tensor]) -> None:
    _one_line_user_error(
        lambda: load_weights("mlp", mlp_weights, {"hidden": 64}), "fc1.1.weight has shape"
    )


def test_bad_bytes_opset_and_batch(mlp_weights: dict[str, torch.Tensor]) -> None:
    _one_line_user_error(lambda: export_onnx("mlp", b"not safetensors"), "not a safetensors")
    _one_line_user_error(lambda: export_onnx("mlp", mlp_weights, opset=99), "opset 99")
    _one_line_user_error(lambda: export_onnx("mlp", mlp_weights, batch_size=0), "batch size")


def test_without_the_export_extra_one_line_names_it(
    mlp_weights: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    data = export_onnx("mlp", mlp_weights)
    cases: list[tuple[str, str, Callable[[], object]]] = [
        ("onnx", "ONNX export", lambda: export_onnx("mlp", mlp_weights)),
        ("onnxruntime", "ONNX check", lambda: check_onnx(data, "mlp", mlp_weights)),
    ]
    for module, what, call in cases:
        with monkeypatch.context() as patch:
            patch.setitem(sys.modules, module, None)  # as on a coordinator without [export]
            with pytest.raises(MissingExtraError) as info:
                call()
        assert info.value.message == (
            f"{what} needs the export extras (no module {module!r} here): "
            "pip install 'edgetrain[export]'"
        )


def test_onnx_is_its_own_extra() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    names = {extra: {Requirement(r).name for r in reqs} for extra, reqs in extras.items()}
    assert names["export"] == {"onnx", "onnxruntime"}
    assert not names["coordinator"] & names["export"]
