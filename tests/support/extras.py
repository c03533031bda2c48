"""The packages only the ``coordinator`` and ``export`` extras bring in, read from pyproject.toml.

With every package only they pull in, so a new extra is blocked by the layering
tests the day it is added.
"""

from __future__ import annotations

import importlib.metadata
import re
import tomllib

from packaging.requirements import Requirement

from support.paths import ROOT

__all__ = ["COORDINATOR_ONLY", "COORDINATOR_ONLY_DISTRIBUTIONS", "DEVICE_FREE_EXTRAS"]


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(requirements: list[str]) -> set[str]:
    """The installed distributions these requirements pull in, themselves included."""
    seen: set[str] = set()
    todo = list(requirements)
    while todo:
        req = Requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = _normalized(req.name)
        if name in seen:
            continue
        try:
            todo += importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        seen.add(name)
    return seen


DEVICE_FREE_EXTRAS = ("coordinator", "export")
"""The extras a device never installs: the service, and ONNX export (onnx, onnxruntime)."""


def coordinator_only_distributions() -> set[str]:
    """The distributions that only the coordinator's extras install, with their own deps."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project["optional-dependencies"]
    extras = [r for extra in DEVICE_FREE_EXTRAS for r in optional[extra]]
    only = _closure(extras) - _closure(project["dependencies"])
    missing = {_normalized(Requirement(r).name) for r in extras} - only
    assert not missing, f"coordinator extras not installed in this environment: {missing}"
    return only


COORDINATOR_ONLY_DISTRIBUTIONS = coordinator_only_distributions()
COORDINATOR_ONLY = tuple(
    sorted(
        module
        for module, dists in importlib.metadata.packages_distributions().items()
        if any(_normalized(d) in COORDINATOR_ONLY_DISTRIBUTIONS for d in dists)
    )
)
"""Their top-level modules: what no file under edge/ may import."""
