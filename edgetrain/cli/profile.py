"""``edgetrain profile``: measure this device and print it as a planning-problem device.

This module owns the command's options and output (one JSON object with ``--json``,
a table otherwise); the measuring itself is :func:`edge.profiling.device.profile_device`,
on the CPU or, with ``--device cuda[:N]``, on a GPU, and with ``--model``
:func:`edge.profiling.device.profile_unit_times`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from edge.errors import UserError

__all__ = ["profile_command"]

JsonOutput = Annotated[
    bool,
    typer.Option(
        "--json",
        help=(
            "Print one JSON object shaped like a device of a planning problem "
            "(id, gflops, memory_bytes, bandwidth_mbps, latency_ms, details); "
            "it can be pasted into a problem file's devices list unchanged."
        ),
    ),
]
ReportedId = Annotated[
    str | None,
    typer.Option("--device-id", metavar="ID", help="Device id to report (default: the hostname)."),
]
LinkBroker = Annotated[
    str | None,
    typer.Option(
        "--broker",
        metavar="URL",
        help=(
            "Measure latency and bandwidth through this MQTT broker (mqtt://host:port). "
            "Without it the link speed comes from the default network interface, "
            "or a default of 100 Mb/s and 1 ms."
        ),
    ),
]
BenchSeconds = Annotated[
    float,
    typer.Option(
        "--seconds",
        metavar="S",
        help="How long to time the matmul benchmark (on a GPU: each of fp32 and bf16).",
    ),
]
ProfiledDevice = Annotated[
    str,
    typer.Option(
        "--device",
        metavar="DEVICE",
        help=(
            "cpu, or cuda / cuda:N to report that GPU's matmul rate and free memory "
            "(details.gpu has its name and both fp32 and bf16 TFLOP/s)."
        ),
    ),
]
TrainPrecision = Annotated[
    str,
    typer.Option(
        "--precision",
        metavar="fp32|bf16",
        help=(
            "The precision the device will train in: gflops is the matmul rate in it "
            "(bf16 for training under bf16 autocast; fp32 is measured with TF32 off)."
        ),
    ),
]
UnitsModel = Annotated[
    str | None,
    typer.Option(
        "--model",
        metavar="MODEL",
        help=(
            "Also time every unit of this zoo model (or package.module:function) on this "
            "device: details.units gets per-unit forward/backward seconds per batch."
        ),
    ),
]
UnitsBatchSize = Annotated[int, typer.Option("--batch-size", min=1, help="Batch size for --model.")]


def profile_command(
    json_output: JsonOutput = False,
    device_id: ReportedId = None,
    broker: LinkBroker = None,
    seconds: BenchSeconds = 2.0,
    device: ProfiledDevice = "cpu",
    precision: TrainPrecision = "fp32",
    model: UnitsModel = None,
    batch_size: UnitsBatchSize = 32,
) -> None:
    """Measure this device's compute, memory and network link.

    gflops is the sustained fp32 matmul rate with torch's thread count (an upper
    bound for training); memory_bytes is available memory, capped by the cgroup
    limit. With --device cuda both are the GPU's: its matmul rate in --precision
    and its free memory. bandwidth_mbps and latency_ms are measured through
    --broker when given.
    details.link_source says where the link figures came from: measured-broker,
    interface-speed or default.
    """
    if not seconds > 0 or seconds > 600:
        raise UserError(f"--seconds: must be more than 0 and at most 600 (got {seconds})")
    if device_id is not None and not device_id.strip():
        raise UserError("--device-id: must not be empty")
    if precision not in ("fp32", "bf16"):
        raise UserError(f"--precision: expected fp32 or bf16 (got {precision!r})")

    # Imported here: torch takes a while to load, and other commands do not need it.
    from edge.profiling.device import profile_device, profile_unit_times
    from edge.profiling.matmul import resolve_device

    try:
        on_gpu = resolve_device(device).type == "cuda"
    except UserError as exc:
        raise UserError(f"--device {exc.message.removeprefix('device ')}") from None
    if on_gpu and model is not None:  # see profile_unit_times: the CPU only
        raise UserError("--model: per-unit times are measured on the CPU only; drop --device")
    profile = profile_device(
        device_id=device_id,
        broker_url=broker,
        seconds=seconds,
        device=device,
        precision="bf16" if precision == "bf16" else "fp32",
    )
    data = profile.to_json()
    if model is not None:
        data["details"]["units"] = profile_unit_times(model, batch_size)
    if json_output:
        typer.echo(json.dumps(data, indent=2))
        return
    _print_table(data)


def _print_table(data: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    details: dict[str, Any] = data["details"]
    source = details["link_source"]
    table = Table(title=f"Device profile: {data['id']}")
    table.add_column("field")
    table.add_column("value", justify="right")
    table.add_column("how it was found")
    mm = details["matmul"]
    dtype = str(mm["dtype"]).removeprefix("torch.").replace("float32", "fp32")
    dtype = dtype.replace("bfloat16", "bf16")
    gpu: dict[str, Any] | None = details.get("gpu")
    if gpu is None:
        where = f"median of {mm['repeats']}, {details['torch_threads']} torch threads"
    else:
        where = f"on {gpu['device']}, median of {mm['repeats']} rounds"
    table.add_row("gflops", f"{data['gflops']:.1f}", f"{dtype} matmul n={mm['size']}, {where}")
    cgroup = details["cgroup"]
    limit = cgroup.get("memory_limit_bytes")
    mem_note = "available memory" + (
        f", cgroup {cgroup['memory_version']} limit {limit / 2**30:.2f} GiB" if limit else ""
    )
    if gpu is not None:
        mem_note = f"free GPU memory, of {gpu['memory_total_bytes'] / 2**30:.2f} GiB"
    table.add_row("memory_bytes", f"{data['memory_bytes'] / 2**30:.2f} GiB", mem_note)
    if gpu is not None:
        tf32 = "on" if gpu["tf32"] else "off"
        table.add_row(
            "gpu",
            f"{gpu['name']}",
            f"fp32 {gpu['fp32_tflops']:.1f} (TF32 {tf32}), bf16 {gpu['bf16_tflops']:.1f} "
            f"TFLOP/s; compute capability {gpu['capability']}",
        )
    table.add_row("bandwidth_mbps", f"{data['bandwidth_mbps']:.1f}", source)
    table.add_row("latency_ms", f"{data['latency_ms']:.3f}", source)
    table.add_row(
        "cores",
        f"{details['cores_effective']:g}",
        f"effective, of {details['cores_logical']} logical",
    )
    table.add_row("host", details["hostname"], f"torch {details['torch_version']}")
    Console().print(table)
    units = details.get("units")
    if units:
        per_unit = Table(title=f"{units['model']} at batch {units['batch_size']} on this device")
        for col in ("unit", "forward ms", "backward ms"):
            per_unit.add_column(col, justify="right")
        for u in units["times"]:
            per_unit.add_row(
                u["name"], f"{u['fwd_time_s'] * 1e3:.2f}", f"{u['bwd_time_s'] * 1e3:.2f}"
            )
        Console().print(per_unit)
