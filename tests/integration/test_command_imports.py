"""Which modules a command imports, each checked in a fresh Python process.

Every command starts without the coordinator extras (hidden as on a device install),
``testbed compose`` imports no FastAPI, and the client and planning commands (``devices``,
``jobs``, ``submit``, ``fleet``, ``plan --problem``) and every ``--help`` import no torch
(importing it costs a process over a CPU-second). The import rules themselves are
tests/unit/test_layering.py's.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from support.extras import COORDINATOR_ONLY, COORDINATOR_ONLY_DISTRIBUTIONS
from support.paths import ROOT


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


@pytest.mark.slow
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


PROBLEM = {
    "version": 1,
    "batch_size": 8,
    "microbatches": 2,
    "layers": [
        {"name": f"l{i}", "fwd_flops": 1e7, "param_bytes": 4e5, "out_bytes": 2e5} for i in range(3)
    ],
    "devices": [
        {"id": "pi", "gflops": 6, "memory_bytes": 2e9, "bandwidth_mbps": 50, "latency_ms": 2},
        {"id": "pc", "gflops": 60, "memory_bytes": 8e9, "bandwidth_mbps": 900, "latency_ms": 0.2},
    ],
}
"""A version 1 planning problem (shared/spec/planning.md) for ``plan --problem``."""

# In a fresh process, with the checkout's ordinary environment: every command's --help and
# a real run of each client and planning command (the client commands against a
# coordinator that is not there: they end in the one line saying so), checking after
# each that torch is still not imported.
NO_TORCH_SCRIPT = """
import json, sys
from typer.main import get_command
from typer.testing import CliRunner
from edge.errors import UserError
from edgetrain.cli import app

assert 'torch' not in sys.modules, 'import edgetrain.cli imports torch'
problem, job, creds = sys.argv[1:4]
DEAD = 'http://127.0.0.1:9'
runner = CliRunner()

def paths(cmd, prefix):
    yield prefix
    for name, sub in sorted(getattr(cmd, 'commands', {}).items()):
        yield from paths(sub, prefix + [name])

ok = [[*path, '--help'] for path in paths(get_command(app), [])] + [
    ['devices', 'list'], ['devices', 'list', '--json'], ['devices', 'show', 'rpi4-4gb'],
    ['devices', 'show', 'laptop', '--as-device'], ['devices', 'validate'],
    ['plan', '--problem', problem, '--json'], ['plan', '--problem', problem],
]
unreachable = [
    ['jobs'], ['jobs', 'job-1', '--json'], ['submit', job, '--wait'], ['fleet'],
    ['fleet', 'enroll', 'pi-1', '--out', creds], ['fleet', 'revoke', 'pi-1'],
]
ran = []
for args in ok + [[*a, '--coordinator', DEAD] for a in unreachable]:
    done = runner.invoke(app, args, catch_exceptions=True)
    if args in ok:
        assert done.exit_code == 0, (args, done.output, done.exception)
    else:
        assert isinstance(done.exception, UserError), (args, done.output, done.exception)
        assert done.exception.message.startswith('cannot reach the coordinator at ' + DEAD), args
    assert 'torch' not in sys.modules, ('imports torch', args)
    ran.append(' '.join(args))
print(json.dumps(ran))
"""


def test_client_and_planning_commands_start_without_torch(tmp_path: Path) -> None:
    problem = tmp_path / "problem.json"
    problem.write_text(json.dumps(PROBLEM))
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            NO_TORCH_SCRIPT,
            str(problem),
            str(ROOT / "examples" / "job.toml"),
            str(tmp_path / "creds.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    ran = json.loads(done.stdout.strip().splitlines()[-1])
    for help_of in ("--help", "train --help", "demo --help", "launch --help", "models --help"):
        assert help_of in ran
    assert f"plan --problem {problem}" in ran
    assert "fleet enroll pi-1 --out" in " ".join(ran)
    assert not (tmp_path / "creds.json").exists()


def test_command_module_does_not_import_fastapi() -> None:
    code = (
        "import sys, edgetrain.cli.testbed_compose, coordinator.testbed.compose; "
        "sys.exit('fastapi' in sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
