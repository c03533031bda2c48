"""Every module says where it is tested, so a newcomer finds its tests (issue 32).

A module under edge/, coordinator/ or edgetrain/ (not an ``__init__.py`` or a
``__main__.py``) is found one of two ways:

- a test file named after it: ``test_<module stem>.py`` or ``test_<module stem>_*.py``
  anywhere under tests/ (``edge/runtime/group_sum.py``: ``test_group_sum.py``);
- else its docstring's last paragraph, in one form::

      Tested in tests/unit/coordinator/engine/test_x.py (what it checks) and
      tests/e2e/test_y.py::test_z.

  It names at least one test file by its path from the repository root; every path it
  names must exist, and every ``::name`` after a path (or after another ``::name``,
  which refers to the same file) must be a function or class that file defines.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from support.paths import ROOT

PACKAGES = ("edge", "coordinator", "edgetrain")
NOT_MODULES = ("__init__.py", "__main__.py")
TESTED_IN = "Tested in "
# A test file's path from the root, then its ``::name`` parts; or a bare ``::name`` that
# refers to the path before it.
REFERENCE = re.compile(r"(tests/[\w/.-]+?\.py\b)((?:::\w+)*)|((?:::\w+)+)")


def _modules(root: Path) -> list[Path]:
    return sorted(
        path
        for package in PACKAGES
        for path in (root / package).rglob("*.py")
        if path.name not in NOT_MODULES
    )


def _named_after(module: Path, test_names: set[str]) -> bool:
    stem = module.stem
    return any(name == f"test_{stem}" or name.startswith(f"test_{stem}_") for name in test_names)


def _defines(test_file: Path, name: str) -> bool:
    return (
        re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b", test_file.read_text(), re.M)
        is not None
    )


def _docstring_problem(root: Path, module: Path) -> str | None:
    """What is wrong with ``module``'s "Tested in" paragraph, or None if it is right."""
    doc = ast.get_docstring(ast.parse(module.read_text(), filename=str(module))) or ""
    paragraphs = [p for p in re.split(r"\n\s*\n", doc.strip()) if p.strip()]
    last = " ".join(paragraphs[-1].split()) if paragraphs else ""
    if not last.startswith(TESTED_IN):
        if TESTED_IN.lower() in doc.lower():
            return "says where it is tested, but not in its docstring's last paragraph"
        return (
            "no test file is named after it (test_<stem>.py, test_<stem>_*.py) and its "
            f"docstring ends with no {TESTED_IN.strip()!r} paragraph"
        )
    paths = 0
    current: Path | None = None
    problems: list[str] = []
    for match in REFERENCE.finditer(last):
        path, names, bare = match.groups()
        if path is not None:
            paths += 1
            current = root / path
            if not current.is_file():
                problems.append(f"{path} does not exist")
                current = None
                continue
        elif paths == 0:
            problems.append(f"{bare} follows no test file")
        for name in (names or bare or "").split("::")[1:]:
            if current is not None and not _defines(current, name):
                problems.append(f"{current.relative_to(root)} defines no {name}")
    if paths == 0:
        problems.append("names no test file (tests/...py)")
    return "; ".join(problems) or None


def where_tested(root: Path) -> tuple[list[Path], list[str]]:
    """The modules under ``root``'s packages, and one line per module its tests cannot be
    found for (named after it, or named in its docstring)."""
    modules = _modules(root)
    test_names = {path.stem for path in (root / "tests").rglob("test_*.py")}
    offences = []
    for module in modules:
        if _named_after(module, test_names):
            continue
        problem = _docstring_problem(root, module)
        if problem is not None:
            offences.append(f"{module.relative_to(root)}: {problem}")
    return modules, offences


def test_every_module_says_where_it_is_tested() -> None:
    modules, offences = where_tested(ROOT)
    assert len(modules) > 100, [str(m) for m in modules]
    if offences:
        pytest.fail(f"{len(offences)} modules without findable tests:\n" + "\n".join(offences))


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_check_names_each_module_whose_tests_cannot_be_found(tmp_path: Path) -> None:
    """The check on a small tree of its own: each way to pass, and each way to fail."""

    def doc(text: str) -> str:
        return f'"""The module.\n\n{text}\n"""\n'

    root = _tree(
        tmp_path,
        {
            "tests/unit/test_named.py": "def test_it() -> None:\n    pass\n",
            "tests/e2e/test_whole.py": "class TestWhole:\n    def test_it(self) -> None: ...\n",
            "edge/__init__.py": '"""A package: not a module to test."""\n',
            "edge/named.py": '"""Tested by the file named after it."""\n',
            "edge/whole.py": "",
            "edge/runtime/referred.py": doc(
                "Tested in tests/unit/test_named.py::test_it (one test) and\n"
                "tests/e2e/test_whole.py::TestWhole."
            ),
            "coordinator/bare.py": '"""A module and nothing more."""\n',
            "coordinator/gone.py": doc("Tested in tests/unit/test_gone.py."),
            "coordinator/renamed.py": doc("Tested in tests/unit/test_named.py::test_old."),
            "edgetrain/pathless.py": doc("Tested in the end to end tests."),
            "edgetrain/buried.py": doc("Tested in tests/unit/test_named.py.\n\nMore after it."),
        },
    )

    modules, offences = where_tested(root)

    assert [m.relative_to(root).as_posix() for m in modules] == [
        "coordinator/bare.py",
        "coordinator/gone.py",
        "coordinator/renamed.py",
        "edge/named.py",
        "edge/runtime/referred.py",
        "edge/whole.py",
        "edgetrain/buried.py",
        "edgetrain/pathless.py",
    ]
    assert offences == [
        "coordinator/bare.py: no test file is named after it (test_<stem>.py, "
        "test_<stem>_*.py) and its docstring ends with no 'Tested in' paragraph",
        "coordinator/gone.py: tests/unit/test_gone.py does not exist",
        "coordinator/renamed.py: tests/unit/test_named.py defines no test_old",
        "edgetrain/buried.py: says where it is tested, but not in its docstring's last paragraph",
        "edgetrain/pathless.py: names no test file (tests/...py)",
    ]
