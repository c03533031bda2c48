"""``edgetrain models``: list the zoo and profile a model's units."""

from __future__ import annotations

import json
from typing import Any

import typer

__all__ = ["app"]

app = typer.Typer(
    help="The model zoo: list models and profile what each unit costs to train.",
    no_args_is_help=True,
)

OPTION_HELP = "Model option as key=value (e.g. norm=batch, width=32); repeatable."


@app.command("list")
def list_command(json_out: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List the zoo models with their unit count, parameter count and default dataset."""
    from rich.console import Console
    from rich.table import Table

    from edge.models.zoo import get_model, list_models  # [Note: commands without torch]

    rows: list[dict[str, Any]] = []
    for name in list_models():
        spec = get_model(name)
        params = sum(p.numel() for p in spec.build().parameters())
        rows.append(
            {
                "name": name,
                "units": spec.num_units,
                "parameters": params,
                "input_shape": list(spec.input_shape),
                "dataset": spec.dataset,
                "description": spec.description,
            }
        )
    if json_out:
        typer.echo(json.dumps(rows, indent=2))
        return
    table = Table(title="edgetrain model zoo")
    for col in ("model", "units", "parameters", "input", "dataset", "description"):
        table.add_column(col)
    for r in rows:
        shape = "x".join(map(str, r["input_shape"]))
        table.add_row(
            r["name"],
            str(r["units"]),
            f"{r['parameters']:,}",
            shape,
            r["dataset"],
            r["description"],
        )
    Console().print(table)


@app.command("profile")
def profile_command(
    model: str = typer.Argument(..., help="Zoo model name or package.module:function."),
    batch_size: int = typer.Option(32, "--batch-size", "-b", min=1, help="Samples per batch."),
    option: list[str] = typer.Option([], "--option", "-o", help=OPTION_HELP),
    timing: bool = typer.Option(True, help="Also time each unit's forward and backward here."),
    repeats: int = typer.Option(5, min=1, help="Timed repeats per unit (median is reported)."),
    seed: int = typer.Option(0, help="Seed of the weights and the example batch."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON with a `layers` list."),
) -> None:
    """Profile every unit of MODEL: FLOPs, parameter, output and activation bytes, times.

    The JSON output's `layers` list is the `layers` of a planning problem.
    """
    from rich.console import Console
    from rich.table import Table

    from edge.models.unit_costs import profile_model  # [Note: commands without torch]
    from edge.models.zoo import get_model, parse_options

    spec = get_model(model, seed=seed, **parse_options(option))
    prof = profile_model(spec, batch_size, timing=timing, repeats=repeats, seed=seed)
    if json_out:
        out = prof.to_json()
        out["layers"] = [unit.model_dump(mode="json") for unit in prof.to_unit_specs()]
        typer.echo(json.dumps(out, indent=2))
        return
    table = Table(title=f"{model}: per-sample costs at batch {batch_size}")
    for col in (
        "unit",
        "fwd MFLOP",
        "bwd MFLOP",
        "params KiB",
        "out KiB",
        "saved KiB",
        "fwd ms",
        "bwd ms",
    ):
        table.add_column(col, justify="right")
    for u in prof.units:
        table.add_row(
            u.name,
            f"{u.fwd_flops / 1e6:.3f}",
            f"{u.bwd_flops / 1e6:.3f}",
            f"{u.param_bytes / 1024:.1f}",
            f"{u.out_bytes / 1024:.2f}",
            f"{u.act_bytes / 1024:.2f}",
            "-" if u.fwd_time_s is None else f"{u.fwd_time_s * 1e3:.2f}",
            "-" if u.bwd_time_s is None else f"{u.bwd_time_s * 1e3:.2f}",
        )
    Console().print(table)
    typer.echo(f"training GFLOP per sample: {prof.train_flops_per_sample / 1e9:.4f}")
