"""A stage's state (weights and optimizer state) as safetensors bytes, and back.

This module owns the replica format: what a stage publishes every
``replicate_every`` steps (:func:`edge.wire.topics.job_replica`), what a device
keeps of its neighbour's, and what a new stage is restored from
(:func:`edge.wire.topics.job_restore`). It is a plain safetensors file, never a
pickle: reading one from the network runs no code.

Layout of a state blob:

- the segment's ``state_dict`` entries under their own keys, which start with
  the unit's name (``fc1.1.weight``, ``block0.ln1.bias``): the keys of the
  segments of a plan together are the whole model's keys;
- the optimizer state of each parameter under ``optim/<param key>/<state key>``
  (SGD ``momentum_buffer``; AdamW ``step``, ``exp_avg``, ``exp_avg_sq``). A
  state value that is a Python number is stored as a 0-d float64 tensor and
  named in the ``scalars`` metadata (JSON: key -> ``int``/``float``/``bool``), so
  it is a number again when loaded; a ``None`` value is left out;
- metadata (strings): ``format`` (:data:`FORMAT`), ``step``, ``job``, ``stage``
  (the stage that wrote it, or the one it is composed for), ``start`` and ``end``
  (its units ``[start, end)``) and ``units`` (JSON: their names, in order). Every
  key starts with one of those names, so a state can be cut by unit
  (:func:`select_units`) without knowing the model.

[Note: the step of a state]
``step`` is the number of steps completed: a state with ``step = k`` is the one
at the *start* of step ``k`` (after the optimizer stepped for step ``k - 1``),
so a stage restored from it runs from ``first_step = k``. Batches depend only
on the step (:mod:`edge.runtime.data`), so training resumed from a state gives
bit for bit what training without a stop gives.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import safetensors.torch
import torch

from edge.files import write_atomic
from edge.wire.topics import valid_job_id

__all__ = [
    "FORMAT",
    "ReplicaKeeper",
    "StageState",
    "encode_state",
    "load_state",
    "read_state",
    "select",
    "select_units",
    "stage_state",
]

FORMAT = "edgetrain-state-1"
OPTIM = "optim/"
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header
_SCALAR_TYPES: dict[str, type] = {"int": int, "float": float, "bool": bool}


@dataclass
class StageState:
    """The state of units ``[start, end)`` at the start of step ``step`` (see the Note)."""

    step: int
    job: str
    stage: int
    start: int
    end: int
    units: list[str] = field(default_factory=list)
    """The names of units ``[start, end)``: the first component of their keys."""
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    """``state_dict`` entries, keyed as in the segment (unit-prefixed)."""
    optim: dict[str, dict[str, torch.Tensor | float | int | bool]] = field(default_factory=dict)
    """Per parameter key, its optimizer state by state key."""


def _unit(key: str) -> str:
    return key.split(".", 1)[0]


def stage_state(
    segment: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    step: int,
    job: str,
    stage: int,
    start: int,
    end: int,
) -> bytes:
    """The state of ``segment`` and ``optimizer`` as safetensors bytes (nothing is changed).

    ``segment`` is a :class:`~edge.models.zoo.Segment`: its children are its units.
    """
    units = [name for name, _ in segment.named_children()]
    if len(units) != end - start:
        raise ValueError(f"a segment of {len(units)} units for units [{start}, {end})")
    weights = {k: v.detach() for k, v in segment.state_dict().items()}
    optim: dict[str, dict[str, torch.Tensor | float | int | bool]] = {}
    if optimizer is not None:
        names = {id(p): k for k, p in segment.named_parameters()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                entries = optimizer.state.get(p)
                if entries:
                    optim[names[id(p)]] = dict(entries)
    return encode_state(
        StageState(
            step=step,
            job=job,
            stage=stage,
            start=start,
            end=end,
            units=units,
            weights=weights,
            optim=optim,
        )
    )


def encode_state(state: StageState, *, job: str | None = None, stage: int | None = None) -> bytes:
    """Serialise ``state`` (one made by :func:`select_units`, say), relabelled if asked."""
    if len(state.units) != state.end - state.start:
        raise ValueError(f"{len(state.units)} unit names for units [{state.start}, {state.end})")
    tensors = {k: v.contiguous() for k, v in state.weights.items()}
    scalars: dict[str, str] = {}
    for name, entries in state.optim.items():
        for key, value in entries.items():
            full = f"{OPTIM}{name}/{key}"
            if isinstance(value, torch.Tensor):
                tensors[full] = value.detach().contiguous()
            elif isinstance(value, bool | int | float):
                tensors[full] = torch.tensor(float(value), dtype=torch.float64)
                scalars[full] = type(value).__name__
            elif value is not None:
                raise TypeError(f"optimizer state {full} is a {type(value).__name__}")
    metadata = {
        "format": FORMAT,
        "job": state.job if job is None else job,
        "stage": str(state.stage if stage is None else stage),
        "units": json.dumps(state.units),
    }
    for key in ("step", "start", "end"):
        metadata[key] = str(getattr(state, key))
    if scalars:
        metadata["scalars"] = json.dumps(scalars, sort_keys=True)
    return safetensors.torch.save(tensors, metadata=metadata)


def _metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors header, read without touching the tensors."""
    if len(data) < 8:
        raise ValueError(f"not a safetensors state: {len(data)} bytes")
    (size,) = struct.unpack_from("<Q", data)
    if size > min(len(data) - 8, _MAX_HEADER):
        raise ValueError(f"not a safetensors state: header of {size} bytes in {len(data)}")
    try:
        header = json.loads(bytes(data[8 : 8 + size]))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise ValueError("not a safetensors state: the header is not JSON") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("not an edgetrain state: no metadata")
    return meta


def _int(meta: dict[str, str], key: str) -> int:
    raw = meta.get(key)
    if raw is None or not raw.isascii() or not raw.isdecimal() or len(raw) > 18:
        raise ValueError(f"edgetrain state: metadata {key!r} is {raw!r}, not a count")
    return int(raw)


def read_state(data: bytes) -> StageState:
    """Check and parse a state blob; anything wrong raises a one-line :class:`ValueError`."""
    meta = _metadata(data)
    if meta.get("format") != FORMAT:
        raise ValueError(f"edgetrain state: format {meta.get('format')!r}, expected {FORMAT!r}")
    step, stage, start, end = (_int(meta, k) for k in ("step", "stage", "start", "end"))
    job = meta.get("job", "")
    if not valid_job_id(job):
        raise ValueError(f"edgetrain state: job {job!r} is not a job id")
    if end <= start:
        raise ValueError(f"edgetrain state: empty unit range [{start}, {end})")
    try:
        units = json.loads(meta.get("units", ""))
    except (ValueError, RecursionError):
        units = None
    if (
        not isinstance(units, list)
        or len(units) != end - start
        or not all(isinstance(u, str) and u and "." not in u for u in units)
        or len(set(units)) != len(units)
    ):
        raise ValueError(f"edgetrain state: metadata 'units' is not {end - start} unit names")
    try:
        scalars = json.loads(meta.get("scalars", "{}"))
    except (ValueError, RecursionError):
        scalars = None
    if not isinstance(scalars, dict) or not all(v in _SCALAR_TYPES for v in scalars.values()):
        raise ValueError("edgetrain state: metadata 'scalars' is not a map of number types")
    try:
        tensors = safetensors.torch.load(bytes(data))
    except Exception as exc:  # safetensors' error type is not public
        raise ValueError(f"edgetrain state: unreadable tensors: {exc}") from None
    state = StageState(step=step, job=job, stage=stage, start=start, end=end, units=units)
    known = set(units)
    for key, tensor in tensors.items():
        if not key.startswith(OPTIM):
            if _unit(key) not in known:
                raise ValueError(f"edgetrain state: key {key!r} is of none of its units")
            state.weights[key] = tensor
            continue
        name, _, entry = key[len(OPTIM) :].rpartition("/")
        if not name or not entry:
            raise ValueError(f"edgetrain state: optimizer key {key!r} is not optim/<param>/<key>")
        if _unit(name) not in known:
            raise ValueError(f"edgetrain state: key {key!r} is of none of its units")
        kind = scalars.get(key)
        if kind is not None and tensor.numel() != 1:
            raise ValueError(f"edgetrain state: scalar {key!r} has shape {tuple(tensor.shape)}")
        value = tensor if kind is None else _SCALAR_TYPES[kind](tensor.item())
        state.optim.setdefault(name, {})[entry] = value
    return state


def select_units(parts: Sequence[StageState], start: int, end: int) -> StageState:
    """The state of units ``[start, end)`` cut out of ``parts`` (states of one job and step).

    Keys of other units are left out; a unit that no part covers, or that two
    parts name differently, is an error. The result keeps the parts' job and
    the first part's stage: :func:`encode_state` can relabel both.
    """
    if not parts:
        raise ValueError("no state to select from")
    if not 0 <= start < end:
        raise ValueError(f"units [{start}, {end}) are not a range")
    first = parts[0]
    for p in parts[1:]:
        if (p.job, p.step) != (first.job, first.step):
            raise ValueError(
                f"states of job {first.job} step {first.step} and job {p.job} step {p.step} mixed"
            )
    names: dict[int, str] = {}
    for p in parts:
        for i, name in enumerate(p.units, start=p.start):
            if start <= i < end and names.setdefault(i, name) != name:
                raise ValueError(f"unit {i} is {names[i]!r} in one state, {name!r} in another")
    missing = [i for i in range(start, end) if i not in names]
    if missing:
        have = ", ".join(f"[{p.start}, {p.end})" for p in parts)
        raise ValueError(f"no state for units {missing} (have {have})")
    units = [names[i] for i in range(start, end)]
    out = StageState(
        step=first.step, job=first.job, stage=first.stage, start=start, end=end, units=units
    )
    for p in parts:
        mine = {name for i, name in enumerate(p.units, start=p.start) if start <= i < end}
        out.weights.update({k: v for k, v in p.weights.items() if _unit(k) in mine})
        out.optim.update({k: v for k, v in p.optim.items() if _unit(k) in mine})
    return out


def select(
    parts: Sequence[StageState], start: int, end: int, unit_names: Sequence[str]
) -> StageState:
    """:func:`select_units`, also checking the units' names against the model's ``unit_names``."""
    out = select_units(parts, start, end)
    if out.units != list(unit_names[start:end]):
        raise ValueError(f"units {out.units} are not the model's {list(unit_names[start:end])}")
    return out


def load_state(
    segment: torch.nn.Module, optimizer: torch.optim.Optimizer | None, state: StageState
) -> None:
    """Load ``state`` into ``segment`` and ``optimizer`` exactly; keys of other units are ignored.

    Every one of the segment's keys must be there with its shape and dtype, and
    every optimizer state tensor must match its parameter (checked before
    anything changes). The optimizer keeps its hyperparameters (those of the
    assignment); its state is copied, so ``state`` can be loaded again.
    """
    own = segment.state_dict()
    missing = sorted(set(own) - set(state.weights))
    if missing:
        raise ValueError(f"state lacks {len(missing)} weights of the segment: {missing[:5]}")
    for k, v in own.items():
        got = state.weights[k]
        if got.shape != v.shape or got.dtype != v.dtype:
            raise ValueError(
                f"weight {k}: state has {got.dtype}{list(got.shape)}, "
                f"the segment {v.dtype}{list(v.shape)}"
            )
    params = dict(segment.named_parameters())
    for name, entries in state.optim.items():
        p = params.get(name)
        if p is None:
            if _unit(name) in {_unit(k) for k in own}:
                raise ValueError(f"optimizer state for {name!r}, which is not a parameter")
            continue
        for key, value in entries.items():
            if (
                isinstance(value, torch.Tensor)
                and value.ndim
                and (value.shape != p.shape or value.dtype != p.dtype)
            ):
                raise ValueError(
                    f"optimizer state {name}/{key}: {value.dtype}{list(value.shape)} "
                    f"for a parameter {p.dtype}{list(p.shape)}"
                )
    if optimizer is None:
        if any(n in params for n in state.optim):
            raise ValueError("the state has optimizer state, the stage has no optimizer")
    else:
        _load_optimizer(segment, optimizer, state)
    segment.load_state_dict({k: state.weights[k] for k in own}, strict=True)


def _load_optimizer(
    segment: torch.nn.Module, optimizer: torch.optim.Optimizer, state: StageState
) -> None:
    names = {id(p): k for k, p in segment.named_parameters()}
    current = optimizer.state_dict()
    keys: set[frozenset[str]] = set()
    new: dict[int, dict[str, object]] = {}
    index = 0  # state_dict() numbers the parameters group after group, in order
    for group in optimizer.param_groups:
        for p in group["params"]:
            entries = state.optim.get(names.get(id(p), ""))
            if entries:
                # Clones: private, writable, 16-byte aligned (see [Note: zero-copy decoding]).
                new[index] = {
                    k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entries.items()
                }
                keys.add(frozenset(entries))
            index += 1
    if len(keys) > 1:
        raise ValueError(
            f"optimizer state keys differ between parameters: {sorted(map(sorted, keys))}"
        )
    optimizer.load_state_dict({"state": new, "param_groups": current["param_groups"]})


class ReplicaKeeper:
    """The newest state received per ``(job, stage)``: in memory and in a file each.

    The file is ``data_dir/<job>/replica-of-stage<N>.safetensors``, replaced
    atomically ([Note: nothing torn] in :mod:`edge.files`).
    """

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.kept: dict[tuple[str, int], tuple[StageState, bytes]] = {}
        """(job, stage) -> the state (its tensors not kept) and its bytes."""

    def path(self, job: str, stage: int) -> Path:
        return self.data_dir / job / f"replica-of-stage{stage}.safetensors"

    def keep(self, job: str, stage: int, data: bytes) -> StageState | None:
        """Keep ``data`` if it is a state of ``job``/``stage`` newer than the one kept.

        Returns the state kept, ``None`` for a repeat or an older state (of the same
        units), and raises :class:`ValueError` for one that is malformed or mislabelled.
        """
        st = read_state(data)
        if (st.job, st.stage) != (job, stage):
            raise ValueError(f"a state of job {st.job} stage {st.stage} on stage {stage}'s topic")
        old = self.kept.get((job, stage))
        same_units = old is not None and (old[0].start, old[0].end) == (st.start, st.end)
        if old is not None and same_units and old[0].step >= st.step:
            return None
        st.weights, st.optim = {}, {}
        self.kept[(job, stage)] = (st, data)
        write_atomic(self.path(job, stage), data)
        return st

    def forget_other_jobs(self, job: str) -> None:
        """Drop from memory (not from disk) what was kept for other jobs."""
        self.kept = {k: v for k, v in self.kept.items() if k[0] == job}
