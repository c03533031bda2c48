"""Build a planning problem from a zoo model and a fleet, so nobody writes one by hand.

The layers come from :func:`edge.models.unit_costs.profile_model` (counted FLOPs and
measured bytes; no timing, so problems are reproducible). The devices come from
a fleet description such as ``rpi4-4gb:2,jetson-nano,laptop,./me.json``: each
item is a catalogue name with an optional ``:count``, or the path of a JSON file
holding a measured device (``edgetrain profile --json`` output) or a list of
them. Repeated devices get ids ``NAME-1``, ``NAME-2``...
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from edge.errors import UserError, describe_validation_error
from edge.problem import DeviceSpec, PlanningProblem, UnitSpec
from edge.profiling.catalog import resolve

__all__ = ["build_problem", "parse_fleet"]

PROFILE_BATCH = 4
"""Samples per batch when profiling for a problem: FLOPs and bytes are per sample."""


def _devices_from_file(path: Path) -> list[DeviceSpec]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: cannot read a device: {exc}") from None
    items = data if isinstance(data, list) else [data]
    out = []
    for i, item in enumerate(items):
        try:
            out.append(DeviceSpec.model_validate(item))
        except ValidationError as exc:
            where = f"{path}[{i}]" if isinstance(data, list) else str(path)
            raise UserError(describe_validation_error(exc, where)) from None
    return out


def parse_fleet(text: str, *, files: bool = True, power: bool = False) -> list[DeviceSpec]:
    """Devices from ``name[:count],...`` (catalogue names or JSON files of devices).

    With ``files=False`` (a fleet a remote client named) no item is read as a file:
    each must be a catalogue name. With ``power`` each catalogue device carries its
    predicted ``watts_busy`` and ``watts_idle`` (version 2 problems only); a device
    from a file keeps what the file gives.
    """
    items = [part.strip() for part in text.split(",") if part.strip()]
    if not items:
        raise UserError("--devices: no devices given")
    devices: list[DeviceSpec] = []
    for item in items:
        name, _, count_text = item.partition(":")
        path = Path(name)
        if files and (name.endswith(".json") or path.is_file()):
            devices += _devices_from_file(path)
            continue
        try:
            count = int(count_text) if count_text else 1
        except ValueError:
            raise UserError(f"--devices: {item!r}: count must be a whole number") from None
        if count < 1:
            raise UserError(f"--devices: {item!r}: count must be at least 1")
        profile = resolve(name)
        devices += [profile.to_device_spec(power=power) for _ in range(count)]
    # Give repeated ids a suffix so every device is distinct.
    totals = Counter(d.id for d in devices)
    seen: Counter[str] = Counter()
    named = []
    for d in devices:
        if totals[d.id] > 1:
            seen[d.id] += 1
            d = d.model_copy(update={"id": f"{d.id}-{seen[d.id]}"})
        named.append(d)
    return named


@functools.lru_cache(maxsize=32)
def _layers(model: str, options: str, batch_size: int) -> tuple[UnitSpec, ...]:
    """The counted units of ``model`` with ``options`` (JSON): the same every time (no
    timing), so kept. A job's rebalancer builds its problem after every step it weighs,
    and counting a model's FLOPs took most of that (0.07 of 0.09 s for gpt-mini here;
    several times as long on a busy host, where steps went by unweighed meanwhile)."""
    # Imported here, not above: they import torch, and parse_fleet's callers (the testbed
    # and plan commands) need none ([Note: commands without torch] in edgetrain.cli).
    from edge.models.unit_costs import profile_model
    from edge.models.zoo import get_model

    spec = get_model(model, **json.loads(options))
    return tuple(profile_model(spec, batch_size, timing=False).to_unit_specs())


def build_problem(
    model: str,
    devices: list[DeviceSpec],
    *,
    batch_size: int,
    microbatches: int,
    pin_first: str | None = None,
    optimizer_state_factor: float = 4.0,
    model_options: dict[str, Any] | None = None,
    version: Literal[1, 2] = 1,
) -> PlanningProblem:
    """The planning problem of training ``model`` on ``devices`` (``version`` 2: stages
    may run on device groups; a device's power figures are kept)."""
    if microbatches < 1 or batch_size < 1:
        raise UserError("batch size and microbatches must be at least 1")
    options = json.dumps(model_options or {}, sort_keys=True)  # JSON: they go on the wire
    layers = list(_layers(model, options, min(batch_size, PROFILE_BATCH)))
    try:
        if version == 1:  # version 1 has no power figures
            devices = [
                d.model_copy(update={"watts_busy": None, "watts_idle": None}) for d in devices
            ]
        return PlanningProblem(
            version=version,
            batch_size=batch_size,
            microbatches=microbatches,
            optimizer_state_factor=optimizer_state_factor,
            pin_first=pin_first,
            layers=layers,
            devices=devices,
        )
    except ValidationError as exc:
        raise UserError(describe_validation_error(exc, "problem")) from None
