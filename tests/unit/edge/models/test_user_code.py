"""Which user code may be imported: prefixes at dot boundaries, refused before importing.

tests/integration/test_agent_allow_code.py sends the same names to a real agent.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge.errors import UserError
from edge.models.datasets import build_dataset
from edge.models.user_code import (
    ANY_CODE,
    ZOO_ONLY,
    CodeAllowance,
    CodeNotAllowed,
    allow_prefixes,
    check_allowed,
    user_modules,
)
from edge.models.zoo import get_model

MARKED = "edgetrain_test_marked"
"""A module that leaves a marker file when it is imported (where ``MARKER`` says)."""

USER_MODULE = """
from pathlib import Path
from torch import nn

Path({marker!r}).write_text("imported")


def tiny():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
tiny.input_shape = (1, 8, 8)
"""


@pytest.fixture
def marked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The marker file that importing :data:`MARKED` writes (absent until then)."""
    marker = tmp_path / "imported.txt"
    (tmp_path / f"{MARKED}.py").write_text(USER_MODULE.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield marker
    sys.modules.pop(MARKED, None)


@pytest.mark.parametrize(
    ("prefixes", "module", "allowed"),
    [
        (("mypkg",), "mypkg", True),
        (("mypkg",), "mypkg.models", True),
        (("mypkg",), "mypkg.models.deep", True),
        (("mypkg",), "mypkgevil", False),
        (("mypkg",), "mypkg_evil.models", False),
        (("mypkg",), "other.mypkg", False),
        (("mypkg.models",), "mypkg", False),
        (("mypkg.models",), "mypkg.models", True),
        (("mypkg.models",), "mypkg.modelsevil", False),
        (("mypkg.models",), "mypkg.other", False),
        (("a", "b.c"), "b.c.d", True),
        (("a", "b.c"), "b", False),
        ((), "mypkg", False),
        ((), "os", False),
    ],
)
def test_a_prefix_matches_at_dot_boundaries(
    prefixes: tuple[str, ...], module: str, allowed: bool
) -> None:
    assert CodeAllowance(prefixes).allows(module) is allowed
    assert ANY_CODE.allows(module) is True


def test_the_option_keeps_prefixes_once_in_order() -> None:
    allowance = allow_prefixes(["mypkg", " other.models ", "mypkg"])
    assert allowance == CodeAllowance(("mypkg", "other.models"))
    assert allow_prefixes([]) == ZOO_ONLY


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        ("", "empty"),
        ("  ", "empty"),
        ("*", "a wildcard"),
        ("mypkg.*", "a wildcard"),
        (".", "not a module path"),
        ("mypkg.", "not a module path"),
        (".mypkg", "not a module path"),
        ("my-pkg", "not a module path"),
        ("mypkg:build", "not a module path"),
    ],
)
def test_an_empty_or_wildcard_prefix_is_an_option_error(raw: str, why: str) -> None:
    with pytest.raises(UserError) as caught:
        allow_prefixes(["mypkg", raw])
    assert caught.value.message == (
        f"--allow-code: {raw!r} is {why}; give a module prefix such as mypkg or "
        "mypkg.models (zoo models and built-in datasets need none)"
    )


def test_the_modules_a_job_needs_are_its_user_names() -> None:
    assert user_modules("cnn-digits", "digits") == []
    assert user_modules("mypkg.models:build", None) == ["mypkg.models"]
    assert user_modules("mypkg.models:build", "mypkg.models:data", "other:d") == [
        "mypkg.models",
        "other",
    ]
    assert user_modules("not a name:x", "a:b:c") == []


def test_a_refusal_names_the_code_and_the_option_that_allows_it() -> None:
    with pytest.raises(CodeNotAllowed) as caught:
        check_allowed("mypkgevil.models:build", "model", CodeAllowance(("mypkg",)))
    assert caught.value.message == (
        "model 'mypkgevil.models:build': module 'mypkgevil.models' is not allowed here "
        "(this agent runs the zoo and user code under mypkg); its owner may allow it "
        "with --allow-code mypkgevil.models"
    )
    check_allowed("mypkg.models:build", "model", CodeAllowance(("mypkg",)))  # no error


def test_os_system_is_refused_as_model_and_dataset_without_being_called() -> None:
    # tests/unit/conftest.py makes os.system fail the test if it is ever called.
    with pytest.raises(CodeNotAllowed, match="model 'os:system': module 'os' is not allowed"):
        get_model("os:system", allow_code=ZOO_ONLY, command="true")
    with pytest.raises(CodeNotAllowed, match="dataset 'os:system': module 'os' is not allowed"):
        build_dataset("os:system", "train", allow_code=ZOO_ONLY, command="true")


def test_a_refused_module_is_never_imported(marked: Path) -> None:
    allowance = CodeAllowance(("edgetrain_test",))  # a prefix, not a dot boundary
    for resolve in (
        lambda: get_model(f"{MARKED}:tiny", allow_code=allowance),
        lambda: build_dataset(f"{MARKED}:tiny", "train", allow_code=allowance),
    ):
        with pytest.raises(CodeNotAllowed, match=f"--allow-code {MARKED}$"):
            resolve()
        assert MARKED not in sys.modules
        assert not marked.exists()


def test_an_allowed_module_is_imported(marked: Path) -> None:
    spec = get_model(f"{MARKED}:tiny", allow_code=CodeAllowance((MARKED,)))
    assert spec.num_units == 2 and marked.read_text() == "imported"


def test_the_zoo_needs_no_allowance() -> None:
    assert get_model("mlp", allow_code=ZOO_ONLY).num_units == 3
    assert len(build_dataset("digits", "test", allow_code=ZOO_ONLY)) == 360  # type: ignore[arg-type]


def test_an_allowance_given_as_a_job_option_is_refused() -> None:
    # A job's model options are JSON: they cannot make a CodeAllowance.
    with pytest.raises(TypeError, match="allow_code must be a CodeAllowance, not list"):
        get_model("os:system", allow_code=["os"], command="true")  # type: ignore[arg-type]
