"""The dependency rules of shared/DESIGN.md: imports run only downwards (``edgetrain`` ->
``coordinator`` -> ``edge``), and nothing under edge/ imports a coordinator-only package.

The coordinator-only packages are read from pyproject.toml (the ``coordinator`` and
``export`` extras), with every package only they bring in (support.extras), so a new
extra is blocked here the day it is added. tests/integration/test_command_imports.py runs
every command without them, and tests/integration/test_device_install.py checks
the same on a real install without extras.
"""

from __future__ import annotations

import ast
from pathlib import Path

from support.extras import COORDINATOR_ONLY
from support.paths import ROOT


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_the_blocked_modules_are_the_coordinator_extras() -> None:
    for module in ("fastapi", "sqlalchemy", "uvicorn", "httpx", "pydantic_settings", "amqtt"):
        assert module in COORDINATOR_ONLY
    for module in ("onnx", "onnxruntime", "prometheus_client", "starlette"):
        assert module in COORDINATOR_ONLY
    for module in ("torch", "pydantic", "typer", "paho", "yaml", "rich"):  # the base install
        assert module not in COORDINATOR_ONLY


def _upward_imports(package: str, above: tuple[str, ...]) -> list[str]:
    files = sorted((ROOT / package).rglob("*.py"))
    assert len(files) > 5
    return [
        f"{f.relative_to(ROOT)} imports {name}"
        for f in files
        for name in _imports(f)
        if name.split(".")[0] in above
    ]


def test_edge_never_imports_coordinator_or_edgetrain() -> None:
    assert _upward_imports("edge", ("coordinator", "edgetrain")) == []


def test_coordinator_never_imports_edgetrain() -> None:
    assert _upward_imports("coordinator", ("edgetrain",)) == []


def test_edge_never_imports_coordinator_only_packages() -> None:
    offenders = [
        f"{f.relative_to(ROOT)} imports {name}"
        for f in sorted((ROOT / "edge").rglob("*.py"))
        for name in _imports(f)
        if name.split(".")[0] in COORDINATOR_ONLY
    ]
    assert offenders == []
