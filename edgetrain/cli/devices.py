"""``edgetrain devices``: browse and check the device-profile catalogue.

The catalogue (``device_profiles/*.yaml``, schema and loader in
:mod:`edge.profiling.catalog`) describes real devices: sustained training speed, memory,
link and power, each with its source. These commands list it, show one profile,
print a profile as a planning-problem device, and validate profile files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from edge.errors import UserError
from edge.profiling.catalog import (
    POWER_NOTE,
    DeviceProfile,
    ResolvedProfile,
    all_resolved,
    catalogue_dir,
    load_catalogue,
    load_profile_file,
    resolve,
)

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

__all__ = ["app", "list_command", "show_command", "validate_command"]

app = typer.Typer(
    help=(
        "The device-profile catalogue: real devices (Raspberry Pis, Jetsons, phones, "
        "PCs, GPU servers) with their sustained training speed, memory, link and power, "
        "and the source of each figure. Names are profile ids (rpi4, h100-sxm) or "
        "id-variant for a memory size (rpi4-8gb)."
    ),
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
)

_KIND_ORDER = ("sbc", "jetson", "phone", "mini-pc", "laptop", "gpu-server")


def _row(r: ResolvedProfile) -> dict[str, Any]:
    p = r.profile
    return {
        "id": r.name,
        "profile": p.id,
        "variant": r.variant,
        "default": r.variant is not None and r.variant == p.default_variant,
        "name": _title(r),
        "kind": p.kind,
        "sustained_gflops": p.training.sustained_gflops,
        "precision": p.training.precision,
        "usable_memory_gib": r.sizes.usable_gib,
        "total_memory_gib": r.sizes.total_gib,
        "link": p.link.model_dump(mode="json", exclude={"basis"}),
        "power": {"busy_w": p.power.busy_w, "idle_w": p.power.idle_w, "note": POWER_NOTE},
    }


def _title(r: ResolvedProfile) -> str:
    return r.profile.name + ("" if r.variant is None else f" ({r.variant})")


def _sorted(resolved: list[ResolvedProfile]) -> list[ResolvedProfile]:
    # Smallest devices first within each kind; variants keep their file order.
    return sorted(
        resolved,
        key=lambda r: (
            _KIND_ORDER.index(r.profile.kind),
            r.profile.training.sustained_gflops,
            r.profile.id,
        ),
    )


@app.command("list")
def list_command(
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list instead of a table."),
) -> None:
    """List every device and memory variant: kind, sustained GFLOP/s, usable memory, link,
    and power while training and idle (predicted from datasheet figures, not measured)."""
    rows = [_row(r) for r in _sorted(all_resolved(load_catalogue()))]
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    from rich.table import Table  # [Note: commands without torch] in edgetrain.cli

    console = _console()
    wide = console.width >= 120  # below that the name column makes way for the figures
    table = Table(title="edgetrain device profiles", title_justify="left")
    table.add_column("id", no_wrap=True)
    if wide:
        table.add_column("name", no_wrap=True, overflow="ellipsis", max_width=40)
    table.add_column("kind", no_wrap=True)
    table.add_column("GFLOP/s", justify="right", no_wrap=True)
    table.add_column("usable GiB", justify="right", no_wrap=True)
    table.add_column("busy/idle W", justify="right", no_wrap=True)
    table.add_column("link", max_width=60)  # the one column that wraps when narrow
    for row in rows:
        link = row["link"]
        cells = [
            row["id"] + (" *" if row["default"] else ""),
            row["kind"],
            f"{row['sustained_gflops']:,.1f}",
            f"{row['usable_memory_gib']:.1f}",
            f"{row['power']['busy_w']:,.1f}/{row['power']['idle_w']:,.1f}",
            f"{link['bandwidth_mbps']:,.0f} Mbit/s, {link['latency_ms']:g} ms, {link['kind']}",
        ]
        if wide:
            cells.insert(1, row["name"])
        table.add_row(*cells)
    console.print(table)
    console.print("* the default variant: the profile id alone resolves to it.")
    console.print(f"busy/idle W: power while training / while idle, {POWER_NOTE}.")


def _console() -> Console:
    # A terminal gets rows cut to its width; a pipe or file gets them whole.
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=220)


@app.command("show")
def show_command(
    name: str = typer.Argument(..., help="A profile id (rpi4, h100-sxm) or id-variant (rpi4-8gb)."),
    as_json: bool = typer.Option(False, "--json", help="Print the whole profile as JSON."),
    as_device: bool = typer.Option(
        False, "--as-device", help="Print the planning-problem device (JSON) instead."
    ),
    device_id: str | None = typer.Option(
        None, "--device-id", help="With --as-device: the device id (default: the profile name)."
    ),
    power: bool = typer.Option(
        False,
        "--power",
        help=(
            "The device also carries watts_busy and watts_idle (predicted from datasheet "
            "figures; version 2 planning problems only)."
        ),
    ),
) -> None:
    """Show one profile: every figure, how it was estimated, and its sources."""
    resolved = resolve(name)
    if as_device:
        spec = resolved.to_device_spec(device_id, power=power)
        typer.echo(json.dumps(spec.model_dump(mode="json", exclude_none=True), indent=2))
        return
    if as_json:
        device = resolved.to_device_spec(power=power)
        out = {
            "id": resolved.name,
            "variant": resolved.variant,
            "memory": resolved.sizes.model_dump(mode="json"),
            "device": device.model_dump(mode="json", exclude_none=True),
            "profile": resolved.profile.model_dump(mode="json", exclude_none=True),
        }
        typer.echo(json.dumps(out, indent=2))
        return
    from rich.console import Console

    Console().print(_describe(resolved))


def _describe(r: ResolvedProfile) -> Table:
    from rich.table import Table

    p = r.profile
    grid = Table.grid(padding=(0, 2))
    grid.add_column(no_wrap=True, style="bold")
    grid.add_column(overflow="fold")
    grid.add_row(r.name, f"{_title(r)} [{p.kind}]")
    cpu = p.cpu
    grid.add_row(
        "cpu",
        f"{cpu.model}\n{cpu.cores} cores @ {cpu.clock_ghz:g} GHz, "
        f"peak FP32 {cpu.peak_fp32_gflops:,.1f} GFLOP/s: {cpu.peak_basis}",
    )
    grid.add_row("accelerator", _describe_accelerator(p))
    t = p.training
    grid.add_row(
        "training",
        f"{t.sustained_gflops:,.1f} GFLOP/s sustained ({t.unit}, {t.precision})\n{t.basis}",
    )
    mem = f"{r.sizes.usable_gib:g} of {r.sizes.total_gib:g} GiB usable; {p.memory.kind}, "
    mem += f"{p.memory.bandwidth_gb_s:g} GB/s"
    if p.variants:
        sizes = ", ".join(
            f"{key}{' (default)' if key == p.default_variant else ''}: "
            f"{v.usable_gib:g}/{v.total_gib:g} GiB"
            for key, v in p.variants.items()
        )
        mem += f"\nvariants {sizes}"
    grid.add_row("memory", mem)
    link = p.link
    grid.add_row(
        "link",
        f"{link.kind}: {link.bandwidth_mbps:,.0f} Mbit/s, {link.latency_ms:g} ms\n{link.basis}",
    )
    pw = p.power
    watts = [f"busy {pw.busy_w:g} W", f"idle {pw.idle_w:g} W"]
    watts += [f"typical {pw.typical_w:g} W"] if pw.typical_w else []
    watts += [f"max {pw.max_w:g} W"] if pw.max_w else []
    grid.add_row("power", f"{', '.join(watts)} ({POWER_NOTE})\n{pw.basis}")
    if p.notes:
        grid.add_row("notes", p.notes)
    for key, refs in p.sources.items():
        text = "\n".join(s.title + (f" <{s.url}>" if s.url else "") for s in refs)
        grid.add_row(f"source: {key}", text)
    return grid


def _describe_accelerator(p: DeviceProfile) -> str:
    acc = p.accelerator
    if acc is None:
        return "none"
    peaks = [
        f"{prec.upper()} {value:,.0f}"
        for prec in ("fp32", "tf32", "fp16", "bf16")
        if (value := acc.peak(prec)) is not None
    ]
    if not peaks:
        return f"{acc.model} ({acc.kind}; no published peak, not used for training)"
    return f"{acc.model} ({acc.kind})\npeak GFLOP/s: {', '.join(peaks)}: {acc.peak_basis}"


@app.command("validate")
def validate_command(
    files: list[Path] | None = typer.Argument(
        None,
        help="Profile files or folders of them (default: the shipped catalogue).",
        show_default=False,
    ),
) -> None:
    """Validate profile files: 'ok' per good file, else one error line each and status 2."""
    shipped = catalogue_dir()
    targets: list[Path] = []
    for path in files or [shipped]:
        targets += sorted(path.glob("*.yaml")) if path.is_dir() else [path]
    if not targets:
        raise UserError("validate: no *.yaml profile files found")
    status = 0
    for path in targets:
        try:
            profile = load_profile_file(path)
        except UserError as exc:
            typer.echo(f"error: {exc.message}", err=True)
            status = max(status, exc.exit_code)
            continue
        count = len(profile.variants or {})
        extra = f", {count} variants" if count else ""
        typer.echo(f"ok: {path} ({profile.id}{extra})")
    if status == 0 and not files:
        load_catalogue(shipped)  # names across files must not collide
    if status:
        raise typer.Exit(status)
