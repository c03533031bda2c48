"""Offline datasets: digits, synthetic images, stdlib text, and user datasets by name."""

from __future__ import annotations

import sys
import sysconfig
import textwrap
from collections.abc import Iterator, Sized
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from edge.errors import UserError
from edge.models import datasets as ds
from edge.models.datasets import (
    TEXT_VOCAB_SIZE,
    DatasetInfo,
    build_dataset,
    dataset_info,
    decode,
    list_datasets,
    load_digits,
    text_corpus,
)


def _digits(split: str = "train") -> ds.DigitsDataset:
    dataset = build_dataset("digits", split)
    assert isinstance(dataset, ds.DigitsDataset)
    return dataset


def _synthetic(split: str = "train", **options: Any) -> ds.SyntheticImages:
    dataset = build_dataset("synthetic-images", split, **options)
    assert isinstance(dataset, ds.SyntheticImages)
    return dataset


def _text(split: str = "train", **options: Any) -> ds.TextDataset:
    dataset = build_dataset("text", split, **options)
    assert isinstance(dataset, ds.TextDataset)
    return dataset


# ---------------------------------------------------------------- digits


def test_digits_sizes_shapes_and_values() -> None:
    train, test = _digits("train"), _digits("test")
    assert (len(train), len(test)) == (1437, 360)
    x, y = train[0]
    assert x.dtype == torch.float32 and tuple(x.shape) == (1, 8, 8)
    assert y.dtype == torch.int64 and y.dim() == 0
    for split in (train, test):
        xs = torch.stack([split[i][0] for i in range(len(split))])
        assert xs.min().item() == 0.0 and xs.max().item() == 1.0  # pixel / 16, not / 255
        ys = torch.stack([split[i][1] for i in range(len(split))])
        assert set(ys.tolist()) == set(range(10))
    assert dataset_info("digits") == DatasetInfo("digits", (1, 8, 8), "float32", 10)


def test_digits_is_the_real_scikit_learn_table() -> None:
    images, labels = load_digits()
    assert load_digits() is load_digits()  # loaded once per process
    assert images.shape == (1797, 8, 8) and labels.shape == (1797,)
    assert not images.flags.writeable and not labels.flags.writeable
    # first row of sklearn's digits.csv.gz, and its per-class counts
    assert images[0, 0].tolist() == [0, 0, 5, 13, 9, 1, 0, 0] and labels[0] == 0
    assert np.bincount(labels).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]


def test_digits_split_is_disjoint_deterministic_and_matches_rows() -> None:
    train, test = _digits("train"), _digits("test")
    tr, te = set(train.indices.tolist()), set(test.indices.tolist())
    assert not tr & te and tr | te == set(range(1797))
    again = _digits("train")
    assert np.array_equal(train.indices, again.indices)
    # pinned: the permutation is BLAKE2b-based, the same on every machine and version
    assert ds.digits_split_indices("train")[:5].tolist() == [912, 825, 1209, 1794, 1289]
    assert ds.digits_split_indices("test")[:3].tolist() == [33, 387, 1390]
    images, labels = load_digits()
    row = int(train.indices[7])
    x, y = train[7]
    assert torch.equal(x[0] * 16, torch.from_numpy(images[row].astype(np.float32)))
    assert int(y) == labels[row]
    xb, yb = next(iter(DataLoader(train, batch_size=32)))
    assert tuple(xb.shape) == (32, 1, 8, 8) and tuple(yb.shape) == (32,)


# ---------------------------------------------------------------- synthetic images


def _all(dataset: ds.SyntheticImages) -> tuple[torch.Tensor, torch.Tensor]:
    n = len(dataset)
    xs, ys = zip(*(dataset[i] for i in range(n)), strict=True)
    return torch.stack(xs), torch.stack(ys)


def test_synthetic_images_identical_across_builds() -> None:
    a = _synthetic(size=32)
    b = _synthetic(size=32)
    xa, ya = _all(a)
    x5, y5 = b[5]  # one sample alone, without building the others first
    xb, yb = _all(b)
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert torch.equal(x5, xa[5]) and torch.equal(y5, ya[5])
    assert xa.dtype == torch.float32 and tuple(xa.shape) == (32, 3, 32, 32)
    assert xa.min().item() >= 0.0 and xa.max().item() < 1.0


def test_synthetic_images_differ_across_seeds_and_splits() -> None:
    base, _ = _all(_synthetic(size=16, seed=0))
    other, _ = _all(_synthetic(size=16, seed=1))
    test, _ = _all(_synthetic("test", size=16, seed=0))
    assert not torch.equal(base, other) and not torch.equal(base, test)
    assert all(not torch.equal(base[i], test[i]) for i in range(16))


def test_synthetic_images_shape_labels_and_learnable_across_splits() -> None:
    opts = {"shape": [3, 8, 8], "num_classes": 4, "size": 200, "seed": 7}  # a list, as TOML gives
    x, y = _all(_synthetic("train", **opts))
    assert tuple(x.shape) == (200, 3, 8, 8) and set(y.tolist()) == {0, 1, 2, 3}
    assert dataset_info("synthetic-images", **opts) == DatasetInfo(
        "synthetic-images", (3, 8, 8), "float32", 4
    )
    means = torch.stack([x[y == c].mean(0) for c in range(4)])
    xt, yt = _all(_synthetic("test", **opts))
    dist = ((xt[:, None] - means[None]) ** 2).flatten(2).sum(-1)
    assert (dist.argmin(1) == yt).float().mean().item() > 0.9  # same prototypes in test


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"size": 0}, "size must be >= 1"),
        ({"shape": "abc"}, "option shape: input should be a valid array"),
        ({"shape": [3, -1]}, "shape must be >= 1"),
        ({"num_classes": 2.5}, "option num_classes: input should be a valid integer"),
        ({"colour": True}, "unknown option 'colour'"),
        # Bounded: a sample or a class table must not allocate without limit.
        ({"shape": [65536] * 8}, r"shape \[65536, .*\] has more than 16777216 elements"),
        ({"shape": [3, 70000]}, r"shape must be <= 65536 \(got 70000\)"),
        ({"shape": [1] * 9}, "shape must be a list of 1 to 8 sizes"),
        ({"num_classes": 10**9}, r"num_classes must be <= 1048576 \(got 1000000000\)"),
        ({"size": 10**12}, r"size must be <= 2147483648 \(got 1000000000000\)"),
        ({"seed": 2**70}, r"seed must be <= 9223372036854775807"),
    ],
)
def test_synthetic_images_bad_options(options: dict[str, Any], message: str) -> None:
    with pytest.raises(UserError, match=f"^dataset 'synthetic-images': {message}"):
        build_dataset("synthetic-images", **options)


# ---------------------------------------------------------------- text


def test_text_samples_are_ascii_and_shifted_by_one() -> None:
    assert TEXT_VOCAB_SIZE == 128
    corpus = text_corpus()
    assert corpus.isascii() and len(corpus) > 100_000
    assert "class ArgumentParser" in corpus and "def dedent(" in corpus
    train = _text(block_size=64)
    for i in (0, 1, len(train) - 1):
        x, y = train[i]
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (64,)
        assert x.min().item() >= 0 and x.max().item() < TEXT_VOCAB_SIZE
        assert torch.equal(y[:-1], x[1:])
        begin, end = train.window(i)
        assert (begin, end) == (64 * i, 64 * i + 65)
        assert decode(x) + decode(y[-1:]) == corpus[begin:end]
    assert dataset_info("text", block_size=32) == DatasetInfo("text", (32,), "int64", 128, (32,))


def test_text_train_and_test_cover_disjoint_ranges() -> None:
    corpus = text_corpus()
    train, test = _text("train"), _text("test")
    assert train.stop == test.start == int(len(corpus) * 0.9)
    assert test.stop == len(corpus)
    assert train.window(len(train) - 1)[1] <= test.window(0)[0]
    assert test.window(len(test) - 1)[1] <= len(corpus)
    x, _ = test[0]
    assert decode(x) == corpus[test.start : test.start + 64]
    strided = _text(block_size=64, stride=16)
    assert strided.window(1)[0] == 16 and len(strided) > 3 * len(train)


def test_text_decode_and_bad_options() -> None:
    assert decode(torch.tensor([[72, 105], [33, 10]])) == "Hi!\n"
    with pytest.raises(ValueError, match="ASCII"):
        decode(torch.tensor([200]))
    with pytest.raises(UserError, match=r"block_size .* too large"):
        build_dataset("text", "test", block_size=10_000_000)
    with pytest.raises(UserError, match="block_size must be >= 1"):
        build_dataset("text", block_size=0)
    with pytest.raises(UserError, match=r"stride must be <= 2147483648 \(got 10000000000\)"):
        build_dataset("text", stride=10**10)


@pytest.fixture
def fresh_corpus() -> Iterator[None]:
    ds.text_corpus.cache_clear()
    ds._corpus_codes.cache_clear()
    yield
    ds.text_corpus.cache_clear()
    ds._corpus_codes.cache_clear()


def test_text_corpus_drops_non_ascii_and_reads_packages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_corpus: None
) -> None:
    for module in ds.TEXT_MODULES:
        (tmp_path / f"{module}.py").write_bytes(f"# {module}\r\n".encode())
    (tmp_path / "abc.py").write_bytes("x = 'caf\u00e9 \u2713'\n".encode())
    (tmp_path / "string.py").unlink()
    (tmp_path / "string").mkdir()
    (tmp_path / "string" / "__init__.py").write_bytes(b"# string package\n")
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    corpus = text_corpus()
    assert corpus.startswith("x = 'caf '\n\n# argparse\n\n# bisect\n")
    assert "\r" not in corpus and "# string package\n" in corpus
    (tmp_path / "heapq.py").unlink()
    ds.text_corpus.cache_clear()
    with pytest.raises(UserError, match="stdlib module 'heapq'"):
        text_corpus()


# ---------------------------------------------------------------- registry and user datasets

USER_MODULE = textwrap.dedent(
    """
    import torch
    from torch.utils.data import Dataset

    class Squares(Dataset):
        num_classes = 3

        def __init__(self, split, n):
            self.split, self.n = split, n

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            return torch.full((2, 5), float(i * i)), torch.tensor(i % 3)

    def make(split, n=4):
        return Squares(split, n)

    def not_a_dataset(split):
        return [1, 2, 3]

    def no_split():
        return Squares("train", 1)

    VALUE = 3
    """
)


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = "edgetrain_test_user_ds"
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    (tmp_path / "edgetrain_test_broken_ds.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for module in (name, "edgetrain_test_broken_ds"):
        sys.modules.pop(module, None)


def test_user_dataset_by_module_function(user_module: str) -> None:
    dataset = build_dataset(f"{user_module}:make", "test", n=5)
    assert isinstance(dataset, Sized) and len(dataset) == 5
    assert vars(dataset)["split"] == "test"
    assert float(dataset[2][0][0, 0]) == 4.0
    info = dataset_info(f"{user_module}:make")
    assert info == DatasetInfo(f"{user_module}:make", (2, 5), "float32", 3, ())


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("edgetrain_no_such_module:make", {}, "cannot import module 'edgetrain_no_such_module'"),
        (
            "edgetrain_test_broken_ds:make",
            {},
            "importing 'edgetrain_test_broken_ds': RuntimeError: boom",
        ),
        ("{mod}:missing", {}, "module '{mod}' has no attribute 'missing'"),
        ("{mod}:VALUE", {}, "{mod}.VALUE is not callable"),
        (
            "{mod}:not_a_dataset",
            {},
            r"not_a_dataset\(\) returned list, not a torch.utils.data.Dataset",
        ),
        ("{mod}:no_split", {}, r"no_split\(\) cannot take split= and options \[\]"),
        ("{mod}:make", {"colour": 1}, r"make\(\) cannot take split= and options \['colour'\]"),
        ("{mod}:make:extra", {}, "expected the form 'package.module:function'"),
        ("my-module:make", {}, "expected the form 'package.module:function'"),
        ("digit", {}, "unknown dataset 'digit'; did you mean 'digits'\\?"),
        ("imagenet", {}, r"unknown dataset 'imagenet' \(known: digits, synthetic-images, text;"),
    ],
)
def test_bad_dataset_names(
    user_module: str, name: str, options: dict[str, Any], message: str
) -> None:
    name, message = name.format(mod=user_module), message.format(mod=user_module)
    with pytest.raises(UserError, match=message) as err:
        build_dataset(name, **options)
    assert "\n" not in err.value.message and err.value.exit_code == 2


def test_unknown_split_and_user_dataset_without_class_count(user_module: str) -> None:
    for name in ("digits", "text", f"{user_module}:make"):
        with pytest.raises(UserError, match="unknown split 'valid'"):
            build_dataset(name, "valid")
    build_dataset(f"{user_module}:make")  # imported now
    sys.modules[user_module].Squares.num_classes = None
    with pytest.raises(UserError, match="'num_classes' attribute"):
        dataset_info(f"{user_module}:make")


def test_list_datasets() -> None:
    listed = list_datasets()
    assert [name for name, _ in listed] == ["digits", "synthetic-images", "text"]
    assert all(text and "\n" not in text for _, text in listed)
