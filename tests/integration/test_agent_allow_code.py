"""A real ``edgetrain agent`` on an open broker imports no code it was not allowed to.

Issue 15's attack: a client with no credentials publishes on a device's ``cmd``
topic an assignment naming ``os:system`` (as model, then as dataset) with options
that would create a file, and a user module outside the agent's ``--allow-code``
prefix whose import would create one. The agent answers each with ``failed``
naming what it refused, nothing is imported or run, and it keeps serving: a zoo
assignment and a user model under its prefix both get ``ready``. The agent is
started the way ``edgetrain train`` starts its own (:class:`LocalFleet`), so it
also shows the fleet passing ``--insecure`` and ``--allow-code``. Without
credentials and without ``--insecure`` the command refuses to start.
tests/unit/edge/models/test_user_code.py checks the prefixes themselves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.mosquitto import Broker
from support.waiting import until

from coordinator.local.fleet import LocalFleet
from edge.transport.mqtt import MqttSettings, MqttTransport
from edge.wire.messages import CancelJob, StageFailed, StageReady, parse_event
from edge.wire.topics import device_cmd, job_events

ALLOWED = "edgetrain_allowed"
"""The prefix the agent's owner allows: a package holding a user model."""
EVIL = "edgetrain_allowedevil"
"""A module under no allowed prefix (``edgetrain_allowed`` is not a dot boundary of it)."""

ALLOWED_MODELS = """
from torch import nn


def tiny():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
tiny.input_shape = (1, 8, 8)
"""
EVIL_MODULE = """
from pathlib import Path

Path({marker!r}).write_text("imported")


def tiny():
    raise AssertionError("never called")


def data(split):
    raise AssertionError("never called")
"""


@pytest.fixture
def user_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The two user modules, importable by the agent processes started in the test; the
    marker file that importing the evil one writes."""
    code = tmp_path / "code"
    (code / ALLOWED).mkdir(parents=True)
    (code / ALLOWED / "__init__.py").write_text("")
    (code / ALLOWED / "models.py").write_text(ALLOWED_MODELS)
    marker = tmp_path / "evil-imported"
    (code / f"{EVIL}.py").write_text(EVIL_MODULE.format(marker=str(marker)))
    path = [str(code), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))
    return marker


@pytest.fixture
def agent(
    mosquitto: Broker, user_code: Path
) -> Iterator[tuple[str, LocalFleet, MqttTransport, list[Any]]]:
    """One agent allowed ``edgetrain_allowed``; an attacker's connection (no credentials)
    and every job event it sees."""
    attacker = MqttTransport(MqttSettings(url=mosquitto.url))
    attacker.connect(timeout=10)
    events: list[Any] = []
    attacker.subscribe(job_events("+", "+"), lambda _t, p: events.append(parse_event(p)))
    fleet = LocalFleet(1, mosquitto.url, threads=1, allow_code=[ALLOWED]).start()
    try:
        fleet.wait_online(attacker, timeout=60)
        yield fleet.ids[0], fleet, attacker, events
    finally:
        fleet.stop()
        attacker.close()


def _assignment(job: str, model: str, end: int, **fields: Any) -> str:
    """An assignment as anyone could publish it: plain JSON."""
    body = {
        "type": "assign",
        "job": job,
        "stage": 0,
        "num_stages": 1,
        "start": 0,
        "end": end,
        "model": model,
        "dataset": "digits",
        "steps": 1,
        "batch_size": 8,
        **fields,
    }
    return json.dumps(body)


def _answer(events: list[Any], job: str) -> StageReady | StageFailed:
    assert until(lambda: any(e.job == job for e in events), 60), f"no answer to {job}"
    (event,) = [e for e in events if e.job == job]
    assert isinstance(event, StageReady | StageFailed), event
    return event


def test_an_open_agent_refuses_code_it_was_not_allowed_and_keeps_serving(
    agent: tuple[str, LocalFleet, MqttTransport, list[Any]], user_code: Path, tmp_path: Path
) -> None:
    device, fleet, attacker, events = agent
    pwned = tmp_path / "pwned"
    attacks = {
        "model-os": (
            _assignment("model-os", "os:system", 1, model_options={"command": f"touch {pwned}"}),
            "model 'os:system': module 'os' is not allowed",
            "--allow-code os",
        ),
        "dataset-os": (
            _assignment(
                "dataset-os",
                "mlp",
                3,
                dataset="os:system",
                dataset_options={"command": f"touch {pwned}"},
            ),
            "dataset 'os:system': module 'os' is not allowed",
            "--allow-code os",
        ),
        "model-evil": (
            _assignment("model-evil", f"{EVIL}:tiny", 2),
            f"model '{EVIL}:tiny': module '{EVIL}' is not allowed",
            f"--allow-code {EVIL}",
        ),
        "dataset-evil": (
            _assignment("dataset-evil", "mlp", 3, dataset=f"{EVIL}:data"),
            f"dataset '{EVIL}:data': module '{EVIL}' is not allowed",
            f"--allow-code {EVIL}",
        ),
    }
    for job, (payload, refused, how) in attacks.items():
        attacker.publish(device_cmd(device), payload, 1)
        answer = _answer(events, job)
        assert isinstance(answer, StageFailed), answer
        assert answer.device == device and answer.stage == 0
        assert answer.error.startswith(f"CodeNotAllowed: {refused} here"), answer.error
        assert answer.error.endswith(how), answer.error
        assert f"user code under {ALLOWED})" in answer.error
    assert not pwned.exists() and not user_code.exists()

    # Still serving: a zoo model, and (the first cancelled) a user model it was allowed.
    attacker.publish(device_cmd(device), _assignment("zoo", "mlp", 3), 1)
    assert isinstance(_answer(events, "zoo"), StageReady)
    attacker.publish(device_cmd(device), CancelJob(job="zoo").model_dump_json(), 1)
    attacker.publish(device_cmd(device), _assignment("mine", f"{ALLOWED}.models:tiny", 2), 1)
    ready = _answer(events, "mine")
    assert isinstance(ready, StageReady) and ready.parameters == 64 * 10 + 10
    assert fleet.procs[device].poll() is None
    assert not pwned.exists() and not user_code.exists()
    log = fleet.log_path(device).read_text()
    assert (
        f"--insecure: no broker credentials, so anyone who can publish on {fleet.broker_url}" in log
    )
    assert "Traceback" not in log  # refusals are one warning line each


def _agent_process(broker: str, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "edgetrain.cli", "agent", "--broker", broker]
    cmd += ["--data-dir", str(tmp / "data"), "--device-id", "open-1", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


def test_an_agent_without_credentials_or_insecure_exits_2(
    mosquitto: Broker, tmp_path: Path
) -> None:
    done = _agent_process(mosquitto.url, tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        f"error: no credentials for {mosquitto.url}: anyone who can publish on it could drive "
        "this agent; give --credentials FILE (edgetrain fleet enroll), or --insecure to accept "
        "that\n"
    )
    assert not (tmp_path / "data").exists()  # refused before doing anything
    done = _agent_process(mosquitto.url, tmp_path, "--insecure", "--allow-code", "*")
    assert done.returncode == 2 and done.stderr.startswith("error: --allow-code: '*' is a wildcard")
