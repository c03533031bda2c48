"""``edgetrain demo``: the best end-to-end run that exists, on embedded defaults.

Until the coordinator and the MQTT pipeline exist, the demo runs what does:
it measures this machine, profiles the units of a zoo model, builds a planning
problem (``shared/spec/planning.md``) over a sample fleet from the device
catalogue plus this machine, plans it, and trains the model cut into the
plan's segments, which are
built separately, as devices would build them, passing activations forward and
gradients backward between them on this machine. It says so when it starts.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import typer
from rich.console import Console
from rich.table import Table
from torch.utils.data import DataLoader

from coordinator.planner import plan_problem
from edge.catalog import resolve
from edge.models.costs import profile_model
from edge.models.datasets import build_dataset
from edge.models.zoo import ModelSpec, Segment, get_model
from edge.problem import PlanningProblem
from edge.profiler import profile_device

__all__ = ["demo_command", "train_segments"]

console = Console()


def _even_cuts(num_units: int, stages: int) -> list[tuple[int, int]]:
    stages = min(stages, num_units)
    bounds = [round(i * num_units / stages) for i in range(stages + 1)]
    return list(itertools.pairwise(bounds))


def train_segments(
    spec: ModelSpec,
    ranges: list[tuple[int, int]],
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int,
) -> tuple[list[Segment], list[float]]:
    """Train ``spec`` cut into ``ranges``, each segment with its own optimizer.

    Forward passes a detached copy of each activation to the next segment and
    backward returns its gradient, exactly what crosses a link in a pipeline.
    """
    segments = [spec.build_segment(a, b) for a, b in ranges]
    optims = [torch.optim.SGD(s.parameters(), lr=lr, momentum=0.9) for s in segments]
    data = build_dataset(spec.dataset, "train", **spec.dataset_options)
    loader = DataLoader(
        data, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed)
    )
    losses = []
    for _ in range(epochs):
        total, count = 0.0, 0
        for x, y in loader:
            received, sent = [], []
            h = x
            for seg in segments:
                h = h.detach().requires_grad_(h.is_floating_point())
                received.append(h)
                h = seg(h)
                sent.append(h)
            loss = F.cross_entropy(h.reshape(-1, h.shape[-1]), y.reshape(-1))
            loss.backward()
            for i in range(len(segments) - 2, -1, -1):
                sent[i].backward(received[i + 1].grad)
            for opt in optims:
                opt.step()
                opt.zero_grad()
            total += loss.item() * len(y)
            count += len(y)
        losses.append(total / count)
    return segments, losses


@torch.no_grad()
def _accuracy(spec: ModelSpec, segments: list[Segment]) -> float:
    data = build_dataset(spec.dataset, "test", **spec.dataset_options)
    correct = total = 0
    for x, y in DataLoader(data, batch_size=256):
        h = x
        for seg in segments:
            h = seg(h)
        correct += int((h.argmax(-1) == y).sum())
        total += len(y)
    return correct / total


def demo_command(
    model: str = typer.Option("cnn-digits", help="Zoo model to profile and train."),
    fleet: str = typer.Option(
        "rpi4-4gb,jetson-nano,laptop", help="Catalogue devices of the sample fleet."
    ),
    epochs: int = typer.Option(8, min=1, help="Training epochs."),
    batch_size: int = typer.Option(32, min=1, help="Samples per step."),
    microbatches: int = typer.Option(4, min=1, help="Microbatches per step in the problem."),
    lr: float = typer.Option(0.05, help="SGD learning rate."),
    seed: int = typer.Option(0, help="Seed of the weights and the data order."),
    out: Path = typer.Option(Path("demo-out"), help="Where the problem and results are written."),
) -> None:
    """Profile this machine and a model, plan it over a sample fleet, train it split.

    The coordinator and the MQTT pipeline are not built yet: the segments run
    one after another on this machine, each built on its own as a device would.
    """
    console.print(
        "[bold]edgetrain demo[/bold]: the coordinator and MQTT pipeline are not built yet, "
        "so this runs what exists: device and model profiling, planning over a "
        "sample fleet, and split training of the model on this machine."
    )
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    console.rule("1. this machine")
    me = profile_device(device_id="this-machine", seconds=1.0)
    console.print(
        f"{me.gflops:.1f} GFLOP/s fp32 matmul, {me.memory_bytes / 2**30:.1f} GiB usable, "
        f"link {me.bandwidth_mbps:.0f} Mb/s ({me.details.get('link_source')})"
    )

    console.rule(f"2. the units of {model}")
    spec = get_model(model, seed=seed)
    prof = profile_model(spec, batch_size, repeats=3, seed=seed)
    table = Table("unit", "fwd+bwd MFLOP/sample", "params KiB", "out KiB", "saved KiB", "ms")
    for u in prof.units:
        ms = ((u.fwd_time_s or 0) + (u.bwd_time_s or 0)) * 1e3
        table.add_row(
            u.name, f"{(u.fwd_flops + u.bwd_flops) / 1e6:.3f}", f"{u.param_bytes / 1024:.1f}",
            f"{u.out_bytes / 1024:.2f}", f"{u.act_bytes / 1024:.2f}", f"{ms:.2f}",
        )  # fmt: skip
    console.print(table)

    console.rule("3. a planning problem over a sample fleet")
    devices = [resolve(name).to_device_spec() for name in fleet.split(",") if name]
    devices.append(me.to_device_spec())
    problem = PlanningProblem(
        version=1,
        batch_size=batch_size,
        microbatches=microbatches,
        pin_first=devices[0].id,
        layers=prof.to_layers(),
        devices=devices,
    )
    problem_path = out / "problem.json"
    problem_path.write_text(json.dumps(problem.to_json(), indent=2))
    for d in devices:
        console.print(f"  {d.id}: {d.gflops:.1f} GFLOP/s, {d.memory_bytes / 2**30:.1f} GiB")
    console.print(f"written to {problem_path}")

    console.rule("4. the plan")
    found = plan_problem(problem)
    names = spec.unit_names
    if found.score is None:
        console.print(f"no feasible plan ({found.reason}); splitting evenly instead")
        ranges = _even_cuts(spec.num_units, len(devices))
    else:
        sc = found.score
        plan_table = Table("stage", "device", "units", "compute ms", "link ms", "memory MB")
        for s, st in enumerate(sc.plan.stages):
            link = f"{sc.link_s[s] * 1e3:.3f}" if s < len(sc.link_s) else "-"
            plan_table.add_row(
                str(s), st.device, ",".join(names[st.start : st.end]),
                f"{sc.compute_s[s] * 1e3:.3f}", link, f"{sc.memory_bytes[s] / 1e6:.2f}",
            )  # fmt: skip
        console.print(plan_table)
        console.print(
            f"predicted {sc.throughput_sps:.0f} samples/s, step {sc.step_time_s * 1e3:.2f} ms "
            f"({found.method}, {found.wall_s:.2f} s)"
        )
        ranges = [(st.start, st.end) for st in sc.plan.stages]
        (out / "plan.json").write_text(json.dumps(sc.to_json(), indent=2))

    console.rule("5. split training")
    console.print("segments: " + " | ".join(",".join(names[a:b]) for a, b in ranges))
    segments, losses = train_segments(
        spec, ranges, epochs=epochs, batch_size=batch_size, lr=lr, seed=seed
    )
    for epoch, loss in enumerate(losses, start=1):
        console.print(f"  epoch {epoch}: loss {loss:.4f}")
    result: dict[str, Any] = {"model": model, "segments": ranges, "losses": losses}
    if spec.dataset == "digits":
        result["test_accuracy"] = acc = _accuracy(spec, segments)
        console.print(f"test accuracy: {acc:.3f}")
    (out / "result.json").write_text(json.dumps(result, indent=2))
    console.print(f"done in {time.perf_counter() - started:.1f} s; results in {out}/")
