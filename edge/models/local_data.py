"""Data that lives on a device: ``edgetrain agent --data NAME=SPEC``, and what is said of it.

[Note: local data]
An agent registers each dataset it holds under a NAME when it starts; SPEC is one of

- ``DATASET[:OPTION=VALUE,...]``: the train split of a built-in dataset
  (:data:`edge.models.datasets.DATASETS`), whole or one shard of it:
  ``shard=K/N`` is shard ``K`` (1 to ``N``) as :func:`~edge.models.datasets.shard_indices`
  cuts it (``seed=S`` picks another cut; the held-out test split is never sharded);
  other options go to the dataset (``size=512``, ``shape=3x32x32``);
- ``DIR``: every ``*.npz`` file in the directory, in name order; each holds ``x``
  (inputs, samples along axis 0; floating becomes float32, integer int64) and ``y``
  (labels, as many as ``x`` has samples; integer becomes int64, floating float32);
  every file's samples have the same shape;
- ``FILE.csv[:label=COLUMN,shape=AxB...]``: one sample a row after a header; the
  ``label`` column (default ``label``) holds integer class labels, every other
  column is a float32 feature, the features reshaped to ``shape`` when given;
- ``package.module:function``: ``function(split="train")`` returning a
  ``torch.utils.data.Dataset``, imported only under the agent's ``--allow-code``
  ([Note: user code on devices] in :mod:`edge.models.user_code`); nothing is
  imported otherwise.

A built-in name wins over a path of the same name: write ``./digits`` for a directory.

Bounds: a built-in dataset is as lazy as the zoo makes it; an ``.npz`` directory is
read lazily, its headers and labels when registered (and the first file's inputs, to
describe sample 0, then let go) and one file's inputs at a time when sampled (each
file's ``x`` at most :data:`MAX_NPZ_FILE_BYTES`); a CSV file is read whole when
registered (at most :data:`MAX_CSV_BYTES`); user code is the user's.

What leaves the device: only a :class:`LocalDatasetInfo` per dataset (sample count,
sample and label shapes and dtypes, the class count when cheap, and a built-in
dataset's own SPEC) under ``details["datasets"]`` of its profile
(:func:`announce`), never a sample. Every refusal is one line naming ``--data`` and
the item, raised before the agent connects.
"""

from __future__ import annotations

import csv
import math
import re
import threading
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch.utils.data import Dataset

from edge.errors import UserError
from edge.models.datasets import DATASETS, DatasetInfo, build_dataset, shard_indices
from edge.models.user_code import USER_NAME, CodeAllowance
from edge.problem import DeviceSpec

__all__ = [
    "DETAILS_KEY",
    "MAX_CSV_BYTES",
    "MAX_NPZ_FILE_BYTES",
    "CsvTable",
    "LocalData",
    "LocalDataset",
    "LocalDatasetInfo",
    "NpzFiles",
    "ZooShard",
    "announce",
    "announced",
    "register",
]

Sample = tuple[torch.Tensor, torch.Tensor]
Kind = Literal["zoo", "npz", "csv", "code"]

DETAILS_KEY = "datasets"
"""Where a device's profile (``DeviceSpec.details``) lists its local datasets."""
MAX_NPZ_FILE_BYTES = 1 << 28
"""Most bytes of one ``.npz`` file's ``x`` (and of its ``y``): it is loaded whole when sampled."""
MAX_CSV_BYTES = 1 << 26
"""Most bytes of a CSV file: it is read whole when registered."""
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_SHAPE = re.compile(r"[1-9][0-9]*(x[1-9][0-9]*)*")


class LocalDatasetInfo(BaseModel):
    """What a device says of one local dataset: its size and shapes, never a sample."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Kind
    samples: int = Field(ge=1)
    input_shape: tuple[int, ...]
    input_dtype: str
    label_shape: tuple[int, ...]
    label_dtype: str
    num_classes: int | None = Field(default=None, ge=1)
    """Classes (or the vocabulary) when known without reading the inputs."""
    source: str | None = None
    """A built-in dataset's SPEC (``digits:shard=1/3``); ``None`` for the device's own files."""


@dataclass(frozen=True)
class LocalDataset:
    """One registered dataset: its name, the SPEC it came from, the data and its info."""

    name: str
    spec: str
    dataset: Dataset[Any]
    info: LocalDatasetInfo


class LocalData(Mapping[str, LocalDataset]):
    """The datasets one device holds, by name (``--data`` order)."""

    def __init__(self, datasets: Sequence[LocalDataset] = ()) -> None:
        self._by_name = {d.name: d for d in datasets}

    def __getitem__(self, name: str) -> LocalDataset:
        held = self._by_name.get(name)
        if held is None:
            have = ", ".join(self._by_name) or "none"
            raise UserError(f"no local dataset {name!r} on this device (it holds: {have})")
        return held

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def infos(self) -> dict[str, LocalDatasetInfo]:
        return {name: d.info for name, d in self._by_name.items()}


# -- the datasets ----------------------------------------------------------------------


class ZooShard(Dataset[Sample]):
    """Samples ``indices`` (ascending) of a built-in dataset's train split."""

    def __init__(self, base: Dataset[Any], indices: np.ndarray) -> None:
        self.base = base
        self.indices = indices
        self.info: DatasetInfo | None = getattr(base, "info", None)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> Sample:
        x, y = self.base[int(self.indices[index])]
        return x, y


@dataclass(frozen=True)
class _NpzHeader:
    shape: tuple[int, ...]
    dtype: np.dtype[Any]


def _npz_header(path: Path, key: str) -> _NpzHeader:
    """Shape and dtype of array ``key`` in an ``.npz`` file, read without its data."""
    with zipfile.ZipFile(path) as archive:
        try:
            stream = archive.open(f"{key}.npy")
        except KeyError:
            keys = sorted(n.removesuffix(".npy") for n in archive.namelist())
            raise ValueError(f"no array {key!r} (it has {', '.join(keys) or 'none'})") from None
        with stream:
            version = np.lib.format.read_magic(stream)
            if version == (1, 0):
                shape, _, dtype = np.lib.format.read_array_header_1_0(stream)
            elif version == (2, 0):
                shape, _, dtype = np.lib.format.read_array_header_2_0(stream)
            else:
                raise ValueError(f"array {key!r} is in .npy format {version}, not 1.0 or 2.0")
    if dtype.hasobject:
        raise ValueError(f"array {key!r} holds Python objects")
    if not shape:
        raise ValueError(f"array {key!r} is a scalar, not one row per sample")
    return _NpzHeader(tuple(shape), dtype)


def _as_torch(array: np.ndarray) -> torch.Tensor:
    """Floating data as float32, integer data as int64 (what the zoo's datasets yield)."""
    if np.issubdtype(array.dtype, np.floating):
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
    if np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
    raise ValueError(f"dtype {array.dtype} is neither integer nor floating")


class NpzFiles(Dataset[Sample]):
    """The samples of ``*.npz`` files in name order: labels held, inputs read one file at a
    time (the file of the last sample read stays loaded)."""

    def __init__(self, files: Sequence[Path], labels: Sequence[torch.Tensor]) -> None:
        self.files = list(files)
        self.labels = torch.cat(list(labels))
        counts = [len(y) for y in labels]
        self.starts = np.cumsum([0, *counts])
        self._lock = threading.Lock()
        self._loaded: tuple[int, torch.Tensor] | None = None

    def __len__(self) -> int:
        return int(self.starts[-1])

    def release(self) -> None:
        """Let go of the inputs held (the next sample read loads its file again)."""
        with self._lock:
            self._loaded = None

    def _inputs(self, file: int) -> torch.Tensor:
        with self._lock:
            if self._loaded is None or self._loaded[0] != file:
                with np.load(self.files[file], allow_pickle=False) as npz:
                    self._loaded = (file, _as_torch(npz["x"]))
            return self._loaded[1]

    def __getitem__(self, index: int) -> Sample:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        index %= len(self)
        file = int(np.searchsorted(self.starts, index, side="right")) - 1
        return self._inputs(file)[index - int(self.starts[file])], self.labels[index]


class CsvTable(Dataset[Sample]):
    """The rows of a CSV file, held in memory: float32 features, int64 labels."""

    def __init__(self, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        self.inputs = inputs
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> Sample:
        return self.inputs[index], self.labels[index]


# -- SPEC parsing and loading ----------------------------------------------------------


def _options(text: str, accepted: Sequence[str] | None) -> dict[str, str]:
    """``KEY=VALUE,...`` as a dict; refuses a malformed, repeated or (with ``accepted``)
    unknown key."""
    out: dict[str, str] = {}
    for item in text.split(","):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise ValueError(f"{item!r} is not OPTION=VALUE")
        if key in out:
            raise ValueError(f"option {key!r} is given twice")
        if accepted is not None and key not in accepted:
            raise ValueError(f"unknown option {key!r} (takes: {', '.join(accepted)})")
        out[key] = value
    return out


def _shape(value: str) -> tuple[int, ...]:
    if not _SHAPE.fullmatch(value):
        raise ValueError(f"shape {value!r} is not sizes joined by x, such as 1x8x8")
    return tuple(int(v) for v in value.split("x"))


def _int(key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{key} {value!r} is not an integer") from None


def _zoo(name: str, options: dict[str, str]) -> tuple[Dataset[Any], str]:
    shard, shards = 1, 1
    seed = 0
    kwargs: dict[str, Any] = {}
    for key, value in options.items():
        if key == "shard":
            match = re.fullmatch(r"(\d+)/(\d+)", value)
            if match is None:
                raise ValueError(f"shard {value!r} is not K/N, such as 1/3")
            shard, shards = int(match.group(1)), int(match.group(2))
            if not 1 <= shard <= shards:
                raise ValueError(f"shard {value}: K must be 1 to N")
        elif key == "seed":
            seed = _int(key, value)
        elif key == "shape":
            kwargs[key] = _shape(value)
        else:
            kwargs[key] = _int(key, value)
    base = build_dataset(name, "train", **kwargs)
    if shards == 1:  # the whole split; no permutation to draw
        indices = np.arange(len(base), dtype=np.int64)  # type: ignore[arg-type]
    else:
        indices = shard_indices(name, len(base), shard, shards, seed)  # type: ignore[arg-type]
    return ZooShard(base, indices), ",".join(f"{k}={v}" for k, v in options.items())


def _npz_dir(path: Path) -> NpzFiles:
    files = sorted(p for p in path.glob("*.npz") if p.is_file())
    if not files:
        raise ValueError(f"directory {str(path)!r} has no .npz files")
    sample_shape: tuple[int, ...] | None = None
    labels: list[torch.Tensor] = []
    for file in files:
        try:
            x, y = _npz_header(file, "x"), _npz_header(file, "y")
        except (OSError, ValueError, zipfile.BadZipFile) as exc:
            raise ValueError(f"{file.name}: {exc}") from None
        for key, header in (("x", x), ("y", y)):
            size = math.prod(header.shape) * header.dtype.itemsize
            if size > MAX_NPZ_FILE_BYTES:
                raise ValueError(
                    f"{file.name}: {key} holds {size} bytes, more than {MAX_NPZ_FILE_BYTES}; "
                    "split it into smaller files"
                )
        if x.shape[0] != y.shape[0]:
            raise ValueError(f"{file.name}: x has {x.shape[0]} samples but y has {y.shape[0]}")
        if sample_shape is None:
            sample_shape = x.shape[1:]
        elif x.shape[1:] != sample_shape:
            raise ValueError(
                f"{file.name}: samples of shape {list(x.shape[1:])}, but {files[0].name}'s "
                f"are {list(sample_shape)}"
            )
        if labels and y.shape[1:] != tuple(labels[0].shape[1:]):
            raise ValueError(
                f"{file.name}: labels of shape {list(y.shape[1:])}, but {files[0].name}'s "
                f"are {list(labels[0].shape[1:])}"
            )
        with np.load(file, allow_pickle=False) as npz:
            try:
                labels.append(_as_torch(npz["y"]))
            except ValueError as exc:
                raise ValueError(f"{file.name}: y: {exc}") from None
        if not np.issubdtype(x.dtype, np.number) and x.dtype != np.bool_:
            raise ValueError(f"{file.name}: x: dtype {x.dtype} is neither integer nor floating")
        if labels[-1].dtype != labels[0].dtype:
            raise ValueError(f"{file.name}: labels of another dtype than {files[0].name}'s")
    return NpzFiles(files, labels)


def _csv_file(path: Path, options: dict[str, str]) -> CsvTable:
    label = options.get("label", "label")
    size = path.stat().st_size
    if size > MAX_CSV_BYTES:
        raise ValueError(
            f"{path.name} is {size} bytes, more than {MAX_CSV_BYTES}; use a directory of .npz files"
        )
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            rows = list(csv.reader(f))
    except UnicodeDecodeError:
        raise ValueError(f"{path.name} is not UTF-8 text") from None
    if not rows:
        raise ValueError(f"{path.name} is empty")
    header = [h.strip() for h in rows[0]]
    if label not in header:
        raise ValueError(
            f"{path.name} has no column {label!r} (columns: {', '.join(header)}); "
            "name the label column with label=COLUMN"
        )
    if len(header) < 2:
        raise ValueError(f"{path.name} has no feature column beside {label!r}")
    at = header.index(label)
    features: list[list[float]] = []
    labels: list[int] = []
    for line, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            raise ValueError(
                f"{path.name} line {line}: {len(row)} values, but the header has {len(header)}"
            )
        try:
            labels.append(int(row[at]))
        except ValueError:
            raise ValueError(
                f"{path.name} line {line}: label {row[at]!r} is not an integer"
            ) from None
        try:
            features.append([float(v) for i, v in enumerate(row) if i != at])
        except ValueError as exc:
            raise ValueError(f"{path.name} line {line}: {exc}") from None
    if not labels:
        raise ValueError(f"{path.name} has a header but no rows")
    inputs = torch.tensor(features, dtype=torch.float32)
    if "shape" in options:
        shape = _shape(options["shape"])
        if math.prod(shape) != inputs.shape[1]:
            raise ValueError(
                f"shape {options['shape']} holds {math.prod(shape)} values, but each row has "
                f"{inputs.shape[1]} features"
            )
        inputs = inputs.reshape(len(labels), *shape)
    return CsvTable(inputs, torch.tensor(labels, dtype=torch.int64))


def _classes(dataset: Dataset[Any]) -> int | None:
    """The class count a dataset states, or that its held integer labels imply."""
    info = getattr(dataset, "info", None)
    if isinstance(info, DatasetInfo):
        return info.num_classes
    stated = getattr(dataset, "num_classes", None)
    if isinstance(stated, int) and not isinstance(stated, bool) and stated >= 1:
        return stated
    labels = getattr(dataset, "labels", None)
    if (
        isinstance(labels, torch.Tensor)
        and labels.dtype == torch.int64
        and labels.numel()
        and int(labels.min()) >= 0
    ):
        return int(labels.max()) + 1
    return None


def _describe(dataset: Dataset[Any], kind: Kind, source: str | None) -> LocalDatasetInfo:
    try:
        samples = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{type(dataset).__name__} has no len()") from None
    if samples < 1:
        raise ValueError("it has no samples")
    try:
        x, y = dataset[0]
        x, y = torch.as_tensor(x), torch.as_tensor(y)
    except Exception as exc:
        one_line = f"{type(exc).__name__}: {exc}".replace("\n", " ")
        raise ValueError(f"sample 0 is not (input, label): {one_line}") from None
    return LocalDatasetInfo(
        kind=kind,
        samples=samples,
        input_shape=tuple(x.shape),
        input_dtype=str(x.dtype).removeprefix("torch."),
        label_shape=tuple(y.shape),
        label_dtype=str(y.dtype).removeprefix("torch."),
        num_classes=_classes(dataset),
        source=source,
    )


def _load(spec: str, allow_code: CodeAllowance) -> tuple[Dataset[Any], Kind, str | None]:
    head, colon, rest = spec.partition(":")
    if head in DATASETS:
        dataset, canonical = _zoo(head, _options(rest, None) if colon else {})
        return dataset, "zoo", head + (f":{canonical}" if canonical else "")
    if USER_NAME.fullmatch(spec) and not head.lower().endswith(".csv"):
        return build_dataset(spec, "train", allow_code=allow_code), "code", None
    path = Path(head).expanduser()
    if not path.exists():
        raise ValueError(
            f"no built-in dataset, directory or file {head!r} "
            f"(built-in: {', '.join(sorted(DATASETS))})"
        )
    if path.is_dir():
        if colon:
            raise ValueError(f"a directory of .npz files takes no options (got {rest!r})")
        return _npz_dir(path), "npz", None
    if path.suffix.lower() == ".csv":
        return _csv_file(path, _options(rest, ("label", "shape")) if colon else {}), "csv", None
    raise ValueError(f"{head!r} is not a directory of .npz files or a .csv file")


def register(items: Sequence[str], allow_code: CodeAllowance) -> LocalData:
    """The datasets of ``--data NAME=SPEC`` items (see [Note: local data]), loaded and
    described; a bad item raises a one-line :class:`UserError` naming it."""
    held: list[LocalDataset] = []
    for item in items:
        name, eq, spec = item.partition("=")
        name, spec = name.strip(), spec.strip()
        where = f"--data {item}"
        if not eq or not spec:
            raise UserError(f"{where}: expected NAME=SPEC, such as digits=digits:shard=1/3")
        if not _NAME.fullmatch(name):
            raise UserError(
                f"{where}: name {name!r} is not 1-64 of A-Z a-z 0-9 _ . - "
                "(starting with a letter or digit)"
            )
        if any(d.name == name for d in held):
            raise UserError(f"{where}: the name {name!r} is given twice")
        try:
            dataset, kind, source = _load(spec, allow_code)
            info = _describe(dataset, kind, source)
            if isinstance(dataset, NpzFiles):
                dataset.release()  # read again when a stage samples it, not held while idle
        except UserError as exc:
            raise UserError(f"{where}: {exc.message}") from None
        except (OSError, ValueError) as exc:
            raise UserError(f"{where}: {exc}".replace("\n", " ")) from None
        except Exception as exc:  # the user's own dataset code failed
            raise UserError(f"{where}: {type(exc).__name__}: {exc}".replace("\n", " ")) from None
        held.append(LocalDataset(name, spec, dataset, info))
    return LocalData(held)


# -- the announcement ------------------------------------------------------------------


def announce(spec: DeviceSpec, local: LocalData) -> DeviceSpec:
    """``spec`` with ``details["datasets"]`` listing ``local``'s infos, and only them: a
    profile file's own list is dropped (``spec`` itself when there is nothing to change)."""
    details = {k: v for k, v in (spec.details or {}).items() if k != DETAILS_KEY}
    if local:
        details[DETAILS_KEY] = {n: i.model_dump(mode="json") for n, i in local.infos().items()}
    if details == (spec.details or {}):
        return spec
    return spec.model_copy(update={"details": details or None})


def announced(profile: Mapping[str, Any] | None) -> dict[str, LocalDatasetInfo]:
    """The local datasets a profile (a ``DeviceSpec`` as JSON) announces; an entry that
    does not parse is left out, since a device's profile is its own to write."""
    details = (profile or {}).get("details") or {}
    listed = details.get(DETAILS_KEY) if isinstance(details, Mapping) else None
    if not isinstance(listed, Mapping):
        return {}
    out: dict[str, LocalDatasetInfo] = {}
    for name, entry in listed.items():
        try:
            out[str(name)] = LocalDatasetInfo.model_validate(entry)
        except ValidationError:
            continue
    return out
