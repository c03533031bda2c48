"""GPU device profiles: device names, the CUDA-less error, FLOP arithmetic, JSON round trips.

Everything here runs on a CPU-only machine except the two tests marked to need
CUDA, which measure a real GPU briefly.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

import pytest
import torch
import typer
from typer.testing import CliRunner

from edge.errors import UserError
from edge.problem import DeviceSpec
from edge.profiling import matmul as matmul_mod
from edge.profiling.device import MeasuredProfile, profile_device
from edge.profiling.matmul import GpuProfile, gpu_profile, matmul_flops, resolve_device, tflops_rate
from edgetrain.cli.profile import profile_command

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

H200ISH = GpuProfile(
    device="cuda:0",
    name="NVIDIA H200",
    capability="9.0",
    fp32_tflops=51.5,
    bf16_tflops=702.25,
    fp32_size=4096,
    bf16_size=8192,
    fp32_rounds=40,
    bf16_rounds=38,
    tf32=False,
    memory_total_bytes=150_011_101_184,
    memory_free_bytes=149_000_000_000,
)


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# -- pure arithmetic -----------------------------------------------------------------------


def test_matmul_flops_counts_a_multiply_and_an_add_per_term() -> None:
    assert matmul_flops(8192, 8192, 8192) == 2 * 8192**3 == 1_099_511_627_776
    assert matmul_flops(2, 3, 4) == 48  # (2 x 3) @ (3 x 4): 8 outputs, 3 terms each, 2 FLOPs


def test_tflops_rate_is_flops_over_seconds_in_units_of_1e12() -> None:
    assert tflops_rate(2e12, 2.0) == 1.0
    assert tflops_rate(matmul_flops(8192, 8192, 8192), 0.5) == 2 * 1_099_511_627_776 / 1e12
    with pytest.raises(ValueError, match="positive"):
        tflops_rate(1e12, 0.0)


def test_a_gpu_profile_gives_the_rate_of_the_training_precision() -> None:
    assert H200ISH.tflops("bf16") == 702.25
    assert H200ISH.tflops("fp32") == 51.5


# -- device names and the CUDA-less error --------------------------------------------------


def test_cpu_resolves_and_other_names_are_one_line_errors() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    for bad in ("mps", "bogus", "cuda:x"):
        with pytest.raises(UserError, match="expected cpu, cuda or cuda:N") as err:
            resolve_device(bad)
        assert "\n" not in err.value.message and err.value.exit_code == 2


@pytest.mark.usefixtures("no_cuda")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_cuda_is_a_clear_one_line_error(device: str) -> None:
    for call in (
        lambda: resolve_device(device),
        lambda: gpu_profile(device, seconds=0.01),
        lambda: profile_device(device=device, seconds=0.01),
    ):
        with pytest.raises(UserError) as err:
            call()
        message = err.value.message
        assert message.startswith(f"device {device!r}: CUDA is not available here")
        assert torch.__version__ in message and "\n" not in message


def test_a_gpu_index_past_the_visible_ones_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UserError, match=r"'cuda:1': only 1 GPU\(s\) are visible"):
        resolve_device("cuda:1")


def _cli(*args: str) -> Any:
    app = typer.Typer()
    app.command()(profile_command)
    return CliRunner().invoke(app, list(args))


@pytest.mark.usefixtures("no_cuda")
def test_the_command_names_its_flags_in_errors() -> None:
    result = _cli("--device", "cuda", "--seconds", "0.05")
    assert isinstance(result.exception, UserError)
    assert result.exception.message.startswith("--device 'cuda': CUDA is not available here")
    result = _cli("--precision", "fp16")
    assert isinstance(result.exception, UserError)
    assert result.exception.message == "--precision: expected fp32 or bf16 (got 'fp16')"


def test_an_unknown_precision_is_refused() -> None:
    with pytest.raises(UserError, match="precision 'fp16': expected one of fp32, bf16"):
        profile_device(seconds=0.01, precision="fp16")  # type: ignore[arg-type]


# -- the CPU path, and what a GPU profile looks like as JSON ---------------------------------


def test_the_cpu_path_reports_the_cpu() -> None:
    measured = profile_device(device_id="box", seconds=0.05)
    assert measured.gpu is None and "gpu" not in measured.details
    assert measured.details["device"] == "cpu" and measured.details["precision"] == "fp32"
    assert measured.details["matmul"]["dtype"] == "torch.float32"
    assert measured.memory_bytes > 0 and measured.gflops > 0
    bf16 = profile_device(device_id="box", seconds=0.05, precision="bf16")
    assert bf16.details["matmul"]["dtype"] == "torch.bfloat16"
    assert bf16.details["precision"] == "bf16" and bf16.gpu is None


def test_a_gpu_profile_round_trips_through_json_and_the_device_spec() -> None:
    details = {
        "link_source": "default",
        "device": "cuda:0",
        "precision": "bf16",
        "gpu": asdict(H200ISH),
    }
    measured = MeasuredProfile(
        "gpu-0", 702_250.0, H200ISH.memory_free_bytes, 25_000.0, 0.01, details
    )
    assert measured.gpu == H200ISH
    text = json.dumps(measured.to_json())
    spec = DeviceSpec.model_validate_json(text)
    assert spec == measured.to_device_spec()
    assert spec.details is not None
    assert MeasuredProfile(**json.loads(text)).gpu == H200ISH
    old = {"id": "a", "gflops": 1.0, "memory_bytes": 1, "bandwidth_mbps": 1.0, "latency_ms": 0.0}
    assert MeasuredProfile(**old).gpu is None  # payloads from before GPUs stay valid
    assert DeviceSpec.model_validate(old).details is None


def test_tf32_setting_is_restored() -> None:
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        pytest.skip("torch before 2.9 has only allow_tf32")
    before = matmul.fp32_precision
    with matmul_mod._tf32(False):
        assert matmul.fp32_precision == "ieee"
    assert matmul.fp32_precision == before
    with pytest.raises(RuntimeError), matmul_mod._tf32(True):
        assert matmul.fp32_precision == "tf32"
        raise RuntimeError
    assert matmul.fp32_precision == before


# -- on a real GPU ----------------------------------------------------------------------


@needs_cuda
def test_gpu_profile_measures_this_gpu() -> None:
    gpu = gpu_profile("cuda", seconds=0.2)
    assert gpu.device == f"cuda:{torch.cuda.current_device()}" and gpu.name
    assert gpu.bf16_tflops > gpu.fp32_tflops > 0  # tensor cores: bf16 beats fp32 without TF32
    assert 0 < gpu.memory_free_bytes <= gpu.memory_total_bytes
    assert gpu.fp32_rounds >= 3 and gpu.bf16_rounds >= 3 and not gpu.tf32


@needs_cuda
def test_profile_device_on_a_gpu_reports_the_gpu() -> None:
    measured = profile_device("server", seconds=0.2, device="cuda", precision="bf16")
    gpu = measured.gpu
    assert gpu is not None
    assert measured.gflops == gpu.bf16_tflops * 1e3
    assert measured.memory_bytes == gpu.memory_free_bytes
    assert measured.details["matmul"]["dtype"] == "torch.bfloat16"
    spec = DeviceSpec.model_validate_json(json.dumps(measured.to_json()))
    assert spec == measured.to_device_spec() and spec.gflops == measured.gflops
