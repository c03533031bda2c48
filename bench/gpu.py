"""Per-stage throughput and MFU of gpt-mini on one device: what a pipeline stage gets out of a GPU.

The GPU server tier's question: when a stage of a plan lands on a GPU, how much of
the GPU does it use? This bench splits gpt-mini into ``--stages`` segments, as a
plan would, and times each segment *alone* on the device at several microbatch
sizes: forward, then backward (a gradient for the segment's output, or the loss
on the last stage), as a stage of the pipeline does for one microbatch. For each
stage and microbatch size it reports samples/s, tokens/s, achieved TFLOP/s and
the model FLOPs utilisation, MFU = achieved TFLOP/s / peak TFLOP/s.

- Model: on a GPU, gpt-mini scaled to d_model 2048, 24 blocks, 16 heads (head
  dimension 128), block_size 1024 tokens and a 50,304-token vocabulary: 1.42 B
  parameters; with 4 stages 0.41 B in each end stage (6 blocks and the
  embedding or the head) and 0.30 B in each middle one (fp32 weights, bf16 autocast).
  With the explicit attention of :class:`edge.models.units.CausalSelfAttention`
  (T x T scores, softmax in fp32) a 6-block stage at microbatch 16 keeps about
  25-35 GB for backward, well inside an H200's 141 GB; fused, less. On the CPU the same code
  runs at d_model 128, 8 blocks, 64 tokens, a 512-token vocabulary, and every
  figure is a CPU figure.
  ``--option KEY=VALUE`` changes any gpt-mini option.
- Stages: the blocks split evenly (the first ``n_layer % stages`` stages get one
  more); stage 0 also holds the embedding, the last stage the head and the loss.
- Inputs: random token ids within the vocabulary (only speed is measured);
  stages after the first get a random activation that requires a gradient, so
  their backward computes the input gradient a real stage sends back.
- Model FLOPs: from the unit-cost profiler (:func:`edge.models.unit_costs.profile_model`,
  ``torch.utils.flop_counter``) on one sample: training FLOPs = counted forward
  + counted backward (input and weight gradients; about 3x forward); embedding
  lookups and element-wise work count zero, the causal attention counts its full
  T x T matmuls as the unit computes them. All blocks have one shape, so one
  block is profiled and counted ``n_layer`` times.
- Peak: the device's sustained matmul rate in the training precision, measured
  by :func:`edge.profiling.matmul.gpu_profile` (bf16, n = 8192) on a GPU, or
  :func:`edge.profiling.matmul.matmul_benchmark` (fp32; the higher of a measurement
  before the stages and one after) on the CPU. MFU is against that *measured*
  rate, and on a GPU of the device catalogue also against its *rated* peak
  (:func:`rated_peak`: ``device_profiles/``, data-sheet figures with their sources;
  989 TFLOP/s dense bf16 for an H100 or H200), ``mfu_rated``.
- Variants (``--variants``, all by default, one after the other): ``explicit``
  attention, ``fused`` (``scaled_dot_product_attention``, [Note: fused attention] in
  :mod:`edge.models.units`), and ``fused-compiled`` (each stage under
  ``torch.compile``; compiling is in the warm-up, not timed).
- ``--profile``: ``torch.profiler`` over a few iterations of the largest stage at the
  largest microbatch, per variant: the operators with the most device (CPU) time.
- ``--vs-plain``: the same one-stage training as a plain PyTorch loop and as
  ``edgetrain launch``, and the ratio (:mod:`bench.gpu_plain`; the target 0.97).
- Timing: after warm-up, rounds of back-to-back iterations between device
  synchronisations, host clock; the median round (3 of about 0.5 s on a GPU,
  5 of about 0.1 s on the CPU, where other processes make figures noisy:
  ``--threads 1`` steadies them). Gradients accumulate across
  iterations, as over the microbatches of one step; no optimizer step unless
  ``--optimizer`` (AdamW after every iteration: the worst case, a step of one
  microbatch).

The issue's target: the largest stage (most FLOPs per sample) at microbatch 16
reaches at least 45% of the H200's rated bf16 peak (the goal 55%).

    .venv/bin/python bench/gpu.py [--device cuda|cpu] [--stages 4] [--microbatches 1,2,4,8,16]
        [--variants explicit,fused,fused-compiled] [--quick] [--optimizer] [--profile]
        [--vs-plain] [--option d_model=1024 ...] [--threads N] [--json] [--out FILE]

On 2 CPU cores the three variants at the CPU size take under a minute
(``DEVICE=cpu bench/gpu_check.sh``: 52 s with ``--profile`` and ``--vs-plain``); on
a GPU the variants' time is not measured yet (one variant took about a minute on an
H200 before they existed).
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's packages

from bench.siblings import sibling
from edge.errors import UserError
from edge.models.unit_costs import profile_model
from edge.models.zoo import ModelSpec, get_model, parse_options
from edge.profiling.catalog import load_catalogue
from edge.profiling.matmul import (
    Precision,
    gpu_profile,
    matmul_benchmark,
    resolve_device,
    tflops_rate,
)
from edge.runtime.stage import loss_fn

plain = sibling("gpu_plain")

GPU_OPTIONS: dict[str, int] = {
    "vocab_size": 50304,  # GPT-2's 50,257 rounded up to a multiple of 64
    "block_size": 1024,
    "d_model": 2048,
    "n_head": 16,
    "n_layer": 24,
}
CPU_OPTIONS: dict[str, int] = {
    "vocab_size": 512,
    "block_size": 64,
    "d_model": 128,
    "n_head": 4,
    "n_layer": 8,
}
GPU_MICROBATCHES = (1, 2, 4, 8, 16)
CPU_MICROBATCHES = (1, 2, 4, 8)
TARGET_RATED_MFU = 0.45
"""The issue's bar: the largest stage at microbatch 16 on an H200, of the rated bf16 peak."""
GOAL_RATED_MFU = 0.55
"""The issue's goal for the same."""
VARIANTS = {
    "explicit": ("explicit", False),
    "fused": ("fused", False),
    "fused-compiled": ("fused", True),
}
"""Each variant's attention (:data:`edge.models.units.ATTENTIONS`) and whether it compiles."""


@dataclass(frozen=True)
class BenchConfig:
    """One run of the bench; :meth:`defaults` gives the sizes for a device."""

    device: str = "cpu"
    """cpu, cuda or cuda:N."""
    options: dict[str, Any] = field(default_factory=lambda: dict(CPU_OPTIONS))
    """gpt-mini's options."""
    stages: int = 4
    microbatches: tuple[int, ...] = CPU_MICROBATCHES
    """Microbatch sizes, in sequences of ``block_size`` tokens."""
    precision: Precision = "fp32"
    """bf16: forward under bf16 autocast (fp32 weights); fp32: plain fp32."""
    warmup: int = 2
    """Untimed iterations per stage and microbatch size."""
    rounds: int = 3
    round_s: float = 0.2
    """A timed round runs back-to-back iterations for about this long."""
    peak_seconds: float = 1.0
    """How long to time the peak matmul rate (each of fp32 and bf16 on a GPU)."""
    optimizer: bool = False
    compile: bool = False
    seed: int = 0

    @classmethod
    def defaults(cls, device: str, quick: bool = False) -> BenchConfig:
        """The default sizes on ``device``; ``quick`` times two microbatch sizes, briefly."""
        gpu = resolve_device(device).type == "cuda"
        mbs = GPU_MICROBATCHES if gpu else CPU_MICROBATCHES
        return cls(
            device=device,
            options=dict(GPU_OPTIONS if gpu else CPU_OPTIONS),
            microbatches=(mbs[0], mbs[-1]) if quick else mbs,
            precision="bf16" if gpu else "fp32",
            warmup=3 if gpu else 2,
            rounds=(3 if gpu else 5) - (1 if quick else 0),
            round_s=(0.5 if gpu else 0.1) / (4 if quick else 1),
            peak_seconds=0.5 if quick else (2.0 if gpu else 1.0),
        )


def stage_ranges(n_layer: int, stages: int) -> list[tuple[int, int]]:
    """Unit ranges ``[start, end)`` of gpt-mini's units (embed, n_layer blocks, head).

    The blocks split evenly, the first ``n_layer % stages`` stages one more;
    stage 0 also takes the embedding (unit 0), the last stage the head.
    """
    if not 1 <= stages <= n_layer:
        raise ValueError(f"stages must be between 1 and n_layer ({n_layer}); got {stages}")
    base, extra = divmod(n_layer, stages)
    ranges, start = [], 1
    for s in range(stages):
        end = start + base + (s < extra)
        ranges.append((start, end))
        start = end
    ranges[0] = (0, ranges[0][1])
    ranges[-1] = (ranges[-1][0], n_layer + 2)
    return ranges


def unit_train_flops(options: dict[str, int], device: torch.device) -> list[tuple[float, float]]:
    """Per unit of gpt-mini, (forward, backward) FLOPs per sample from the unit-cost profiler.

    The profiled model has one block; every block has the same shape and cost,
    so that block's figures stand for each of the ``n_layer`` blocks.
    """
    one_block = get_model("gpt-mini", **{**options, "n_layer": 1})
    prof = profile_model(one_block, 1, device=str(device), timing=False)
    embed, block, head = ((u.fwd_flops, u.bwd_flops) for u in prof.units)
    return [embed, *[block] * options["n_layer"], head]


@dataclass
class _StageInputs:
    x: torch.Tensor
    target: torch.Tensor | None  # the last stage's next-token labels
    out_grad: torch.Tensor | None = None  # what a middle stage receives for its output


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _inputs(
    spec: ModelSpec,
    microbatch: int,
    dev: torch.device,
    first: bool,
    last: bool,
    d_model: int,
    gen: torch.Generator,
) -> _StageInputs:
    t, vocab = spec.input_shape[0], spec.num_classes
    if first:
        x = torch.randint(0, vocab, (microbatch, t), generator=gen).to(dev)
    else:
        x = torch.randn(microbatch, t, d_model, generator=gen).to(dev).requires_grad_()
    target = torch.randint(0, vocab, (microbatch, t), generator=gen).to(dev) if last else None
    return _StageInputs(x, target)


def _iteration(
    run: Callable[[torch.Tensor], torch.Tensor],
    inp: _StageInputs,
    dev: torch.device,
    precision: Precision,
    optimizer: torch.optim.Optimizer | None,
) -> None:
    """One microbatch through a stage: forward (under autocast for bf16) and backward."""
    inp.x.grad = None  # a stage sends its input gradient on; it never accumulates
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        out = run(inp.x)
        loss = loss_fn(out, inp.target) if inp.target is not None else None
    if loss is not None:
        loss.backward()
    else:
        if inp.out_grad is None:
            inp.out_grad = torch.randn_like(out)
        out.backward(inp.out_grad)
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _time_per_iteration(
    step: Callable[[], None], dev: torch.device, warmup: int, rounds: int, round_s: float
) -> tuple[float, int]:
    """Median seconds per iteration over ``rounds`` synchronised rounds, and iterations timed."""
    for _ in range(warmup):
        step()
    _sync(dev)
    calibration = []
    for _ in range(2):  # the faster of two, so one stalled iteration does not shrink rounds
        t0 = time.perf_counter()
        step()
        _sync(dev)
        calibration.append(time.perf_counter() - t0)
    per_round = max(1, int(round_s / max(min(calibration), 1e-9)))
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(per_round):
            step()
        _sync(dev)
        times.append((time.perf_counter() - t0) / per_round)
    return statistics.median(times), rounds * per_round


def measure_peak(dev: torch.device, precision: Precision, seconds: float) -> dict[str, Any]:
    """The device's sustained matmul rate in ``precision``, with how it was found."""
    if dev.type == "cuda":
        gpu = gpu_profile(dev, seconds)
        size = gpu.bf16_size if precision == "bf16" else gpu.fp32_size
        return {
            "tflops": gpu.tflops(precision),
            "how": f"{precision} matmul n={size} on {gpu.name} (edge.profiling.matmul.gpu_profile)",
            "device_name": gpu.name,
            "gpu": {
                "fp32_tflops": gpu.fp32_tflops,
                "bf16_tflops": gpu.bf16_tflops,
                "memory_total_bytes": gpu.memory_total_bytes,
            },
        }
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    mm = matmul_benchmark(dtype, seconds)
    return {
        "tflops": mm.gflops / 1e3,
        "how": f"CPU {precision} matmul n={mm.size}, {mm.threads} threads "
        "(edge.profiling.matmul.matmul_benchmark)",
        "device_name": "CPU",
    }


def rated_peak(device_name: str, precision: Precision) -> dict[str, Any] | None:
    """The data-sheet peak of the GPU torch names ``device_name`` (``NVIDIA H200``), from
    the device catalogue (``device_profiles/``, whose figures name their sources): the
    profile whose name holds the same model number (H200, H100, A100); ``None`` if none."""
    for profile in load_catalogue().values():
        acc = profile.accelerator
        model = re.search(r"\b([A-Z]\d{2,4})\b", profile.name)
        if acc is None or acc.kind != "gpu" or model is None:
            continue
        peak = acc.peak(precision)
        if peak is not None and re.search(rf"\b{model.group(1)}\b", device_name.upper()):
            return {"tflops": peak / 1e3, "profile": profile.id, "basis": acc.peak_basis}
    return None


def run_bench(config: BenchConfig) -> dict[str, Any]:
    """Run the bench; one JSON-ready dict: the peak, every (stage, microbatch) row, a summary."""
    dev = resolve_device(config.device)
    gpu = dev.type == "cuda"
    opts = config.options
    spec = get_model("gpt-mini", seed=config.seed, **opts)
    flops = unit_train_flops(opts, dev)
    peak = measure_peak(dev, config.precision, config.peak_seconds)
    gen = torch.Generator().manual_seed(config.seed)
    stages: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    for s, (start, end) in enumerate(stage_ranges(opts["n_layer"], config.stages)):
        names = spec.unit_names[start:end]
        fwd = sum(f for f, _ in flops[start:end])
        bwd = sum(b for _, b in flops[start:end])
        stage = {
            "stage": s,
            "units": [start, end],
            "first_unit": names[0],
            "last_unit": names[-1],
            "blocks": sum(n.startswith("block") for n in names),
            "fwd_flops_per_sample": fwd,
            "bwd_flops_per_sample": bwd,
            "flops_per_sample": fwd + bwd,
        }
        stage["params"], timed = _bench_stage(spec, start, end, config, dev, gen)
        gc.collect()  # the stage's weights, gradients and optimizer state are garbage now
        if gpu:
            torch.cuda.empty_cache()
        stages.append(stage)
        for row in timed:
            row["stage"] = s
            if "seconds" in row:
                mb = row["microbatch"]
                row["achieved_tflops"] = tflops_rate(stage["flops_per_sample"] * mb, row["seconds"])
            rows.append(row)
    if not gpu:  # a shared CPU: a busy spell during one measurement must not inflate MFU
        again = measure_peak(dev, config.precision, config.peak_seconds)
        peak = max(peak, again, key=lambda p: p["tflops"])
        peak["how"] += ", the higher of one measurement before the stages and one after"
    rated = rated_peak(peak["device_name"], config.precision) if gpu else None
    for row in rows:
        if "achieved_tflops" in row:
            row["mfu"] = row["achieved_tflops"] / peak["tflops"]
            if rated is not None:
                row["mfu_rated"] = row["achieved_tflops"] / rated["tflops"]
    return {
        "device": str(dev),
        "device_name": peak["device_name"],
        "cpu_figures": not gpu,
        "precision": config.precision,
        "peak_tflops": peak["tflops"],
        "peak": peak,
        "rated": rated,
        "model": {"name": "gpt-mini", **opts, "params": sum(st["params"] for st in stages)},
        "config": {
            "stages": config.stages,
            "microbatches": list(config.microbatches),
            "warmup": config.warmup,
            "rounds": config.rounds,
            "round_s": config.round_s,
            "optimizer": config.optimizer,
            "compile": config.compile,
        },
        "stages": stages,
        "rows": rows,
        "largest_stage": largest_stage(stages, rows, rated is not None),
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def _built_stage(
    spec: ModelSpec, start: int, end: int, config: BenchConfig, dev: torch.device
) -> tuple[
    torch.nn.Module,
    list[torch.nn.Parameter],
    torch.optim.Optimizer | None,
    Callable[[torch.Tensor], torch.Tensor],
]:
    """Units ``[start, end)`` built on ``dev``: the segment, its trainable parameters, its
    AdamW (``--optimizer``; fused on a GPU) and its forward (compiled in a compiled variant)."""
    with torch.device(dev):  # built in place: no host copy of a 0.4 B-parameter stage
        seg = spec.build_segment(start, end).train()
    params = [p for p in seg.parameters() if p.requires_grad]
    optimizer = None
    if config.optimizer and params:
        optimizer = torch.optim.AdamW(params, lr=1e-4, fused=dev.type == "cuda" or None)
    run: Callable[[torch.Tensor], torch.Tensor] = torch.compile(seg) if config.compile else seg
    return seg, params, optimizer, run


def _bench_stage(
    spec: ModelSpec,
    start: int,
    end: int,
    config: BenchConfig,
    dev: torch.device,
    gen: torch.Generator,
) -> tuple[int, list[dict[str, Any]]]:
    """Build units ``[start, end)`` on ``dev`` and time them at every microbatch size.

    Returns the segment's parameter count and one row per microbatch size:
    seconds per iteration and rates, or an ``error`` (out of memory).
    """
    gpu = dev.type == "cuda"
    seg, params, optimizer, run = _built_stage(spec, start, end, config, dev)
    t = spec.input_shape[0]
    rows: list[dict[str, Any]] = []
    for mb in config.microbatches:
        row: dict[str, Any] = {"microbatch": mb, "tokens": mb * t}
        if rows and rows[-1].get("error"):  # larger than one that did not fit
            rows.append({**row, "error": "skipped after out of memory"})
            continue
        if gpu:
            torch.cuda.reset_peak_memory_stats(dev)
        first, last = start == 0, end == spec.num_units
        try:
            inp = _inputs(spec, mb, dev, first, last, config.options["d_model"], gen)

            def step(inp: _StageInputs = inp) -> None:
                _iteration(run, inp, dev, config.precision, optimizer)

            seconds, iters = _time_per_iteration(
                step, dev, config.warmup, config.rounds, config.round_s
            )
        except torch.cuda.OutOfMemoryError:
            rows.append({**row, "error": "out of memory"})
            seg.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            continue
        rows.append(
            {
                **row,
                "seconds": seconds,
                "iterations": iters,
                "samples_per_s": mb / seconds,
                "tokens_per_s": mb * t / seconds,
                "peak_memory_bytes": torch.cuda.max_memory_allocated(dev) if gpu else None,
            }
        )
    return sum(p.numel() for p in params), rows


def largest_stage(
    stages: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]], rated: bool
) -> dict[str, Any]:
    """The stage with the most FLOPs per sample: its best MFU (of the measured matmul rate)
    and microbatch, its MFU of the rated peak at microbatch 16 (the issue's, else its
    largest timed), and whether that meets the target (``None`` without a rated peak)."""
    big = max(stages, key=lambda st: st["flops_per_sample"])
    timed = [r for r in rows if r["stage"] == big["stage"] and "mfu" in r]
    best = max(timed, key=lambda r: r["mfu"], default=None)
    judged = next((r for r in timed if r["microbatch"] == 16), timed[-1] if timed else None)
    of_rated = judged.get("mfu_rated") if judged is not None and rated else None
    return {
        "stage": big["stage"],
        "mfu": None if best is None else best["mfu"],
        "microbatch": None if best is None else best["microbatch"],
        "judged_microbatch": None if judged is None else judged["microbatch"],
        "mfu_rated": of_rated,
        "target_mfu_rated": TARGET_RATED_MFU,
        "goal_mfu_rated": GOAL_RATED_MFU,
        "meets_target": None if of_rated is None else of_rated >= TARGET_RATED_MFU,
    }


def format_table(result: dict[str, Any]) -> str:
    """The human-readable report of :func:`run_bench`'s result."""
    m = result["model"]
    opts = " ".join(
        f"{k}={m[k]}" for k in ("d_model", "n_layer", "n_head", "block_size", "vocab_size")
    )
    mode = "bf16 autocast" if result["precision"] == "bf16" else "fp32"
    params = m["params"] / 1e9
    count = f"{params:.3g} B" if params >= 1 else f"{params * 1e3:.3g} M"
    lines = [
        f"gpt-mini {opts} ({count} parameters), {len(result['stages'])} "
        f"stages, each alone on {result['device']} ({result['device_name']}), {mode}",
        f"peak: {result['peak_tflops']:.3g} TFLOP/s, {result['peak']['how']}",
    ]
    if result["cpu_figures"]:
        lines.append(
            "CPU figures: no GPU here; the same code at a small size, MFU against "
            "this CPU's matmul rate, not comparable with the GPU target"
        )
    cfg = result["config"]
    extras = [x for x, on in (("AdamW step", cfg["optimizer"]), ("compiled", cfg["compile"])) if on]
    lines.append(
        "forward + backward per microbatch"
        + (f" + {', '.join(extras)}" if extras else ", no optimizer step")
        + "; FLOPs = counted forward + backward (torch flop counter)"
    )
    head = (
        f"{'stage':>5} {'units':>15} {'GFLOP/sample':>12} {'mb':>4} {'ms/iter':>9} "
        f"{'samples/s':>10} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>8}"
    )
    lines += [head, "-" * len(head)]
    stages = {st["stage"]: st for st in result["stages"]}
    for r in result["rows"]:
        st = stages[r["stage"]]
        units = f"{st['first_unit']}..{st['last_unit']}"
        gflop = st["flops_per_sample"] / 1e9
        lead = f"{r['stage']:>5} {units:>15} {gflop:>12.3f} {r['microbatch']:>4}"
        if "error" in r:
            lines.append(f"{lead} {r['error']}")
            continue
        mem = r["peak_memory_bytes"]
        lines.append(
            f"{lead} {r['seconds'] * 1e3:>9.2f} {r['samples_per_s']:>10.1f} "
            f"{r['tokens_per_s']:>10.0f} {r['achieved_tflops']:>8.3f} {r['mfu']:>6.1%} "
            f"{'-' if mem is None else f'{mem / 2**30:.1f}':>8}"
        )
    big = result["largest_stage"]
    if big["mfu"] is None:
        lines.append(f"largest stage: {big['stage']}, not timed")
    else:
        lines.append(
            f"largest stage: {big['stage']}, best MFU {big['mfu']:.1%} of the measured "
            f"matmul rate at microbatch {big['microbatch']}"
        )
    rated = result["rated"]
    if big["mfu_rated"] is None:
        lines.append("rated peak: none for this device (a GPU of the catalogue only)")
    else:
        verdict = "met" if big["meets_target"] else "NOT met"
        lines.append(
            f"of the rated {rated['tflops']:.0f} TFLOP/s {result['precision']} "
            f"({rated['profile']}: {rated['basis']}): {big['mfu_rated']:.1%} at microbatch "
            f"{big['judged_microbatch']}; target >= {big['target_mfu_rated']:.0%} "
            f"(goal {big['goal_mfu_rated']:.0%}): {verdict}"
        )
    return "\n".join(lines)


def _sizes(text: str) -> tuple[int, ...]:
    sizes = tuple(int(v) for v in text.split(",") if v.strip())
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,2,4 (got {text!r})")
    return sizes


def run_variants(config: BenchConfig, names: Sequence[str]) -> dict[str, Any]:
    """:func:`run_bench` under each variant of :data:`VARIANTS`, one after the other."""
    out = {}
    for name in names:
        attention, compile_ = VARIANTS[name]
        options = {**config.options, "attention": attention}
        out[name] = run_bench(replace(config, options=options, compile=compile_))
        gc.collect()
    return out


def profile_stage(config: BenchConfig, microbatch: int, iterations: int = 5) -> dict[str, Any]:
    """``torch.profiler`` over a few iterations of the largest stage (the first of the most
    FLOPs) at ``microbatch``: the operators that took the most device time (CPU time on
    the CPU), each with its share of the total, and how much time was on the host."""
    from torch.profiler import ProfilerActivity, profile

    dev = resolve_device(config.device)
    gpu = dev.type == "cuda"
    spec = get_model("gpt-mini", seed=config.seed, **config.options)
    flops = unit_train_flops(config.options, dev)
    ranges = stage_ranges(config.options["n_layer"], config.stages)
    start, end = max(ranges, key=lambda r: sum(sum(f) for f in flops[r[0] : r[1]]))
    _seg, _params, optimizer, run = _built_stage(spec, start, end, config, dev)
    gen = torch.Generator().manual_seed(config.seed)
    first, last = start == 0, end == spec.num_units
    inp = _inputs(spec, microbatch, dev, first, last, config.options["d_model"], gen)
    for _ in range(config.warmup):
        _iteration(run, inp, dev, config.precision, optimizer)
    _sync(dev)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as prof:
        for _ in range(iterations):
            _iteration(run, inp, dev, config.precision, optimizer)
        _sync(dev)
    events = prof.key_averages()
    key = "self_device_time_total" if gpu else "self_cpu_time_total"
    total = sum(getattr(e, key) for e in events) or 1.0
    top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:12]
    return {
        "units": [start, end],
        "microbatch": microbatch,
        "iterations": iterations,
        "time": "device" if gpu else "cpu",
        "total_ms": total / 1e3 / iterations,
        "host_ms": sum(e.self_cpu_time_total for e in events) / 1e3 / iterations,
        "top": [
            {
                "op": e.key,
                "ms": getattr(e, key) / 1e3 / iterations,
                "share": getattr(e, key) / total,
                "calls": e.count // iterations,
            }
            for e in top
        ],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--device",
        default=None,
        help="cpu, cuda or cuda:N (default: cuda when available, else cpu)",
    )
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument(
        "--microbatches", type=_sizes, default=None, help="sizes in sequences, e.g. 1,2,4,8,16"
    )
    parser.add_argument(
        "--precision",
        choices=["bf16", "fp32"],
        default=None,
        help="default: bf16 on a GPU, fp32 on the CPU",
    )
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a gpt-mini option (d_model, n_layer, n_head, block_size, vocab_size), repeatable",
    )
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated, of {', '.join(VARIANTS)} (default: all)",
    )
    parser.add_argument("--quick", action="store_true", help="two microbatch sizes, briefly")
    parser.add_argument("--optimizer", action="store_true", help="AdamW step every iteration")
    parser.add_argument(
        "--profile", action="store_true", help="torch.profiler on the largest stage, per variant"
    )
    parser.add_argument(
        "--vs-plain", action="store_true", help="also a one-stage job against a plain loop"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="also write the JSON here (e.g. bench/results/gpu.json)",
    )
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    started = time.perf_counter()
    try:
        base = BenchConfig.defaults(device, quick=args.quick)
        config = replace(
            base,
            options={**base.options, **parse_options(args.option)},
            stages=args.stages,
            microbatches=args.microbatches or base.microbatches,
            precision=args.precision or base.precision,
            optimizer=args.optimizer,
        )
        names = [v.strip() for v in args.variants.split(",") if v.strip()]
        unknown = [v for v in names if v not in VARIANTS]
        if unknown or not names:
            raise ValueError(f"--variants: {unknown or names!r}: expected {', '.join(VARIANTS)}")
        opts = config.options
        get_model("gpt-mini", **opts)  # refuses an unknown option
        stage_ranges(opts["n_layer"], config.stages)
        if opts["d_model"] % opts["n_head"]:
            raise ValueError(f"d_model ({opts['d_model']}) must be a multiple of n_head")
    except (UserError, ValueError) as exc:  # a bad device, option or stage count
        print(f"error: {getattr(exc, 'message', exc)}", file=sys.stderr)
        return 2
    result: dict[str, Any] = {"variants": run_variants(config, names)}
    if args.profile:
        result["profiles"] = {
            name: profile_stage(
                replace(
                    config,
                    options={**opts, "attention": VARIANTS[name][0]},
                    compile=VARIANTS[name][1],
                ),
                max(config.microbatches),
            )
            for name in names
        }
    if args.vs_plain:
        gpu = resolve_device(device).type == "cuda"
        result["vs_plain"] = plain.vs_plain(
            {**opts, "attention": "auto"},
            device=device,
            precision=config.precision,
            batch_size=16 if gpu else 8,
            microbatches=4 if gpu else 2,
        )
    result["wall_s"] = time.perf_counter() - started
    text = json.dumps(result, indent=2)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    if args.json:
        print(text)
        return 0
    for name, one in result["variants"].items():
        print(f"== {name} ==\n{format_table(one)}\n")
    for name, prof in result.get("profiles", {}).items():
        ops = ", ".join(f"{t['op']} {t['share']:.0%}" for t in prof["top"][:5])
        print(f"profile {name}: {prof['total_ms']:.1f} ms {prof['time']} time an iteration: {ops}")
    if "vs_plain" in result:
        print(plain.format_vs_plain(result["vs_plain"]))
    print(f"({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
