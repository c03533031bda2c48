"""The dependency rules of shared/DESIGN.md: imports run only downwards (``edgetrain`` ->
``coordinator`` -> ``edge``), and a device install (no coordinator extras) runs every
device command.

The coordinator-only packages are read from pyproject.toml (the ``coordinator`` and
``export`` extras), with every package only they bring in, so a new extra is blocked
here the day it is added. tests/integration/test_device_install.py checks the same on a
real install without extras.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


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


def _device_site(into: Path) -> Path:
    """This environment's site-packages as a device install sees it: a folder of links
    to every entry except the files of the coordinator-only distributions."""
    site = Path(sysconfig.get_paths()["purelib"])
    hidden = {
        file.parts[0]
        for name in COORDINATOR_ONLY_DISTRIBUTIONS
        for file in importlib.metadata.distribution(name).files or []
        if file.parts[0] != ".."
    }
    into.mkdir()
    for entry in site.iterdir():
        # .pth files are not read there (python -S), so the editable install's finder is off
        # too: the checkout comes first on PYTHONPATH instead.
        if entry.name not in hidden and entry.suffix != ".pth":
            (into / entry.name).symlink_to(entry)
    return into


# Run with python -S and PYTHONPATH=<checkout>:<device site>, where the coordinator-only
# packages are absent as on a device install (not blocked by a finder: torch probes
# optional packages with importlib.util.find_spec, which must answer None, not raise):
# every command's --help, the device commands for real, and the commands that need the
# extras end in one line naming the install.
DEVICE_SCRIPT = """
import importlib.util, json, sys
BLOCKED = set(json.loads(sys.argv[1]))
present = sorted(m for m in BLOCKED if importlib.util.find_spec(m) is not None)
assert not present, ('coordinator-only modules still importable', present)

from typer.main import get_command
from typer.testing import CliRunner
from edge.errors import UserError
from edgetrain.cli import app

runner = CliRunner()
def run(*args):
    return runner.invoke(app, list(args), catch_exceptions=True)

def paths(cmd, prefix):
    yield prefix
    for name, sub in sorted(getattr(cmd, 'commands', {}).items()):
        yield from paths(sub, prefix + [name])

helped = []
for path in paths(get_command(app), []):
    done = run(*path, '--help')
    assert done.exit_code == 0 and 'Usage' in done.output, (path, done.output, done.exception)
    helped.append(' '.join(path))

profile = run('profile', '--json', '--seconds', '0.05')
assert profile.exit_code == 0, (profile.output, profile.exception)
device = json.loads(profile.output)
assert device['gflops'] > 0 and device['memory_bytes'] > 0, device
for args in (['devices', 'list'], ['models', 'list'], ['devices', 'show', 'laptop'],
             ['plan', '--model', 'mlp', '--devices', 'rpi4-4gb,laptop', '-b', '16', '-m', '2']):
    done = run(*args)
    assert done.exit_code == 0, (args, done.output, done.exception)

needs = {}
for args in (['coordinator'], ['demo', '--exit'],
             ['jobs', '--coordinator', 'http://127.0.0.1:9']):
    done = run(*args)
    assert isinstance(done.exception, UserError), (args, done.output, done.exception)
    needs[args[0]] = done.exception.message
    assert "pip install 'edgetrain[coordinator]'" in done.exception.message, needs

from coordinator.local.broker import start_broker
try:
    start_broker('amqtt').stop()
except UserError as exc:
    needs['broker'] = exc.message

bad = sorted(m for m in sys.modules if m.split('.')[0] in BLOCKED)
assert not bad, bad
print(json.dumps({'helped': helped, 'needs': needs}))
"""


def test_every_command_starts_without_the_coordinator_extras(tmp_path: Path) -> None:
    site = _device_site(tmp_path / "site-packages")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(site)])}
    done = subprocess.run(
        [sys.executable, "-S", "-c", DEVICE_SCRIPT, json.dumps(COORDINATOR_ONLY)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for command in ("agent", "profile", "demo", "coordinator", "submit", "plan", "launch"):
        assert command in result["helped"]
    assert {"devices list", "models profile", "testbed up"} <= set(result["helped"])
    assert "no module 'httpx'" in result["needs"]["demo"]
    assert "no module 'httpx'" in result["needs"]["jobs"]
    assert result["needs"]["broker"].startswith("with no mosquitto installed, the embedded broker")
