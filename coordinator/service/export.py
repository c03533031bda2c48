"""ONNX export of trained weights: the coordinator's hand-off to inference runtimes.

This module owns turning a trained state dict (the safetensors file a job
returns, keys ``{unit_name}.{param}``) into a standalone ONNX model, and
checking that model against torch:

- :func:`load_weights` builds a zoo model and loads the weights *strictly*: a
  missing or unexpected key, a wrong shape or unreadable bytes is a one-line
  :class:`~edge.errors.UserError`;
- :func:`export_onnx` exports it with a dynamic batch axis (input ``input``,
  output ``logits``) and validates the result with ``onnx.checker``;
- :func:`check_onnx` runs the export under onnxruntime (CPU) on a seeded batch
  of another size than the export batch and compares it with torch.

onnx and onnxruntime come with the ``export`` extra (``pip install
'edgetrain[export]'``), not with the coordinator's: without them this module
still imports, and exporting or checking raises
:class:`~edge.errors.MissingExtraError` in one line naming that install (the
REST route answers 501 with it).

Exporter: the legacy TorchScript exporter (``torch.onnx.export(..., dynamo=False)``).
Checked on torch 2.13 for every zoo model (mlp, cnn-digits, vgg11, resnet18,
mobilenetv2, gpt-mini): it needs nothing beyond ``onnx``, works offline, and
exports each model in well under a second. The dynamo exporter (torch's default
since 2.9) imports ``onnxscript``, which is not a dependency here; with it
installed it also exports every zoo model correctly, but 5-10x slower. The
legacy tracer records ``x.shape`` reads as graph ops, so gpt-mini's reshapes
follow the batch size, and its causal mask (a non-persistent buffer) is folded
into the graph as a constant. Only the batch axis is dynamic: gpt-mini's
sequence length is the block size it was exported with. The legacy exporter
is deprecated in torch; if a future torch removes it, switch to ``dynamo=True``
with ``dynamic_shapes`` and add ``onnxscript`` to the ``export`` extra.
"""

from __future__ import annotations

import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
from torch import nn

from edge.errors import UserError, needs_extra
from edge.models.zoo import ModelSpec, get_model

__all__ = [
    "ATOL",
    "MAX_OPSET",
    "MIN_OPSET",
    "RTOL",
    "OnnxMismatchError",
    "check_onnx",
    "export_and_check",
    "export_onnx",
    "load_weights",
]

MIN_OPSET = 13
"""Lowest opset accepted (Softmax on any axis, Split with input sizes)."""
MAX_OPSET = 20
"""Highest opset the TorchScript exporter supports."""

RTOL = 1e-4
ATOL = 1e-4
"""Tolerance of :func:`check_onnx`, elementwise as ``numpy.allclose``:
``|onnx - torch| <= ATOL + RTOL * |torch|``."""


class OnnxMismatchError(UserError):
    """onnxruntime's output differs from torch's beyond the tolerance (exit status 1)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, exit_code=1)


def _decode(weights: dict[str, torch.Tensor] | bytes) -> dict[str, torch.Tensor]:
    if isinstance(weights, bytes | bytearray | memoryview):
        try:
            return safetensors.torch.load(bytes(weights))
        except Exception as exc:
            raise UserError(f"weights: not a safetensors file ({exc})".replace("\n", " ")) from None
    bad = [k for k, v in weights.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise UserError(f"weights: {bad[0]!r} is a {type(weights[bad[0]]).__name__}, not a tensor")
    return weights


def _keys(keys: list[str], limit: int = 3) -> str:
    more = f" (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def load_weights(
    model: str,
    weights: dict[str, torch.Tensor] | bytes,
    model_options: dict[str, Any] | None = None,
) -> tuple[ModelSpec, nn.Module]:
    """Build zoo ``model`` with ``model_options``, load ``weights`` strictly, in eval mode.

    ``weights`` is a state dict or serialized safetensors bytes. Keys and shapes
    must match the built model's state dict exactly; anything else is a
    one-line :class:`UserError` naming the first offending keys.
    """
    spec = get_model(model, **(model_options or {}))
    module = spec.build()
    state = _decode(weights)
    expected = module.state_dict()
    missing = [k for k in expected if k not in state]
    if missing:
        raise UserError(f"weights for {model}: missing {len(missing)} key(s): {_keys(missing)}")
    unexpected = [k for k in state if k not in expected]
    if unexpected:
        raise UserError(
            f"weights for {model}: {len(unexpected)} unexpected key(s): {_keys(unexpected)}"
        )
    for key, want in expected.items():
        got = state[key]
        if got.shape != want.shape:
            raise UserError(
                f"weights for {model}: {key} has shape {tuple(got.shape)}, "
                f"expected {tuple(want.shape)}"
            )
    module.load_state_dict(state, strict=True)
    return spec, module.eval()


def export_onnx(
    model: str,
    weights: dict[str, torch.Tensor] | bytes,
    *,
    model_options: dict[str, Any] | None = None,
    batch_size: int = 1,
    opset: int | None = None,
) -> bytes:
    """The serialized ONNX model of zoo ``model`` with ``weights``, batch axis dynamic.

    The graph is traced on ``spec.example_input(batch_size)``; its input is
    named ``input`` (the model's input dtype: float32 images or int64 token
    ids) and its output ``logits``, both with dimension 0 named ``batch``.
    ``opset`` defaults to the exporter's (20 on torch 2.13). The result passes
    ``onnx.checker.check_model(full_check=True)``.
    """
    with needs_extra("export", "ONNX export"):
        import onnx
    if batch_size < 1:
        raise UserError(f"export: batch size must be at least 1 (got {batch_size})")
    if opset is not None and not MIN_OPSET <= opset <= MAX_OPSET:
        raise UserError(f"export: opset {opset} is not in {MIN_OPSET}..{MAX_OPSET}")
    spec, module = load_weights(model, weights, model_options)
    example = spec.example_input(batch_size)
    with tempfile.TemporaryDirectory(prefix="edgetrain-onnx-") as tmp:
        path = Path(tmp) / "model.onnx"
        with warnings.catch_warnings():
            # The exporter's own deprecation notice, and tracer notes on Python
            # constants (gpt-mini's 1/sqrt(head size)) that are constants indeed.
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            torch.onnx.export(
                module,
                (example,),
                path,
                dynamo=False,
                opset_version=opset,
                input_names=["input"],
                output_names=["logits"],
                dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
            )
        data = path.read_bytes()
    try:
        onnx.checker.check_model(onnx.load_from_string(data), full_check=True)
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "invalid"
        raise RuntimeError(f"export of {model}: onnx checker refused the model: {first}") from exc
    return data


def check_onnx(
    onnx_bytes: bytes,
    model: str,
    weights: dict[str, torch.Tensor] | bytes,
    *,
    model_options: dict[str, Any] | None = None,
    batch_size: int = 3,
    seed: int = 1,
    rtol: float = RTOL,
    atol: float = ATOL,
) -> float:
    """Max abs difference between onnxruntime (CPU) and torch on a seeded batch.

    The batch (``spec.example_input(batch_size, seed)``) defaults to size 3, not
    the export's 1, so a pass also proves the batch axis is dynamic. Raises
    :class:`OnnxMismatchError` when the shapes differ or any element fails
    ``|onnx - torch| <= atol + rtol * |torch|``.
    """
    with needs_extra("export", "ONNX check"):
        import onnxruntime
    spec, module = load_weights(model, weights, model_options)
    batch = spec.example_input(batch_size, seed=seed)
    with torch.no_grad():
        want = module(batch).numpy()
    session = onnxruntime.InferenceSession(onnx_bytes, providers=["CPUExecutionProvider"])
    got = np.asarray(session.run(["logits"], {"input": batch.numpy()})[0])
    if got.shape != want.shape:
        raise OnnxMismatchError(
            f"onnx check of {model}: output shape {got.shape}, torch gives {want.shape}"
        )
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    worst = float(diff.max()) if diff.size else 0.0
    if not np.all(diff <= atol + rtol * np.abs(want)):
        raise OnnxMismatchError(
            f"onnx check of {model}: max abs difference {worst:.3g} from torch at batch "
            f"{batch_size} exceeds atol {atol:g} + rtol {rtol:g} * |torch|"
        )
    return worst


def export_and_check(
    model: str,
    weights: dict[str, torch.Tensor] | bytes,
    *,
    model_options: dict[str, Any] | None = None,
    opset: int | None = None,
) -> tuple[bytes, float, float]:
    """Export then check: the ONNX bytes, the max abs difference and the export seconds."""
    start = time.perf_counter()
    data = export_onnx(model, weights, model_options=model_options, opset=opset)
    seconds = time.perf_counter() - start
    diff = check_onnx(data, model, weights, model_options=model_options)
    return data, diff, seconds
