"""Datasets that exist offline, and the registry a job names its dataset from.

This module owns the data side of a job: every built-in dataset is either
vendored in the package or generated locally, so nothing is downloaded at run
time and every device that builds a dataset with the same name, split and
options sees the same samples in the same order.

- ``digits``: the real UCI handwritten digits (1797 8x8 images, 10 classes) as
  shipped by scikit-learn, vendored in ``edge/models/data/digits.csv.gz`` (see
  ``DIGITS.md`` there for source and licence); scikit-learn is not needed.
- ``synthetic-images``: seeded random images of any shape, learnable (each
  class has a fixed random prototype; a sample mixes it with its own noise).
- ``text``: a char-level corpus made of the source of a fixed list of Python
  standard-library modules (:data:`TEXT_MODULES`), ASCII only. It depends on
  the stdlib text of the running Python version (down to the micro release):
  devices running the same Python see the same corpus.
- ``package.module:function``: a user's own dataset, called as
  ``function(split=..., **options)`` and returning a ``torch.utils.data.Dataset``.

Every integer option of a built-in dataset is bounded (the ``MAX_*`` constants, as
:mod:`edge.models.zoo` bounds a model's options): options come from the REST API and
job files, and a dataset is lazy, but a huge sample shape or class count would make
its first sample allocate without limit.

Determinism does not rest on any library's random stream: splits and seeds go
through BLAKE2b, and noise through numpy's legacy ``RandomState`` (MT19937),
whose stream numpy keeps frozen across versions and platforms.
"""

from __future__ import annotations

import difflib
import functools
import gzip
import hashlib
import inspect
import io
import math
import sysconfig
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from edge.errors import UserError
from edge.models.options import DATASET_RESERVED, check_options, check_reserved
from edge.models.user_code import ANY_CODE, CodeAllowance, import_reference

__all__ = [
    "DATASETS",
    "DIGITS_SPLIT_SEED",
    "DIGITS_TRAIN_SIZE",
    "MAX_CLASSES",
    "MAX_IMAGE_ELEMENTS",
    "MAX_SAMPLES",
    "MAX_SHARDED_SAMPLES",
    "SPLITS",
    "TEXT_MODULES",
    "TEXT_TRAIN_FRACTION",
    "TEXT_VOCAB_SIZE",
    "DatasetEntry",
    "DatasetInfo",
    "DigitsDataset",
    "SyntheticImages",
    "TextDataset",
    "build_dataset",
    "check_dataset_options",
    "dataset_info",
    "decode",
    "digits_split_indices",
    "list_datasets",
    "load_digits",
    "shard_indices",
    "text_corpus",
]

Sample = tuple[torch.Tensor, torch.Tensor]

SPLITS = ("train", "test")
DIGITS_FILE = Path(__file__).parent / "data" / "digits.csv.gz"
DIGITS_SPLIT_SEED = 0
DIGITS_TRAIN_SIZE = 1437  # 80% of 1797, rounded down; the other 360 are the test split
TEXT_VOCAB_SIZE = 128  # the ASCII codes; any other byte is dropped from the corpus
TEXT_TRAIN_FRACTION = 0.9
MAX_IMAGE_ELEMENTS = 1 << 24
"""Most elements of one synthetic image (64 MiB in float32); each side at most 2^16."""
MAX_CLASSES = 1 << 20
"""Most classes of a synthetic dataset."""
MAX_SAMPLES = 1 << 31
"""Most samples of a synthetic dataset, and the largest ``stride`` of ``text``."""
MAX_SEED = (1 << 63) - 1
MAX_SHARDED_SAMPLES = 1 << 24
"""Most samples of a dataset that :func:`shard_indices` cuts (its permutation is held whole)."""
# Pure-Python stdlib modules present from Python 3.11 on; read as ``name.py`` or
# ``name/__init__.py`` under ``sysconfig.get_paths()["stdlib"]``, in this order.
TEXT_MODULES = (
    "abc",
    "argparse",
    "bisect",
    "calendar",
    "colorsys",
    "contextlib",
    "copy",
    "dataclasses",
    "difflib",
    "fnmatch",
    "fractions",
    "functools",
    "glob",
    "heapq",
    "numbers",
    "operator",
    "pprint",
    "queue",
    "random",
    "reprlib",
    "sched",
    "shlex",
    "statistics",
    "string",
    "textwrap",
)


@dataclass(frozen=True)
class DatasetInfo:
    """What a model builder needs to match a dataset (shapes exclude the batch)."""

    name: str
    input_shape: tuple[int, ...]
    input_dtype: str  # "float32" for images, "int64" for token ids
    num_classes: int  # classes, or the vocabulary size for a language model
    target_shape: tuple[int, ...] = ()  # () for one label per sample


def _hash64(*parts: object) -> int:
    """A 64-bit integer from the parts, identical on every machine and version."""
    key = "/".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def _int_option(
    dataset: str, field: str, value: object, minimum: int | None = 1, maximum: int | None = None
) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"dataset {dataset!r}: {field} must be an integer (got {value!r})")
    if minimum is not None and value < minimum:
        raise UserError(f"dataset {dataset!r}: {field} must be >= {minimum} (got {value})")
    if maximum is not None and value > maximum:
        raise UserError(f"dataset {dataset!r}: {field} must be <= {maximum} (got {value})")
    return value


def _check_split(dataset: str, split: str) -> str:
    if split not in SPLITS:
        raise UserError(f"dataset {dataset!r}: unknown split {split!r} (expected train or test)")
    return split


@functools.lru_cache(maxsize=1)
def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """All 1797 digits once per process: uint8 images [1797, 8, 8] (0..16), int64 labels.

    The arrays are read-only because they are shared by every caller.
    """
    text = gzip.decompress(DIGITS_FILE.read_bytes()).decode("ascii")
    table = np.loadtxt(io.StringIO(text), delimiter=",", dtype=np.int64)
    if table.shape != (1797, 65) or table.min() < 0 or table[:, :64].max() > 16:
        raise UserError(f"{DIGITS_FILE}: not the digits table (shape {table.shape})")
    images = table[:, :64].astype(np.uint8).reshape(-1, 8, 8)
    labels = table[:, 64].copy()
    images.setflags(write=False)
    labels.setflags(write=False)
    return images, labels


def digits_split_indices(split: str) -> np.ndarray:
    """Row numbers of a digits split.

    The permutation sorts rows 0..1796 by ``BLAKE2b("digits/0/<row>")`` (seed
    :data:`DIGITS_SPLIT_SEED`); its first :data:`DIGITS_TRAIN_SIZE` rows are
    ``train``, the remaining 360 ``test``, both in permutation order.
    """
    _check_split("digits", split)
    order = sorted(range(1797), key=lambda row: _hash64("digits", DIGITS_SPLIT_SEED, row))
    chosen = order[:DIGITS_TRAIN_SIZE] if split == "train" else order[DIGITS_TRAIN_SIZE:]
    return np.asarray(chosen, dtype=np.int64)


def shard_indices(dataset: str, size: int, shard: int, shards: int, seed: int = 0) -> np.ndarray:
    """Sample numbers of shard ``shard`` (1-based) of ``shards`` of a split of ``size`` samples.

    A permutation of ``0..size-1`` is drawn by numpy's legacy ``RandomState`` seeded
    with ``BLAKE2b("shard/<dataset>/<seed>/<size>")``; shard ``k`` is its piece
    ``[(k-1)*size//shards, k*size//shards)``, in ascending sample order. So the
    shards of one ``(dataset, seed, size, shards)`` are disjoint, their union is
    every sample, their sizes differ by at most one, and shard ``k`` is the same on
    every device and every run. ``edgetrain agent --data NAME=DATASET:shard=K/N``
    ([Note: local data] in :mod:`edge.models.local_data`) cuts a train split with it.
    """
    _int_option(dataset, "shards", shards, maximum=MAX_SAMPLES)
    _int_option(dataset, "shard", shard, maximum=shards)
    _int_option(dataset, "seed", seed, minimum=-MAX_SEED, maximum=MAX_SEED)
    if size > MAX_SHARDED_SAMPLES:
        raise UserError(
            f"dataset {dataset!r}: {size} samples are more than the {MAX_SHARDED_SAMPLES} "
            "that can be cut into shards"
        )
    if shards > size:
        raise UserError(f"dataset {dataset!r}: {shards} shards of {size} samples leave some empty")
    rng = np.random.RandomState(_hash64("shard", dataset, seed, size) % 2**32)
    order = rng.permutation(size)
    piece = order[(shard - 1) * size // shards : shard * size // shards]
    return np.sort(piece).astype(np.int64)


class DigitsDataset(Dataset[Sample]):
    """Handwritten digits: ``x`` float32 [1, 8, 8] in [0, 1] (pixel / 16), ``y`` int64 scalar."""

    def __init__(self, split: str = "train") -> None:
        images, labels = load_digits()
        self.split = split
        self.indices = digits_split_indices(split)
        self.images = torch.from_numpy(images[self.indices, None].astype(np.float32) / 16.0)
        self.labels = torch.from_numpy(labels[self.indices].copy())
        self.info = DatasetInfo(
            name="digits", input_shape=(1, 8, 8), input_dtype="float32", num_classes=10
        )

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def resident_bytes(self) -> int:
        """Bytes this dataset holds in memory: its images and labels."""
        return self.images.nbytes + self.labels.nbytes

    def __getitem__(self, index: int) -> Sample:
        return self.images[index], self.labels[index]


class SyntheticImages(Dataset[Sample]):
    """Seeded random images: sample ``i`` depends only on (split, seed, i).

    Each class ``c`` has a prototype drawn from ``(seed, c)``, shared by both
    splits; sample ``i`` is ``0.5 * prototype[label] + 0.5 * noise`` with noise
    and label drawn from ``(split, seed, i)``, so train and test are different
    streams of the same task. Values are float32 in [0, 1).
    """

    _PROTOTYPE_CACHE_ELEMENTS = 1 << 24

    def __init__(
        self,
        split: str = "train",
        shape: tuple[int, ...] = (3, 32, 32),
        num_classes: int = 10,
        size: int = 1024,
        seed: int = 0,
    ) -> None:
        name = "synthetic-images"
        if not isinstance(shape, tuple | list) or not 1 <= len(shape) <= 8:
            raise UserError(
                f"dataset {name!r}: shape must be a list of 1 to 8 sizes (got {shape!r:.80})"
            )
        self.shape = tuple(_int_option(name, "shape", d, maximum=1 << 16) for d in shape)
        if math.prod(self.shape) > MAX_IMAGE_ELEMENTS:
            raise UserError(
                f"dataset {name!r}: shape {list(self.shape)} has more than "
                f"{MAX_IMAGE_ELEMENTS} elements"
            )
        self.num_classes = _int_option(name, "num_classes", num_classes, maximum=MAX_CLASSES)
        self.size = _int_option(name, "size", size, maximum=MAX_SAMPLES)
        self.seed = _int_option(name, "seed", seed, minimum=-MAX_SEED, maximum=MAX_SEED)
        self.split = _check_split(name, split)
        self.info = DatasetInfo(
            name=name, input_shape=self.shape, input_dtype="float32", num_classes=self.num_classes
        )
        small = self.num_classes * int(np.prod(self.shape)) <= self._PROTOTYPE_CACHE_ELEMENTS
        self._cache: dict[int, np.ndarray] | None = {} if small else None

    def _uniform(self, *key: object) -> np.ndarray:
        rng = np.random.RandomState(_hash64("synthetic-images", *key) % 2**32)
        return rng.random_sample(self.shape)

    def _prototype(self, label: int) -> np.ndarray:
        if self._cache is not None and label in self._cache:
            return self._cache[label]
        proto = self._uniform("prototype", self.seed, label)
        if self._cache is not None:
            self._cache[label] = proto
        return proto

    def label(self, index: int) -> int:
        return _hash64("label", self.split, self.seed, index) % self.num_classes

    def __len__(self) -> int:
        return self.size

    @property
    def resident_bytes(self) -> int:
        """Most bytes this dataset holds in memory: every class's prototype (float64),
        when they are few enough to be kept; samples are made when read."""
        if self._cache is None:
            return 0
        return self.num_classes * math.prod(self.shape) * 8

    def __getitem__(self, index: int) -> Sample:
        if not -self.size <= index < self.size:
            raise IndexError(f"sample {index} out of range for {self.size} samples")
        index %= self.size
        label = self.label(index)
        noise = self._uniform("noise", self.split, self.seed, index)
        x = 0.5 * self._prototype(label) + 0.5 * noise
        return torch.from_numpy(x.astype(np.float32)), torch.tensor(label, dtype=torch.int64)


@functools.lru_cache(maxsize=1)
def text_corpus() -> str:
    """The ``text`` corpus: the :data:`TEXT_MODULES` sources joined by newlines.

    Bytes are read raw, CRLF becomes LF, non-ASCII bytes are dropped. It is the
    same on every machine with the same Python version (its stdlib text).
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    for module in TEXT_MODULES:
        path = stdlib / f"{module}.py"
        if not path.is_file():
            path = stdlib / module / "__init__.py"
        if not path.is_file():
            raise UserError(f"dataset 'text': no source of stdlib module {module!r} in {stdlib}")
        raw = path.read_bytes().replace(b"\r\n", b"\n")
        parts.append(raw.decode("ascii", errors="ignore"))
    return "\n".join(parts)


@functools.lru_cache(maxsize=1)
def _corpus_codes() -> torch.Tensor:
    return torch.frombuffer(bytearray(text_corpus().encode("ascii")), dtype=torch.uint8)


def decode(tensor: torch.Tensor) -> str:
    """Characters of a tensor of ASCII codes (any shape, read in row-major order)."""
    codes = [int(v) for v in tensor.flatten().tolist()]
    if any(not 0 <= c < TEXT_VOCAB_SIZE for c in codes):
        raise ValueError(f"decode: values must be ASCII codes 0..{TEXT_VOCAB_SIZE - 1}")
    return bytes(codes).decode("ascii")


class TextDataset(Dataset[Sample]):
    """Next-character prediction over :func:`text_corpus`.

    ``train`` is the first :data:`TEXT_TRAIN_FRACTION` of the corpus, ``test``
    the rest. Sample ``i`` starts at ``start + i * stride``: ``x`` is the next
    ``block_size`` codes (int64), ``y`` the same window shifted by one. Windows
    never cross the split boundary. ``stride`` defaults to ``block_size``.
    """

    def __init__(
        self, split: str = "train", block_size: int = 64, stride: int | None = None
    ) -> None:
        self.block_size = _int_option("text", "block_size", block_size)
        self.stride = _int_option(
            "text", "stride", block_size if stride is None else stride, maximum=MAX_SAMPLES
        )
        self.split = _check_split("text", split)
        codes = _corpus_codes()
        cut = int(len(codes) * TEXT_TRAIN_FRACTION)
        self.start, self.stop = (0, cut) if split == "train" else (cut, len(codes))
        span = self.stop - self.start
        if span < self.block_size + 1:
            raise UserError(
                f"dataset 'text': block_size {self.block_size} is too large for the "
                f"{split} split ({span} characters)"
            )
        self._codes = codes[self.start : self.stop]
        self._len = (span - self.block_size - 1) // self.stride + 1
        window = (self.block_size,)
        self.info = DatasetInfo(
            name="text",
            input_shape=window,
            input_dtype="int64",
            num_classes=TEXT_VOCAB_SIZE,
            target_shape=window,
        )

    def window(self, index: int) -> tuple[int, int]:
        """Corpus offsets ``[begin, end)`` that sample ``index`` reads (inputs and targets)."""
        begin = self.start + index * self.stride
        return begin, begin + self.block_size + 1

    def __len__(self) -> int:
        return self._len

    @property
    def resident_bytes(self) -> int:
        """Bytes this dataset holds in memory: the corpus's codes (one byte each)."""
        return _corpus_codes().nbytes

    def __getitem__(self, index: int) -> Sample:
        if not -self._len <= index < self._len:
            raise IndexError(f"sample {index} out of range for {self._len} samples")
        begin = (index % self._len) * self.stride
        chunk = self._codes[begin : begin + self.block_size + 1].to(torch.int64)
        return chunk[:-1], chunk[1:]


@dataclass(frozen=True)
class DatasetEntry:
    """A registered dataset: ``builder(split=..., **options)`` and one line about it."""

    builder: Callable[..., Dataset[Any]]
    description: str


DATASETS: dict[str, DatasetEntry] = {
    "digits": DatasetEntry(DigitsDataset, "UCI handwritten digits, 1x8x8 in [0,1], 10 classes"),
    "synthetic-images": DatasetEntry(SyntheticImages, "seeded random images of any shape"),
    "text": DatasetEntry(TextDataset, "char-level ASCII text of Python stdlib source code"),
}


def list_datasets() -> list[tuple[str, str]]:
    """(name, description) of every built-in dataset, sorted by name."""
    return sorted((name, entry.description) for name, entry in DATASETS.items())


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".replace("\n", " ")


def _build_user_dataset(
    name: str, split: str, options: dict[str, Any], allow_code: CodeAllowance
) -> Dataset[Any]:
    func = import_reference(name, "dataset", allow_code)
    func_name = name.partition(":")[2]
    if not callable(func):
        raise UserError(f"dataset {name!r}: {name.replace(':', '.')} is not callable")
    try:
        inspect.signature(func).bind(split=split, **options)
    except TypeError as exc:
        raise UserError(
            f"dataset {name!r}: {func_name}() cannot take split= and options "
            f"{sorted(options)} ({exc})"
        ) from exc
    except ValueError:  # no signature to inspect (a builtin); the call will tell
        pass
    result = func(split=split, **options)
    if not isinstance(result, Dataset):
        raise UserError(
            f"dataset {name!r}: {func_name}() returned {type(result).__name__}, "
            "not a torch.utils.data.Dataset"
        )
    return result


def build_dataset(
    name: str, split: str = "train", *, allow_code: CodeAllowance = ANY_CODE, **options: Any
) -> Dataset[Any]:
    """The dataset ``name`` (built-in or ``package.module:function``) for ``split``; a
    user dataset only if ``allow_code`` lets its module in ([Note: user code on devices]).

    Raises :class:`~edge.errors.UserError` with one line for an unknown name,
    split or option, a module not allowed or that cannot be imported, a missing
    attribute, or a result that is not a ``Dataset``.
    """
    _check_split(name, split)
    check_dataset_options(name, options)
    if ":" in name:
        return _build_user_dataset(name, split, options, allow_code)
    return DATASETS[name].builder(split=split, **options)


def check_dataset_options(name: str, options: Mapping[str, Any]) -> None:
    """A one-line :class:`UserError` unless ``name`` is a built-in dataset (or a user's
    ``package.module:function``) and ``options`` are what it takes ([Note: options are
    data] in :mod:`edge.models.options`); nothing is built or imported.

    Call it before passing options on as keywords: a reserved name (``split``,
    ``name``, ``allow_code``) would clash with the call itself.
    """
    if ":" in name:
        check_reserved(f"dataset {name!r}", "dataset_options", options, DATASET_RESERVED)
        return
    entry = DATASETS.get(name)
    if entry is None:
        close = difflib.get_close_matches(name, DATASETS, n=3, cutoff=0.5)
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise UserError(
            f"unknown dataset {name!r}{hint} (known: {', '.join(sorted(DATASETS))}; "
            "or give 'package.module:function')"
        )
    where = f"dataset {name!r}"
    check_options(where, "dataset_options", entry.builder, options, DATASET_RESERVED)


def dataset_info(name: str, **options: Any) -> DatasetInfo:
    """Input shape, dtype and class count (or vocabulary) of a dataset's train split.

    A user dataset reports an ``info`` attribute holding a :class:`DatasetInfo`,
    or a ``num_classes`` attribute; the input shape then comes from sample 0.
    """
    dataset = build_dataset(name, "train", **options)
    info = getattr(dataset, "info", None)
    if isinstance(info, DatasetInfo):
        return info
    num_classes = getattr(dataset, "num_classes", None)
    if isinstance(num_classes, bool) or not isinstance(num_classes, int):
        raise UserError(
            f"dataset {name!r}: give it an 'info' attribute (edge.models.datasets.DatasetInfo) "
            "or a 'num_classes' attribute so a model can be matched to it"
        )
    try:
        x, y = dataset[0]
        x, y = torch.as_tensor(x), torch.as_tensor(y)
    except Exception as exc:
        raise UserError(f"dataset {name!r}: sample 0 is not (x, y): {_one_line(exc)}") from exc
    dtype = str(x.dtype).removeprefix("torch.")
    return DatasetInfo(
        name=name,
        input_shape=tuple(x.shape),
        input_dtype=dtype,
        num_classes=num_classes,
        target_shape=tuple(y.shape),
    )
