"""``edgetrain demo``: the main job end to end, on embedded defaults.

It measures this machine, profiles the units of a zoo model, plans the model
over a sample fleet from the device catalogue (plus this machine), and then
trains it as a real pipeline: a broker (Mosquitto, or the embedded amqtt), one
``edgetrain agent`` process per stage of the plan, activations forward and
gradients backward over MQTT, and the trained model checked on held-out data.
The agents are local processes standing in for the sample fleet's devices;
they run at this machine's speed (emulating each device's speed and link is
the testbed's job). The coordinator service is not built yet: the demo drives
the agents itself, as the service will.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
import typer
from rich.console import Console
from rich.table import Table
from torch.utils.data import DataLoader

from coordinator.broker import start_broker
from coordinator.jobs import JobSpec
from coordinator.localfleet import LocalFleet
from coordinator.planner import Plan, Stage, plan_problem
from coordinator.runners import run_on_agents
from edge.catalog import resolve
from edge.messages import StepReport
from edge.models.costs import profile_model
from edge.models.datasets import build_dataset
from edge.models.zoo import ModelSpec, get_model
from edge.problem import PlanningProblem
from edge.profiler import profile_device
from edge.transport.mqtt import MqttTransport
from edge.transport.settings import MqttSettings

__all__ = ["demo_command"]

console = Console()


@torch.no_grad()
def test_accuracy(spec: ModelSpec, weights: dict[str, torch.Tensor]) -> float:
    """Accuracy of the trained weights on the test split of the model's dataset."""
    model = spec.build()
    model.load_state_dict(weights)
    model.eval()
    data = build_dataset(spec.dataset, "test", **spec.dataset_options)
    correct = total = 0
    for x, y in DataLoader(data, batch_size=256):
        correct += int((model(x).argmax(-1) == y).sum())
        total += len(y)
    return correct / total


def _plan_table(problem: PlanningProblem, plan: Any, names: list[str]) -> Table:
    table = Table("stage", "device", "units", "compute ms", "link ms", "memory MB")
    for s, st in enumerate(plan.plan.stages):
        link = f"{plan.link_s[s] * 1e3:.3f}" if s < len(plan.link_s) else "-"
        table.add_row(
            str(s), st.device, ",".join(names[st.start : st.end]),
            f"{plan.compute_s[s] * 1e3:.3f}", link, f"{plan.memory_bytes[s] / 1e6:.2f}",
        )  # fmt: skip
    return table


def demo_command(
    model: str = typer.Option("cnn-digits", help="Zoo model to profile and train."),
    fleet: str = typer.Option(
        "rpi4-4gb,jetson-nano,laptop", help="Catalogue devices of the sample fleet."
    ),
    steps: int = typer.Option(300, min=1, help="Training steps."),
    batch_size: int = typer.Option(32, min=1, help="Samples per step."),
    microbatches: int = typer.Option(4, min=1, help="Microbatches per step."),
    lr: float = typer.Option(0.05, help="SGD learning rate."),
    seed: int = typer.Option(0, help="Seed of the weights and the data order."),
    out: Path = typer.Option(Path("demo-out"), help="Where the problem, plan and model go."),
) -> None:
    """Profile, plan over a sample fleet, and train the model as a pipeline over MQTT."""
    console.print(
        "[bold]edgetrain demo[/bold]: profile this machine and a model, plan it over a sample "
        "fleet, and train it as a pipeline of agent processes over MQTT (local agents stand "
        "in for the fleet's devices; the coordinator service is not built yet)."
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

    console.rule("3. the plan over a sample fleet")
    devices = [resolve(name).to_device_spec() for name in fleet.split(",") if name]
    devices.append(me.to_device_spec())
    problem = PlanningProblem(
        version=1, batch_size=batch_size, microbatches=microbatches, pin_first=devices[0].id,
        layers=prof.to_layers(), devices=devices,
    )  # fmt: skip
    (out / "problem.json").write_text(json.dumps(problem.to_json(), indent=2))
    found = plan_problem(problem)
    if found.score is None:
        raise typer.Exit(f"no plan fits the sample fleet: {found.reason}")  # type: ignore[arg-type]
    console.print(_plan_table(problem, found.score, spec.unit_names))
    console.print(
        f"predicted {found.score.throughput_sps:.0f} samples/s on the sample fleet "
        f"({found.method}, planned in {found.wall_s:.2f} s); written to {out}/"
    )
    (out / "plan.json").write_text(json.dumps(found.score.to_json(), indent=2))

    console.rule("4. pipelined training over MQTT")
    job = JobSpec.model_validate({
        "model": model, "steps": steps, "batch_size": batch_size, "microbatches": microbatches,
        "seed": seed, "optimizer": {"name": "sgd", "lr": lr, "momentum": 0.9},
    })  # fmt: skip
    stages = found.score.plan.stages
    with start_broker() as broker:
        console.print(f"broker: {broker.describe()}")
        control = MqttTransport(MqttSettings(url=broker.url))
        control.connect(timeout=15)
        try:
            with LocalFleet(len(stages), broker.url) as agents:
                agents.wait_online(control, timeout=120)
                local = Plan(tuple(Stage(agents.ids[s], st.start, st.end)
                                   for s, st in enumerate(stages)))  # fmt: skip
                for s, st in enumerate(stages):
                    console.print(f"  stage {s}: agent {agents.ids[s]} stands in for {st.device}")

                def show(report: StepReport) -> None:
                    if report.loss is not None and (report.step + 1) % 50 == 0:
                        console.print(f"  step {report.step + 1}: loss {report.loss:.4f}")

                result = run_on_agents(job, local, control, on_step=show, timeout_s=1800)
        finally:
            control.close()
    console.print(
        f"{steps} steps in {result.wall_s:.1f} s, {result.samples_per_s:.0f} samples/s, "
        f"final loss {result.losses[-1]:.4f}"
    )
    summary: dict[str, Any] = {
        "model": model, "plan": found.score.to_json(), "losses": result.losses,
        "samples_per_s": result.samples_per_s, "stages": result.stage_summary(),
    }  # fmt: skip
    if spec.dataset == "digits":
        summary["test_accuracy"] = acc = test_accuracy(spec, result.weights)
        console.print(f"test accuracy of the trained model: {acc:.3f}")
    (out / "model.safetensors").write_bytes(result.weights_bytes())
    (out / "result.json").write_text(json.dumps(summary, indent=2))
    console.print(f"done in {time.perf_counter() - started:.1f} s; results in {out}/")
