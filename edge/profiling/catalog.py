"""The device-profile catalogue: one YAML file per real device, validated and resolved.

This module owns the schema of ``device_profiles/*.yaml`` (compute, memory, link,
power, and the source of each figure), loading and validating those files,
resolving a name such as ``rpi4-4gb`` to a profile and a memory variant, and
converting that into a planning-problem :class:`~edge.problem.DeviceSpec`. A bad
file or unknown name ends in one :class:`~edge.errors.UserError` line naming the
file and the field. :func:`load_device_file` reads one measured device (the JSON
that ``edgetrain profile --json`` writes), for ``edgetrain agent --profile``.
"""

from __future__ import annotations

import difflib
import functools
import json
import re
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from edge.errors import UserError, describe_validation_error
from edge.problem import DeviceSpec

try:  # LibYAML's parser, where PyYAML was built with it: every process that names a
    # catalogue device (each agent, plan, train) reads them all, ten times as fast so
    from yaml import CSafeLoader as _SafeLoader
except ImportError:  # pragma: no cover - a PyYAML without LibYAML
    from yaml import SafeLoader as _SafeLoader  # type: ignore[assignment]

__all__ = [
    "GIB",
    "POWER_NOTE",
    "DeviceProfile",
    "ResolvedProfile",
    "all_resolved",
    "catalogue_dir",
    "load_catalogue",
    "load_device_file",
    "load_profile_file",
    "profile_names",
    "resolve",
]

SCHEMA_VERSION = 1
GIB = 2**30
"""Bytes in a GiB: memory figures are binary gigabytes, as the OS reports them."""
POWER_NOTE = "predicted from datasheet and benchmark figures; nothing here measures power"
"""How every catalogue power figure (``busy_w``, ``idle_w``) is labelled where it is shown."""

# Numbers must be finite: allow_inf_nan=False refuses YAML's .nan and .inf.
Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Text = Annotated[str, Field(min_length=1)]
ProfileId = Annotated[str, Field(pattern=r"^[a-z0-9]+(-[a-z0-9]+)*$")]
VariantKey = Annotated[str, Field(pattern=r"^[a-z0-9]+$")]
Precision = Literal["fp32", "tf32", "fp16", "bf16"]
Kind = Literal["sbc", "jetson", "phone", "mini-pc", "laptop", "gpu-server"]
SourceKey = Literal["cpu", "scalar", "accelerator", "training", "memory", "link", "power"]
_PRECISIONS: tuple[str, ...] = ("fp32", "tf32", "fp16", "bf16")


class _Strict(BaseModel):
    # Refuse unknown (misspelt) fields, and strings where numbers belong.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Source(_Strict):
    """Where a figure comes from: a named datasheet, product brief or benchmark."""

    title: Text
    url: Annotated[str, Field(pattern=r"^https?://\S+$")] | None = None


class Cpu(_Strict):
    """The host CPU; its peak is computed from cores, clock and FLOPs per cycle."""

    model: Text
    cores: Annotated[int, Field(ge=1)]
    clock_ghz: Positive
    peak_fp32_gflops: Positive
    peak_basis: Text


class Scalar(_Strict):
    """The host CPU's speed on one core on general (scalar, mostly non-SIMD) code: a
    published single-core benchmark score. Only ratios between devices scored by the
    same benchmark mean anything: the testbed runs a device's Python, framing and
    messaging at its score over the fastest device's ([Note: two speeds of a device]
    in :mod:`coordinator.testbed.sizing`), its compute at the FLOP ratio."""

    benchmark: Text
    score: Positive
    basis: Text


class Accelerator(_Strict):
    """A GPU or NPU beside the CPU; peaks are dense (no sparsity) vendor figures."""

    model: Text
    kind: Literal["gpu", "npu"]
    peak_fp32_gflops: Positive | None = None
    peak_tf32_gflops: Positive | None = None
    peak_fp16_gflops: Positive | None = None
    peak_bf16_gflops: Positive | None = None
    peak_basis: Text | None = None

    @model_validator(mode="after")
    def _basis_given(self) -> Accelerator:
        if self.peak_basis is None and any(self.peak(p) is not None for p in _PRECISIONS):
            raise ValueError("peak_basis: required when a peak figure is given")
        return self

    def peak(self, precision: str) -> float | None:
        """Peak GFLOP/s at ``precision`` (``fp32``, ``tf32``, ``fp16``, ``bf16``), if known."""
        value: float | None = getattr(self, f"peak_{precision}_gflops")
        return value


class Training(_Strict):
    """The sustained training rate the planner uses, and how it was estimated."""

    unit: Literal["cpu", "accelerator"]
    precision: Precision
    sustained_gflops: Positive
    basis: Text


class Variant(_Strict):
    """One memory size of a device sold in several (``rpi4`` 2/4/8 GB), in GiB."""

    total_gib: Positive
    usable_gib: Positive
    """What training may use: total less OS, runtime and driver overheads."""

    @model_validator(mode="after")
    def _sizes(self) -> Variant:
        if self.usable_gib > self.total_gib:
            raise ValueError(f"usable_gib ({self.usable_gib}) exceeds total_gib ({self.total_gib})")
        return self


class Memory(_Strict):
    """Memory kind and bandwidth; its sizes here only when the file has no variants."""

    kind: Text
    bandwidth_gb_s: Positive
    total_gib: Positive | None = None
    usable_gib: Positive | None = None

    @model_validator(mode="after")
    def _sizes(self) -> Memory:
        if (self.total_gib is None) != (self.usable_gib is None):
            raise ValueError("total_gib and usable_gib: give both or neither")
        if (self.usable_gib or 0) > (self.total_gib or 0):
            raise ValueError(f"usable_gib ({self.usable_gib}) exceeds total_gib ({self.total_gib})")
        return self


class Link(_Strict):
    """The device's typical network link; bandwidth each way, one-way latency."""

    kind: Text
    bandwidth_mbps: Positive
    latency_ms: NonNegative
    basis: Text


class Power(_Strict):
    """Power draw, predicted from datasheet and benchmark figures: nothing here measures it.

    ``busy_w`` and ``idle_w`` are what a planning problem's ``watts_busy`` and
    ``watts_idle`` take (``shared/spec/planning-v2.md``); ``basis`` says where each comes
    from and which are estimates.
    """

    busy_w: Positive
    """Sustained training load: all cores, or the accelerator, busy."""
    idle_w: Positive
    """Powered on and idling with its OS and driver, computing nothing."""
    typical_w: Positive | None = None
    max_w: Positive | None = None
    """The most the device may draw (TDP, power mode or supply), when published."""
    basis: Text

    @model_validator(mode="after")
    def _order(self) -> Power:
        if self.idle_w > self.busy_w:
            raise ValueError(f"idle_w ({self.idle_w}) exceeds busy_w ({self.busy_w})")
        for name in ("busy_w", "typical_w"):
            value = getattr(self, name)
            if value is not None and self.max_w is not None and value > self.max_w:
                raise ValueError(f"{name} ({value}) exceeds max_w ({self.max_w})")
        return self


class DeviceProfile(_Strict):
    """One file of the catalogue: a real device and the sources of its figures."""

    schema_version: Literal[1]
    id: ProfileId
    name: Text
    kind: Kind
    cpu: Cpu
    scalar: Scalar | None = None
    accelerator: Accelerator | None = None
    training: Training
    memory: Memory
    variants: dict[VariantKey, Variant] | None = Field(default=None, min_length=1)
    default_variant: VariantKey | None = None
    link: Link
    power: Power
    notes: Text | None = None
    sources: dict[SourceKey, Annotated[list[Source], Field(min_length=1)]]

    @model_validator(mode="after")
    def _cross_check(self) -> DeviceProfile:
        self._check_memory()
        self._check_training()
        needed = {"cpu", "training", "memory", "link", "power"}
        needed |= {"accelerator"} if self.accelerator else set()
        needed |= {"scalar"} if self.scalar else set()
        for key in sorted(needed ^ set(self.sources)):
            why = (
                "Field required (every figure needs a source)" if key in needed else "no such part"
            )
            raise ValueError(f"sources.{key}: {why}")
        return self

    def _check_memory(self) -> None:
        variants, default = self.variants, self.default_variant
        if variants is None and default is not None:
            raise ValueError("default_variant: given, but the profile has no variants")
        if variants is None and self.memory.total_gib is None:
            raise ValueError("memory.total_gib: Field required (or give variants)")
        if variants is not None and self.memory.total_gib is not None:
            raise ValueError("memory.total_gib: give the sizes under variants, not here")
        if variants is not None and default not in variants:
            known = ", ".join(variants)
            raise ValueError(f"default_variant: must name one of {known} (got {default!r})")

    def _check_training(self) -> None:
        t, acc = self.training, self.accelerator
        if t.unit == "cpu" and t.precision != "fp32":
            raise ValueError("training.precision: CPU training is rated in fp32")
        if t.unit == "accelerator" and acc is None:
            raise ValueError("training.unit: 'accelerator', but the profile has none")
        on_cpu = acc is None or t.unit == "cpu"
        field = "cpu.peak_fp32_gflops" if on_cpu else f"accelerator.peak_{t.precision}_gflops"
        peak = self.cpu.peak_fp32_gflops if acc is None or on_cpu else acc.peak(t.precision)
        if peak is None:
            raise ValueError(f"{field}: Field required (training.precision is {t.precision})")
        if t.sustained_gflops > peak:
            got = t.sustained_gflops
            raise ValueError(f"training.sustained_gflops: {got} exceeds the peak {field} ({peak})")


@dataclass(frozen=True)
class ResolvedProfile:
    """A profile with its memory variant chosen: what a name like ``rpi4-4gb`` means."""

    profile: DeviceProfile
    variant: str | None = None

    @property
    def name(self) -> str:
        """The canonical name: the id, with ``-variant`` when the profile has variants."""
        return self.profile.id if self.variant is None else f"{self.profile.id}-{self.variant}"

    @property
    def sizes(self) -> Variant:
        """Total and usable memory (GiB) of this variant, or of the profile without any."""
        p, m = self.profile, self.profile.memory
        if self.variant is not None and p.variants is not None:
            return p.variants[self.variant]
        return Variant.model_construct(total_gib=m.total_gib, usable_gib=m.usable_gib)

    def to_device_spec(self, device_id: str | None = None, *, power: bool = False) -> DeviceSpec:
        """This device as a planning-problem device (``shared/spec/planning.md``).

        With ``power`` it also carries ``watts_busy`` and ``watts_idle``, the catalogue's
        predicted figures, which only a version 2 problem accepts; off by default so
        that version 1 problems built from the catalogue stay valid.
        """
        p = self.profile
        data: dict[str, Any] = {
            "id": self.name if device_id is None else device_id,
            "gflops": p.training.sustained_gflops,
            "memory_bytes": float(round(self.sizes.usable_gib * GIB)),
            "bandwidth_mbps": p.link.bandwidth_mbps,
            "latency_ms": p.link.latency_ms,
        }
        if power:
            data |= {"watts_busy": p.power.busy_w, "watts_idle": p.power.idle_w}
        if p.scalar is not None:
            data["details"] = {
                "scalar_score": p.scalar.score,
                "scalar_benchmark": p.scalar.benchmark,
            }
        try:
            return DeviceSpec.model_validate(data)
        except ValidationError as exc:
            raise UserError(describe_validation_error(exc, f"device {self.name}")) from None


class _Loader(_SafeLoader):
    """A safe YAML loader that refuses duplicate keys and reads ``1e3`` as a number."""


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if not isinstance(key, Hashable):
            continue  # construct_mapping below reports it
        if key in seen:
            mark = key_node.start_mark
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", mark)
        seen.add(key)
    return loader.construct_mapping(node)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
# YAML 1.1 reads 1e3 (no dot) as a string; the 1.2 core schema, and people, read a number.
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _parse(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or getattr(exc, "context", None) or exc
        raise UserError(f"{source}: not valid YAML: {problem}{where}".replace("\n", " ")) from None


def load_profile_file(path: Path, source: str | None = None) -> DeviceProfile:
    """Read and validate one profile file; ``source`` names it in errors (default: the path)."""
    src = str(path) if source is None else source
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise UserError(f"{src}: cannot read: {why}") from None
    data = _parse(text, src)
    if not isinstance(data, dict):
        got = "an empty file" if data is None else type(data).__name__
        raise UserError(f"{src}: (top level): expected a mapping of profile fields, got {got}")
    version = data.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise UserError(
            f"{src}: schema_version: unknown version {version!r} (expected {SCHEMA_VERSION})"
        )
    try:
        profile = DeviceProfile.model_validate(data)
    except ValidationError as exc:
        raise UserError(describe_validation_error(exc, src)) from None
    if profile.id != path.stem:
        raise UserError(
            f"{src}: id: {profile.id!r} does not match the file name (expected {path.stem!r})"
        )
    return profile


def load_catalogue(directory: Path | None = None) -> dict[str, DeviceProfile]:
    """Every ``*.yaml`` profile in ``directory`` (default: the shipped catalogue), by id."""
    if directory is None:
        return dict(_shipped_catalogue())
    return _load_directory(directory, label=str(directory))


def catalogue_dir() -> Path:
    """The folder of the shipped profiles (``device_profiles.CATALOGUE_DIR``)."""
    import device_profiles

    found = getattr(device_profiles, "CATALOGUE_DIR", None)
    if isinstance(found, Path):
        return found
    # An editable install made before device_profiles/__init__.py existed imports the
    # folder as a namespace package: its first path entry is still the folder.
    return Path(next(iter(device_profiles.__path__)))


@functools.cache
def _shipped_catalogue() -> dict[str, DeviceProfile]:
    return _load_directory(catalogue_dir(), label="device_profiles")


def _load_directory(directory: Path, label: str) -> dict[str, DeviceProfile]:
    if not directory.is_dir():
        raise UserError(f"{label}: not a directory of device profiles")
    files = sorted(directory.glob("*.yaml"))
    if not files:
        raise UserError(f"{label}: no *.yaml device profiles")
    profiles = {f.stem: load_profile_file(f, f"{label}/{f.name}") for f in files}
    for r in all_resolved(profiles):
        if r.variant is not None and r.name in profiles:
            where = f"{label}/{r.profile.id}.yaml: variants.{r.variant}"
            raise UserError(f"{where}: the name {r.name!r} is also the id of {r.name}.yaml")
    return profiles


def all_resolved(catalogue: dict[str, DeviceProfile]) -> list[ResolvedProfile]:
    """One :class:`ResolvedProfile` per device and memory variant, in id order."""
    out: list[ResolvedProfile] = []
    for pid in sorted(catalogue):
        profile = catalogue[pid]
        keys: list[str | None] = list(profile.variants) if profile.variants else [None]
        out += [ResolvedProfile(profile, key) for key in keys]
    return out


def _by_name(catalogue: dict[str, DeviceProfile]) -> dict[str, ResolvedProfile]:
    named = {r.name: r for r in all_resolved(catalogue)}
    named.update({pid: ResolvedProfile(p, p.default_variant) for pid, p in catalogue.items()})
    return named


def profile_names(catalogue: dict[str, DeviceProfile]) -> list[str]:
    """Every name :func:`resolve` accepts: ids, and ``id-variant`` for each variant."""
    return sorted(_by_name(catalogue))


def resolve(name: str, directory: Path | None = None) -> ResolvedProfile:
    """Resolve ``rpi4`` (default variant), ``rpi4-4gb`` (that variant) or ``h100-sxm``."""
    catalogue = load_catalogue(directory)
    named, key = _by_name(catalogue), name.strip().lower()
    if key in named:
        return named[key]
    owners = [p for p in catalogue.values() if p.variants and key.startswith(p.id + "-")]
    if owners:
        best = max(owners, key=lambda p: len(p.id))
        known = ", ".join(r.name for r in all_resolved({best.id: best}))
        missing = key[len(best.id) + 1 :]
        raise UserError(
            f"unknown device profile {name!r}: {best.id} has no variant {missing!r} "
            f"(known: {known})"
        )
    close = difflib.get_close_matches(key, sorted(named), n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}?" if close else "see `edgetrain devices list`"
    raise UserError(f"unknown device profile {name!r}; {hint}")


def load_device_file(path: Path, device_id: str) -> DeviceSpec:
    """The device in JSON file ``path`` (as ``edgetrain profile --json`` writes it), named
    ``device_id`` whatever id the file gives; a one-line :class:`UserError` otherwise."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"--profile {path}: cannot read a device: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"--profile {path}: expected one JSON object (a device)")
    try:
        return DeviceSpec.model_validate({**data, "id": device_id})
    except ValidationError as exc:
        raise UserError(describe_validation_error(exc, f"--profile {path}")) from None
