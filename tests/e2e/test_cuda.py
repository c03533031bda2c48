"""On a CUDA GPU: the server tier's stages train as the CPU reference does, compiled too.

Skipped without a GPU (CI has none); ``bench/gpu_check.sh`` runs this file first on a
machine that has one. Each run is a real ``edgetrain train`` process:

- two ranks over torch.distributed (NCCL), each stage on the GPU, fp32;
- the same with ``--compile`` (every stage under ``torch.compile``; its compiling
  reported apart, [Note: compiled stages] in :mod:`edge.runtime.compiling`);
- a hybrid job over MQTT: a CPU edge agent feeding a server agent on the GPU
  (``--servers 1 --device cuda``), its frames crossing from host to device and back.

Losses and weights are held to the independent CPU reference loop
(:mod:`support.reference`) within its tolerance (1e-5): TF32 is off in torch by
default for fp32 matmuls, so a GPU's fp32 differs from a CPU's by rounding only.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch
from support.reference import ReferenceRun, assert_matches, train_reference
from test_train_dist_cli import edgetrain, ok_json

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEPS = 4
JOB = ["--model", "gpt-mini", "--steps", str(STEPS), "-b", "8", "-m", "2", "--threads", "2"]
JOB += ["--option", "n_layer=2", "--option", "d_model=64", "--option", "block_size=32"]
OPTIONS = {"n_layer": 2, "d_model": 64, "block_size": 32}


def _reference() -> ReferenceRun:
    return train_reference(
        "gpt-mini", steps=STEPS, batch_size=8, seed=0, model_options=dict(OPTIONS)
    )


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_dist_stages_on_the_gpu_train_as_the_cpu_reference(tmp_path: Path, compiled: bool) -> None:
    weights = tmp_path / "w.safetensors"
    flags = ["--transport", "dist", "--devices", "2", "--partition", "even", "--device", "cuda"]
    out = ok_json(
        edgetrain(
            "train",
            *JOB,
            *flags,
            *(["--compile"] if compiled else []),
            "--json",
            "--save-weights",
            str(weights),
        )
    )
    assert len(out["plan"]["stages"]) == 2
    assert (out["compile_s"] > 0) is compiled
    assert_matches(out["losses"], safetensors.torch.load_file(weights), _reference())


def test_a_cpu_agent_feeds_a_gpu_agent_as_the_cpu_reference(tmp_path: Path) -> None:
    weights = tmp_path / "w.safetensors"
    flags = ["--devices", "2", "--servers", "1", "--device", "cuda", "--partition", "even"]
    out = ok_json(edgetrain("train", *JOB, *flags, "--json", "--save-weights", str(weights)))
    assert len(out["plan"]["stages"]) == 2 and out["servers"]
    assert_matches(out["losses"], safetensors.torch.load_file(weights), _reference())
