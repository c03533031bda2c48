"""Sustained matmul rates of this device's CPU and GPUs: the compute side of a profile.

This module owns the compute measurements behind :func:`edge.profiling.device.profile_device`
and ``bench/gpu.py``: a sustained fp32 matmul rate on the CPU
(:func:`matmul_benchmark`), and on a GPU sustained fp32 and bf16 matmul TFLOP/s
timed with CUDA events (:func:`cuda_matmul_benchmark`, :func:`gpu_profile`),
with the device's name and free memory.

Tested in tests/unit/edge/profiling/test_profiler.py::test_matmul_gflops_positive,
::test_matmul_leaves_the_thread_count_alone and
tests/unit/edge/profiling/test_profiler_gpu.py.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch

from edge.errors import UserError

__all__ = [
    "PRECISIONS",
    "GpuProfile",
    "MatmulResult",
    "Precision",
    "cuda_matmul_benchmark",
    "gpu_profile",
    "matmul_benchmark",
    "matmul_flops",
    "measure_matmul_gflops",
    "resolve_device",
    "tflops_rate",
]

Precision = Literal["fp32", "bf16"]
"""The precision a device trains in: plain fp32, or bf16 autocast."""
PRECISIONS: tuple[Precision, ...] = ("fp32", "bf16")


@dataclass(frozen=True)
class MatmulResult:
    gflops: float
    size: int
    repeats: int
    threads: int
    dtype: str
    best_gflops: float = 0.0
    """The fastest single matmul's rate: what this machine does when nothing else runs
    (the cost model compares machines by it, :mod:`coordinator.planner.predict`)."""


def _time_mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> float:
    t0 = time.perf_counter()
    torch.mm(a, b, out=out)
    return time.perf_counter() - t0


def matmul_benchmark(
    dtype: torch.dtype = torch.float32, seconds: float = 2.0, size: int | None = None
) -> MatmulResult:
    """Time repeated ``n x n`` matmuls for about ``seconds``; see :func:`measure_matmul_gflops`."""
    with torch.inference_mode():
        n = size or 256
        while True:  # grow n until one matmul takes >= 20 ms; these runs are the warm-up
            a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
            out = torch.empty(n, n, dtype=dtype)
            took = min(_time_mm(a, b, out) for _ in range(3))  # the first one warms up
            if size is not None or took >= 0.02 or n >= 2048:
                break
            n *= 2
        rates: list[float] = []
        deadline = time.perf_counter() + seconds
        while len(rates) < 3 or (time.perf_counter() < deadline and len(rates) < 10_000):
            rates.append(2.0 * n**3 / _time_mm(a, b, out) / 1e9)
    threads = torch.get_num_threads()  # respected, never changed
    return MatmulResult(
        gflops=statistics.median(rates),
        size=n,
        repeats=len(rates),
        threads=threads,
        dtype=str(dtype),
        best_gflops=max(rates),
    )


def measure_matmul_gflops(
    dtype: torch.dtype = torch.float32, seconds: float = 2.0, size: int | None = None
) -> float:
    """Sustained matmul GFLOP/s of this machine with torch's current thread count.

    ``n`` (unless given) doubles from 256 until one matmul takes at least 20 ms, at
    most 2048 (48 MiB of fp32 operands); those runs double as the warm-up. Then
    matmuls are timed one by one for about ``seconds`` (at least 3), each counted
    as ``2 n^3`` FLOPs. The **median** of the per-matmul rates is returned: on a
    shared, noisy machine it ignores both a repeat that lost the CPU and a short
    turbo burst, so it is the rate a long training run can count on; the best
    repeat would overstate it and the mean lets one stall drag it down.
    """
    return matmul_benchmark(dtype, seconds, size).gflops


# -- GPU ---------------------------------------------------------------------------------

GPU_BF16_SIZE = 8192  # 2 * 8192^3 = 1.1 TFLOP a matmul: an H200 needs ~1.5 ms, long enough
GPU_FP32_SIZE = 4096  # fp32 runs ~15x slower than bf16 on tensor-core GPUs; 2 ms on an H200
_GPU_ROUND_S = 0.05  # matmuls are queued back to back and timed in rounds of about this long
_GPU_WARMUP_S = 0.25  # long enough for the clocks to ramp up and cuBLAS to pick its kernels


def matmul_flops(m: int, k: int, n: int) -> int:
    """FLOPs of an ``(m x k) @ (k x n)`` matmul: one multiply and one add per term."""
    return 2 * m * k * n


def tflops_rate(flops: float, seconds: float) -> float:
    """``flops`` done in ``seconds``, in TFLOP/s (10^12 FLOP per second)."""
    if not seconds > 0:
        raise ValueError(f"seconds must be positive (got {seconds})")
    return flops / seconds / 1e12


def resolve_device(device: str | torch.device) -> torch.device:
    """``"cpu"``, ``"cuda"`` or ``"cuda:N"`` as a ``torch.device`` (CUDA with its index).

    Raises a one-line :class:`UserError` for any other name, when CUDA is asked
    for and ``torch.cuda.is_available()`` is False, or for an index past the
    visible GPUs.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UserError(f"device {str(device)!r}: expected cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise UserError(f"device {str(device)!r}: expected cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        build = torch.version.cuda
        why = "is a CPU-only build" if build is None else f"built for CUDA {build} sees no GPU"
        raise UserError(
            f"device {str(device)!r}: CUDA is not available here "
            f"(torch {torch.__version__} {why}); use cpu"
        )
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= count:
        raise UserError(f"device {str(device)!r}: only {count} GPU(s) are visible")
    return torch.device("cuda", index)


@contextmanager
def _tf32(allowed: bool) -> Iterator[None]:
    """cuBLAS fp32 matmuls with TF32 ``allowed`` or not, restored on exit.

    Through the per-backend ``fp32_precision`` setting where torch has it (2.9+):
    mixing it with the legacy ``allow_tf32`` flag makes torch refuse to read
    either, and saving and restoring ``fp32_precision`` leaves every reading as
    it was. Older torch has only ``allow_tf32``.
    """
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        before = matmul.fp32_precision
        matmul.fp32_precision = "tf32" if allowed else "ieee"
        try:
            yield
        finally:
            matmul.fp32_precision = before
    else:
        was = matmul.allow_tf32
        matmul.allow_tf32 = allowed
        try:
            yield
        finally:
            matmul.allow_tf32 = was


def cuda_matmul_benchmark(
    device: str | torch.device = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    seconds: float = 2.0,
    size: int | None = None,
    *,
    tf32: bool = False,
) -> MatmulResult:
    """Sustained ``n x n`` matmul rate of one GPU; ``gflops`` is GFLOP/s as on the CPU.

    ``n`` is :data:`GPU_BF16_SIZE` for 16-bit types and :data:`GPU_FP32_SIZE`
    otherwise unless given, halved while the three operands would take more than
    half the free GPU memory. After a warm-up of about a quarter of a second
    (clocks ramp up, cuBLAS picks its kernel), matmuls are queued back to back in
    rounds of about 50 ms, each round timed with CUDA events, for about
    ``seconds`` (at least 3 rounds); the **median** round rate is returned, as on
    the CPU. fp32 runs with TF32 off unless ``tf32`` (torch's default for
    matmuls: full fp32 precision), restored afterwards. ``threads`` is the host's
    torch thread count, for the record only.
    """
    dev = resolve_device(device)
    if dev.type != "cuda":
        raise UserError(f"device {str(device)!r}: cuda_matmul_benchmark needs a CUDA device")
    bits16 = dtype in (torch.bfloat16, torch.float16)
    n = size or (GPU_BF16_SIZE if bits16 else GPU_FP32_SIZE)
    free, _ = torch.cuda.mem_get_info(dev)
    while size is None and n > 512 and 3 * n * n * dtype.itemsize > free // 2:
        n //= 2
    flops = matmul_flops(n, n, n)
    with torch.inference_mode(), torch.cuda.device(dev), _tf32(tf32):
        ops = [torch.randn(n, n, device=dev, dtype=dtype) for _ in range(2)]
        ops.append(torch.empty(n, n, device=dev, dtype=dtype))
        _cuda_round(ops, 3)  # cuBLAS handle and kernel choice
        one = max(_cuda_round(ops, 3) / 3, 1e-6)
        _cuda_round(ops, max(1, int(_GPU_WARMUP_S / one)))
        per_round = max(1, int(_GPU_ROUND_S / one))
        rates: list[float] = []
        deadline = time.perf_counter() + seconds
        while len(rates) < 3 or (time.perf_counter() < deadline and len(rates) < 10_000):
            rates.append(per_round * flops / _cuda_round(ops, per_round) / 1e9)
        ops.clear()
    torch.cuda.empty_cache()
    return MatmulResult(
        gflops=statistics.median(rates),
        size=n,
        repeats=len(rates),
        threads=torch.get_num_threads(),
        dtype=str(dtype),
    )


def _cuda_round(ops: list[torch.Tensor], k: int) -> float:
    """Seconds of ``k`` back-to-back ``ops[0] @ ops[1]`` into ``ops[2]``, by CUDA events."""
    a, b, out = ops
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(k):
        torch.mm(a, b, out=out)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds


@dataclass(frozen=True)
class GpuProfile:
    """One GPU as measured: its name, sustained matmul rates and memory."""

    device: str
    """``cuda:N``."""
    name: str
    capability: str
    """Compute capability, ``major.minor`` (9.0 for Hopper)."""
    fp32_tflops: float
    """Sustained fp32 matmul rate, TF32 off unless ``tf32``."""
    bf16_tflops: float
    """Sustained bf16 matmul rate (what bf16 autocast training runs on)."""
    fp32_size: int
    bf16_size: int
    fp32_rounds: int
    bf16_rounds: int
    tf32: bool
    memory_total_bytes: int
    memory_free_bytes: int
    """Free when profiled: what a stage may use."""

    def tflops(self, precision: Precision) -> float:
        """The rate of ``precision``: what the planner should count on for that training."""
        return self.bf16_tflops if precision == "bf16" else self.fp32_tflops


def gpu_profile(
    device: str | torch.device = "cuda", seconds: float = 2.0, *, tf32: bool = False
) -> GpuProfile:
    """Measure one GPU: fp32 and bf16 matmul rates (about ``seconds`` each), memory, name.

    Memory is read first (``torch.cuda.mem_get_info``), before the benchmark
    allocates anything. See :func:`cuda_matmul_benchmark` for the method.
    """
    dev = resolve_device(device)
    if dev.type != "cuda":
        raise UserError(f"device {str(device)!r}: gpu_profile needs a CUDA device")
    free, total = torch.cuda.mem_get_info(dev)
    props = torch.cuda.get_device_properties(dev)
    fp32 = cuda_matmul_benchmark(dev, torch.float32, seconds, tf32=tf32)
    bf16 = cuda_matmul_benchmark(dev, torch.bfloat16, seconds)
    return GpuProfile(
        device=str(dev),
        name=props.name,
        capability=f"{props.major}.{props.minor}",
        fp32_tflops=fp32.gflops / 1e3,
        bf16_tflops=bf16.gflops / 1e3,
        fp32_size=fp32.size,
        bf16_size=bf16.size,
        fp32_rounds=fp32.repeats,
        bf16_rounds=bf16.repeats,
        tf32=tf32,
        memory_total_bytes=int(total),
        memory_free_bytes=int(free),
    )
