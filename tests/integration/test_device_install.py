"""The device install, tested as a device gets it.

A fresh virtual environment gets torch (the build this environment runs, first,
as README's Install says) and then ``pip install`` of this project without
extras: a real install, not an editable one, from a copy of the sources (a build
in the checkout would leave ``build/`` and ``*.egg-info`` behind for everyone
working in it). Every command runs from outside the checkout, so what is tested
is the installed package. It must:

- not contain any coordinator-only distribution (pyproject's ``coordinator`` extra);
- run ``edgetrain --help``, ``agent --help``, ``profile --json`` and the other device
  commands, and say in one line that ``edgetrain coordinator`` needs the extras;
- run an agent that takes stage 0 of a 2-stage job next to an agent of the full
  install (this environment) over a real Mosquitto, and end with the losses and
  weights of one-stage training and of the independent reference (a plain loop).

tests/unit/test_layering.py is the fast version of the same check.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from support.mosquitto import Broker
from support.reference import assert_matches, train_reference

from coordinator.engine.options import RunOptions
from coordinator.engine.runners import run_inprocess, run_on_agents
from coordinator.engine.spec import JobSpec
from coordinator.local.fleet import AgentRoles, LocalFleet
from coordinator.planner.score import Plan
from edge.models.zoo import get_model
from edge.problem import DeviceSpec
from edge.transport.mqtt import MqttSettings, MqttTransport

pytestmark = [pytest.mark.slow, pytest.mark.broker]

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "edge", "coordinator", "edgetrain", "device_profiles")
"""What building the distribution reads (packages, package data, metadata)."""
NOT_ON_A_DEVICE = {"fastapi", "sqlalchemy", "uvicorn", "httpx", "pydantic-settings", "amqtt"}
"""Named by issue 13 (with onnx, now in the export extra); the test checks every
distribution of the coordinator and export extras."""


class DeviceInstall:
    """A virtual environment holding a device's install of edgetrain."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.venv = root / "venv"
        self.python = self.venv / "bin" / "python"
        self.edgetrain = self.venv / "bin" / "edgetrain"
        self.cwd = root / "work"  # outside the checkout: nothing there shadows the install
        self.cwd.mkdir()
        # Nothing from this environment may leak into the device's imports; and the device's
        # commands write their bytecode (see pip below), whatever this environment prefers.
        unset = ("PYTHONPATH", "PYTHONHOME", "PYTHONDONTWRITEBYTECODE")
        self.env = {k: v for k, v in os.environ.items() if k not in unset}

    def run(self, *args: str | Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        """Run a command of the device install; subprocess kills it by its pid on a timeout."""
        return subprocess.run(
            [str(a) for a in args],
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def pip(self, *args: str | Path) -> None:
        # --no-compile: byte-compiling all of torch ahead of time costs about 25 s of CPU
        # here; the first command compiles the modules it imports (about 4 s) and keeps them.
        pip: list[str | Path] = [self.python, "-m", "pip", "install", "--quiet", "--no-compile"]
        done = self.run(*pip, *args, timeout=900)
        assert done.returncode == 0, f"pip install {args}: {done.stderr[-3000:]}"


def _torch_requirement() -> str:
    # The torch build this environment runs (Makefile's TORCH_SPEC when it is set), so
    # both installs compute alike and pip takes it from its cache or the same index.
    return os.environ.get("TORCH_SPEC") or f"torch=={torch.__version__.split('+')[0]}"


@pytest.fixture(scope="module")
def device(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DeviceInstall]:
    root = tmp_path_factory.mktemp("device-install")
    source = root / "source"
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=ignore)
        else:
            shutil.copy2(path, source / name)
    install = DeviceInstall(root)
    times = [time.perf_counter()]
    done = install.run(sys.executable, "-m", "venv", install.venv)
    assert done.returncode == 0, done.stderr
    times.append(time.perf_counter())
    install.pip(_torch_requirement())
    times.append(time.perf_counter())
    install.pip(source)  # no extras: what README's Install gives a device
    times.append(time.perf_counter())
    venv_s, torch_s, project_s = (b - a for a, b in itertools.pairwise(times))
    print(f"device install: venv {venv_s:.1f} s, torch {torch_s:.1f} s, project {project_s:.1f} s")
    yield install


INSPECT = """
import importlib.metadata as md, json, os, sys
import edge, edgetrain, coordinator
names = json.loads(sys.argv[1])
installed = []
for name in names:
    try:
        installed.append(name + ' ' + md.version(name))
    except md.PackageNotFoundError:
        pass
dist = md.distribution('edgetrain')
print(json.dumps({
    'installed': installed,
    'files': [m.__file__ for m in (edge, edgetrain, coordinator)],
    'typed': [os.path.isfile(os.path.join(os.path.dirname(m.__file__), 'py.typed'))
              for m in (edge, edgetrain, coordinator)],
    'direct_url': json.loads(dist.read_text('direct_url.json') or '{}'),
    'prefix': sys.prefix,
}))
"""


def test_no_coordinator_package_is_installed(device: DeviceInstall) -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    optional = project["optional-dependencies"]
    names = [Requirement(r).name for r in optional["coordinator"] + optional["export"]]
    assert NOT_ON_A_DEVICE | {"onnx"} <= {n.lower() for n in names}
    done = device.run(device.python, "-c", INSPECT, json.dumps(names))
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["installed"] == []
    # The installed package, not the checkout, and a real install, not an editable one.
    assert all(Path(f).is_relative_to(found["prefix"]) for f in found["files"]), found["files"]
    assert not found["direct_url"].get("dir_info", {}).get("editable", False)
    assert found["typed"] == [True, True, True]  # PEP 561 markers ship with the packages


def test_every_device_command_runs(device: DeviceInstall) -> None:
    # Each command imports torch (3-4 s here): every command's --help is
    # tests/unit/test_layering.py's job; these are the ones a device runs.
    for args in (["--help"], ["agent", "--help"]):
        done = device.run(device.edgetrain, *args)
        assert done.returncode == 0 and "Usage" in done.stdout, (args, done.stderr[-2000:])
    done = device.run(device.edgetrain, "profile", "--json", "--seconds", "0.2", "--device-id=pi")
    assert done.returncode == 0, done.stderr[-2000:]
    spec = DeviceSpec.model_validate(json.loads(done.stdout))
    assert spec.id == "pi" and spec.gflops > 0 and spec.memory_bytes > 0
    # The catalogue (package data) and the planner.
    done = device.run(device.edgetrain, "plan", "--model", "mlp", "--devices", "laptop", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    stages = json.loads(done.stdout)["stages"]  # a version 2 plan (groups by default)
    assert stages == [
        {"layers": [0, 3], "devices": ["laptop-32gb"], "shares": [1.0], "device": "laptop-32gb"}
    ]
    # A command that needs the extras says so in one line, with status 2.
    done = device.run(device.edgetrain, "coordinator")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: edgetrain coordinator needs the coordinator extras (no module 'uvicorn' here): "
        "pip install 'edgetrain[coordinator]'"
    ]


def test_a_device_install_agent_trains_a_two_stage_job_with_a_full_install(
    device: DeviceInstall, mosquitto: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PYTHONPATH", raising=False)  # the device agent imports its own install
    spec = JobSpec(model="cnn-digits", steps=5, batch_size=16, microbatches=4, seed=3)
    n = get_model(spec.model).num_units
    control = MqttTransport(MqttSettings(url=mosquitto.url))
    control.connect(timeout=10)
    # Stage 0 (it reads the data) on the device install, stage 1 (the loss) on the full one.
    programs = [[str(device.edgetrain)], []]
    try:
        with LocalFleet(2, mosquitto.url, threads=1, roles=AgentRoles(programs=programs)) as fleet:
            fleet.wait_online(control, timeout=90)
            on_device, on_full = fleet.ids
            plan = Plan.of((on_device, 0, 2), (on_full, 2, n))
            result = run_on_agents(spec, plan, control, options=RunOptions(timeout_s=300))
    finally:
        control.close()
    reference = run_inprocess(spec, Plan.of(("reference", 0, n)))

    assert len(result.plan.stages) == 2
    assert {(r.stage, r.step, r.device) for r in result.reports} == {
        (s, t, d) for s, d in enumerate((on_device, on_full)) for t in range(spec.steps)
    }
    assert all(r.bytes_sent > 0 for r in result.reports if r.stage == 0)
    assert len(result.losses) == len(reference.losses) == spec.steps
    for loss, ref_loss in zip(result.losses, reference.losses, strict=True):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert result.weights.keys() == reference.weights.keys()
    for key, ref in reference.weights.items():
        torch.testing.assert_close(result.weights[key], ref, rtol=1e-5, atol=1e-7)
    plain = train_reference(spec.model, steps=spec.steps, batch_size=spec.batch_size, seed=3)
    assert_matches(result.losses, result.weights, plain)
