"""coordinator/planner/__init__.py indexes every module of the package, one line each."""

from __future__ import annotations

import pkgutil
import re

import coordinator.planner as planner


def test_the_package_docstring_indexes_every_module_once() -> None:
    modules = {m.name for m in pkgutil.iter_modules(planner.__path__)}
    doc = planner.__doc__ or ""
    listed = re.findall(r"^- :mod:`coordinator\.planner\.(\w+)`: \S", doc, flags=re.MULTILINE)
    assert sorted(listed) == sorted(modules)
    assert len(listed) == len(set(listed))
