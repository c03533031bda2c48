"""``--data NAME=SPEC``: shards of the zoo, .npz directories, CSV files, user code, refusals.

tests/integration/test_agent_local_data.py starts a real agent with them and watches
the broker; here the SPECs are registered in-process.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from edge.errors import UserError
from edge.models import local_data
from edge.models.datasets import DigitsDataset, shard_indices
from edge.models.local_data import (
    LocalData,
    LocalDatasetInfo,
    announce,
    announced,
    register,
)
from edge.models.user_code import ZOO_ONLY, allow_prefixes
from edge.problem import DeviceSpec
from edge.runtime.data import EpochSampler, load_batch, open_local

DIGITS_TRAIN = 1437
NAME_CHARS = "A-Z a-z 0-9 _ . -"
NAME_IT = "name the label column with label=COLUMN"


# -- shards ------------------------------------------------------------------------------


@pytest.mark.parametrize("shards", [1, 2, 3, 7])
def test_shards_are_disjoint_and_cover_the_split(shards: int) -> None:
    pieces = [shard_indices("digits", DIGITS_TRAIN, k, shards) for k in range(1, shards + 1)]
    for a, b in itertools.combinations(pieces, 2):
        assert not set(a.tolist()) & set(b.tolist())
    assert sorted(np.concatenate(pieces).tolist()) == list(range(DIGITS_TRAIN))
    sizes = [len(p) for p in pieces]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == DIGITS_TRAIN
    assert all(p.tolist() == sorted(p.tolist()) for p in pieces)


def test_shards_are_stable_and_seeded() -> None:
    # Pinned: a shard must be the same on every device, run and version.
    assert shard_indices("digits", DIGITS_TRAIN, 1, 3)[:8].tolist() == [
        4,
        6,
        11,
        13,
        15,
        19,
        20,
        23,
    ]
    assert shard_indices("digits", DIGITS_TRAIN, 3, 3)[-5:].tolist() == [
        1420,
        1424,
        1427,
        1428,
        1429,
    ]
    assert shard_indices("digits", 10, 2, 3).tolist() == [0, 5, 6]
    assert shard_indices("digits", 10, 2, 3, seed=1).tolist() == [1, 2, 8]


def test_registered_shards_hold_the_split_samples() -> None:
    full = DigitsDataset("train")
    held = register(["a=digits:shard=1/3", "b=digits:shard=2/3", "c=digits:shard=3/3"], ZOO_ONLY)
    seen = []
    for k, name in enumerate("abc", start=1):
        dataset = held[name].dataset
        indices = shard_indices("digits", DIGITS_TRAIN, k, 3)
        assert len(dataset) == len(indices)  # type: ignore[arg-type]
        for i in (0, len(indices) - 1):
            x, y = dataset[i]
            assert torch.equal(x, full[int(indices[i])][0]) and y == full[int(indices[i])][1]
        seen += indices.tolist()
    assert sorted(seen) == list(range(DIGITS_TRAIN))
    assert held["a"].info == LocalDatasetInfo(
        kind="zoo",
        samples=479,
        input_shape=(1, 8, 8),
        input_dtype="float32",
        label_shape=(),
        label_dtype="int64",
        num_classes=10,
        source="digits:shard=1/3",
    )


def test_a_whole_zoo_split_and_options() -> None:
    held = register(["all=digits", "s=synthetic-images:size=12,shape=1x4x4,shard=2/3"], ZOO_ONLY)
    assert held["all"].info.samples == DIGITS_TRAIN and held["all"].info.source == "digits"
    s = held["s"].info
    assert (s.samples, s.input_shape, s.source) == (
        4,
        (1, 4, 4),
        "synthetic-images:size=12,shape=1x4x4,shard=2/3",
    )


# -- .npz directories and CSV files ------------------------------------------------------


def _npz(path: Path, x: np.ndarray, y: np.ndarray, compressed: bool = False) -> None:
    (np.savez_compressed if compressed else np.savez)(path, x=x, y=y)


def test_an_npz_directory_in_name_order_read_one_file_at_a_time(tmp_path: Path) -> None:
    a = np.arange(12, dtype=np.float64).reshape(3, 2, 2)
    b = -np.arange(8, dtype=np.float64).reshape(2, 2, 2)
    _npz(tmp_path / "b.npz", b, np.array([3, 4]), compressed=True)
    _npz(tmp_path / "a.npz", a, np.array([0, 1, 2]))
    (tmp_path / "notes.txt").write_text("not data")
    held = register([f"cam={tmp_path}"], ZOO_ONLY)["cam"]
    assert held.info == LocalDatasetInfo(
        kind="npz",
        samples=5,
        input_shape=(2, 2),
        input_dtype="float32",
        label_shape=(),
        label_dtype="int64",
        num_classes=5,
    )
    dataset = held.dataset
    assert isinstance(dataset, local_data.NpzFiles)
    assert dataset._loaded is None  # no inputs held until a sample is read
    x, y = dataset[4]
    assert dataset._loaded is not None and dataset._loaded[0] == 1  # b.npz's inputs only
    assert torch.equal(x, torch.tensor(b[1], dtype=torch.float32)) and int(y) == 4
    assert [int(dataset[i][1]) for i in range(5)] == [0, 1, 2, 3, 4]
    assert torch.equal(dataset[-5][0], torch.tensor(a[0], dtype=torch.float32))
    with pytest.raises(IndexError, match="sample 5 out of range for 5 samples"):
        dataset[5]


def test_a_csv_file_with_its_label_column(tmp_path: Path) -> None:
    path = tmp_path / "rows.csv"
    path.write_text("f1,target,f2,f3,f4\n0.5,1,1.5,2.5,3.5\n-1,0,-2,-3,-4\n9,2,8,7,6\n")
    plain = register([f"t={path}:label=target"], ZOO_ONLY)["t"]
    assert plain.info == LocalDatasetInfo(
        kind="csv",
        samples=3,
        input_shape=(4,),
        input_dtype="float32",
        label_shape=(),
        label_dtype="int64",
        num_classes=3,
    )
    x, y = plain.dataset[0]
    assert x.tolist() == [0.5, 1.5, 2.5, 3.5] and int(y) == 1
    shaped = register([f"t={path}:label=target,shape=2x2"], ZOO_ONLY)["t"]
    assert shaped.info.input_shape == (2, 2)
    assert shaped.dataset[2][0].tolist() == [[9.0, 8.0], [7.0, 6.0]]
    default = tmp_path / "default.csv"
    default.write_text("a,label\n1,0\n2,1\n")
    assert register([f"d={default}"], ZOO_ONLY)["d"].info.samples == 2


# -- user code ---------------------------------------------------------------------------

USER_DATA = """
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

Path({marker!r}).write_text("imported")


def rows(split):
    data = TensorDataset(torch.zeros(6, 3), torch.arange(6) % 2)
    data.num_classes = 2
    return data
"""


@pytest.fixture
def user_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The marker that importing ``edgetrain_test_localdata`` writes."""
    marker = tmp_path / "imported.txt"
    (tmp_path / "edgetrain_test_localdata.py").write_text(USER_DATA.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield marker
    sys.modules.pop("edgetrain_test_localdata", None)


def test_user_code_only_under_allow_code(user_data: Path) -> None:
    item = "mine=edgetrain_test_localdata:rows"
    with pytest.raises(UserError) as refused:
        register([item], ZOO_ONLY)
    assert refused.value.message == (
        f"--data {item}: dataset 'edgetrain_test_localdata:rows': module "
        "'edgetrain_test_localdata' is not allowed here (this agent runs zoo models and "
        "built-in datasets only); its owner may allow it with --allow-code "
        "edgetrain_test_localdata"
    )
    assert not user_data.exists()  # refused before importing
    held = register([item], allow_prefixes(["edgetrain_test_localdata"]))["mine"]
    assert user_data.exists()
    assert held.info == LocalDatasetInfo(
        kind="code",
        samples=6,
        input_shape=(3,),
        input_dtype="float32",
        label_shape=(),
        label_dtype="int64",
        num_classes=2,
    )


# -- refusals ----------------------------------------------------------------------------


def _refusal(items: list[str]) -> str:
    with pytest.raises(UserError) as exc:
        register(items, ZOO_ONLY)
    assert exc.value.exit_code == 2 and "\n" not in exc.value.message
    return exc.value.message


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("digits", "expected NAME=SPEC, such as digits=digits:shard=1/3"),
        (
            "a b=digits",
            "name 'a b' is not 1-64 of A-Z a-z 0-9 _ . - (starting with a letter or digit)",
        ),
        ("a=digits:shard=4/3", "shard 4/3: K must be 1 to N"),
        ("a=digits:shard=0/3", "shard 0/3: K must be 1 to N"),
        ("a=digits:shard=half", "shard 'half' is not K/N, such as 1/3"),
        ("a=digits:shard", "'shard' is not OPTION=VALUE"),
        ("a=digits:shard=1/2,shard=2/2", "option 'shard' is given twice"),
        ("a=digits:size=5", "dataset 'digits': unknown option 'size' (takes: no options)"),
        ("a=digits:shard=1/1438", "dataset 'digits': 1438 shards of 1437 samples leave some empty"),
        ("a=synthetic-images:size=big", "size 'big' is not an integer"),
        ("a=synthetic-images:shape=3x0", "shape '3x0' is not sizes joined by x, such as 1x8x8"),
        (
            "a=nowhere/data",
            "no built-in dataset, directory or file 'nowhere/data' (built-in: digits, "
            "synthetic-images, text)",
        ),
    ],
)
def test_bad_specs_are_one_line(item: str, message: str) -> None:
    assert _refusal([item]) == f"--data {item}: {message}"


def test_a_name_given_twice() -> None:
    assert _refusal(["a=digits", "a=text"]) == "--data a=text: the name 'a' is given twice"


@pytest.mark.parametrize(
    ("text", "spec", "message"),
    [
        (
            "f1,f2\n1,2\n",
            ":label=target",
            f"has no column 'target' (columns: f1, f2); {NAME_IT}",
        ),
        (
            "f1,f2\n1,2\n",
            "",
            f"has no column 'label' (columns: f1, f2); {NAME_IT}",
        ),
        ("f,label\n1,0\n2\n", "", "line 3: 1 values, but the header has 2"),
        ("f,label\n1,cat\n", "", "line 2: label 'cat' is not an integer"),
        ("f,label\nx,1\n", "", "line 2: could not convert string to float: 'x'"),
        ("f,label\n", "", "has a header but no rows"),
        ("f,\udcff\n", "", "is not UTF-8 text"),
        ("", "", "is empty"),
        ("f,g,label\n1,2,0\n", ":shape=3", "shape 3 holds 3 values, but each row has 2 features"),
        ("f,label\n1,0\n", ":labels=f", "unknown option 'labels' (takes: label, shape)"),
    ],
)
def test_bad_csv_files(tmp_path: Path, text: str, spec: str, message: str) -> None:
    path = tmp_path / "rows.csv"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))  # \udcff: the byte 0xff
    item = f"t={path}{spec}"
    prefix = "" if message.startswith(("shape", "unknown")) else "rows.csv "
    assert _refusal([item]) == f"--data {item}: {prefix}{message}"


def test_a_csv_file_over_the_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "rows.csv"
    path.write_text("f,label\n1,0\n")
    monkeypatch.setattr(local_data, "MAX_CSV_BYTES", 8)
    assert _refusal([f"t={path}"]) == (
        f"--data t={path}: rows.csv is 12 bytes, more than 8; use a directory of .npz files"
    )


def test_bad_npz_directories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    item = f"n={tmp_path}"
    assert _refusal([item]) == f"--data {item}: directory {str(tmp_path)!r} has no .npz files"
    _npz(tmp_path / "a.npz", np.zeros((3, 2, 2), np.float32), np.zeros(3, np.int64))
    _npz(tmp_path / "b.npz", np.zeros((2, 4), np.float32), np.zeros(2, np.int64))
    assert _refusal([item]) == (
        f"--data {item}: b.npz: samples of shape [4], but a.npz's are [2, 2]"
    )
    _npz(tmp_path / "b.npz", np.zeros((2, 2, 2), np.float32), np.zeros(3, np.int64))
    assert _refusal([item]) == f"--data {item}: b.npz: x has 2 samples but y has 3"
    np.savez(tmp_path / "b.npz", x=np.zeros((2, 2, 2), np.float32))
    assert _refusal([item]) == f"--data {item}: b.npz: no array 'y' (it has x)"
    _npz(tmp_path / "b.npz", np.zeros((2, 2, 2), np.float32), np.zeros((2, 5), np.int64))
    assert _refusal([item]) == f"--data {item}: b.npz: labels of shape [5], but a.npz's are []"
    (tmp_path / "b.npz").write_text("not a zip")
    assert _refusal([item]) == f"--data {item}: b.npz: File is not a zip file"
    (tmp_path / "b.npz").unlink()
    monkeypatch.setattr(local_data, "MAX_NPZ_FILE_BYTES", 40)
    assert _refusal([item]) == (
        f"--data {item}: a.npz: x holds 48 bytes, more than 40; split it into smaller files"
    )
    assert _refusal([f"{item}:label=y"]) == (
        f"--data {item}:label=y: a directory of .npz files takes no options (got 'label=y')"
    )


def test_a_file_that_is_neither(tmp_path: Path) -> None:
    path = tmp_path / "data.json"
    path.write_text("{}")
    assert _refusal([f"j={path}"]) == (
        f"--data j={path}: {str(path)!r} is not a directory of .npz files or a .csv file"
    )


# -- the runtime and the announcement ----------------------------------------------------


def test_the_runtime_reads_a_local_dataset_by_name() -> None:
    held = register(["mine=digits:shard=2/3"], ZOO_ONLY)
    dataset, sampler = open_local(held, "mine", batch_size=16, seed=3)
    assert dataset is held["mine"].dataset
    reference = EpochSampler(479, 16, 3)
    for step in (0, 1, 29, 30):
        x, y = load_batch(dataset, sampler, step)
        rows = shard_indices("digits", DIGITS_TRAIN, 2, 3)[reference.indices(step)]
        full = DigitsDataset("train")
        assert torch.equal(x, full.images[rows]) and torch.equal(y, full.labels[rows])
    with pytest.raises(
        UserError, match=r"^no local dataset 'other' on this device \(it holds: mine\)$"
    ):
        open_local(held, "other", 16, 0)
    with pytest.raises(
        UserError,
        match=r"^local dataset 'mine': batch size 480 is larger than the dataset \(479\)$",
    ):
        open_local(held, "mine", 480, 0)


def test_the_announcement_says_sizes_and_shapes_only() -> None:
    spec = DeviceSpec(
        id="pi-1", gflops=5, memory_bytes=4e9, bandwidth_mbps=100, latency_ms=2, details={"x": 1}
    )
    assert announce(spec, LocalData()) is spec
    claimed = spec.model_copy(update={"details": {"x": 1, "datasets": {"fake": {}}}})
    assert announce(claimed, LocalData()).details == {"x": 1}  # only what it holds
    held = register(["mine=digits:shard=1/3"], ZOO_ONLY)
    out = announce(spec, held)
    assert out.details == {
        "x": 1,
        "datasets": {
            "mine": {
                "kind": "zoo",
                "samples": 479,
                "input_shape": [1, 8, 8],
                "input_dtype": "float32",
                "label_shape": [],
                "label_dtype": "int64",
                "num_classes": 10,
                "source": "digits:shard=1/3",
            }
        },
    }
    profile = out.model_dump(mode="json")
    assert announced(profile) == {"mine": held["mine"].info}
    profile["details"]["datasets"]["bad"] = {"kind": "zoo", "samples": -1}
    assert list(announced(profile)) == ["mine"]
    assert announced(None) == {} and announced({"details": {"datasets": 3}}) == {}
