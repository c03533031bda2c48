"""The dependency rules of shared/DESIGN.md: edge never imports coordinator, and a
device install (no coordinator extras) runs every device command."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICE_PACKAGES = ("fastapi", "uvicorn", "starlette", "sqlalchemy", "prometheus_client")


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_edge_never_imports_coordinator() -> None:
    files = sorted((ROOT / "edge").rglob("*.py"))
    assert len(files) > 5
    offenders = [
        f"{f.relative_to(ROOT)} imports {name}"
        for f in files
        for name in _imports(f)
        if name == "coordinator" or name.startswith("coordinator.")
    ]
    assert offenders == []


def test_edge_never_imports_service_packages() -> None:
    offenders = [
        f"{f.relative_to(ROOT)} imports {name}"
        for f in sorted((ROOT / "edge").rglob("*.py"))
        for name in _imports(f)
        if name.split(".")[0] in SERVICE_PACKAGES
    ]
    assert offenders == []


BLOCKER = f"""
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {SERVICE_PACKAGES!r}:
            raise ImportError('blocked: ' + name + ' is not in an agent-only install')
        return None
sys.meta_path.insert(0, _Block())
from edgetrain.cli import app
from typer.main import get_command
cmd = get_command(app)
import click
ctx = click.Context(cmd)
for name in cmd.list_commands(ctx):
    sub = cmd.get_command(ctx, name)
    assert sub.get_help(click.Context(sub)), name
bad = [m for m in sys.modules if m.split('.')[0] in {SERVICE_PACKAGES!r}]
assert not bad, bad
print('ok', len(cmd.list_commands(ctx)))
"""


def test_device_commands_run_without_the_coordinator_extras() -> None:
    # FastAPI and friends are installed in the test environment; the blocker makes
    # importing them fail, as on an agent-only install.
    done = subprocess.run(
        [sys.executable, "-c", BLOCKER], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok")
