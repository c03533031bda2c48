"""A real agent in a memory cgroup refuses a stage whose data it cannot hold, and keeps serving.

Issue 31's attack: a job whose ``synthetic-images`` dataset has 2^31 samples made every
stage-0 device allocate the sampler's order whole (8 bytes a sample, 16 GiB). Here the
agent runs in a cgroup (v1 or v2) capped at :data:`LIMIT`, and is sent, as a coordinator
that let it through would, an assignment whose order alone is 1 GiB: allocated, the
kernel would kill the agent. It answers ``failed`` with one line naming the dataset and
both figures, stays online, and then takes a stage that fits. An assignment whose
options are not what the model takes (a reserved name) is answered ``failed`` too,
with the reason, rather than left unanswered.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.mosquitto import Broker
from support.waiting import until

from coordinator.local.fleet import AgentRoles, LocalFleet
from coordinator.testbed.limits import (
    cgroup_limits,
    find_controllers,
    make_cgroup,
    remove_cgroup,
)
from coordinator.testbed.procs import CGROUP_EXEC
from edge.transport.mqtt import MqttSettings, MqttTransport
from edge.wire.messages import CancelJob, StageFailed, StageReady, parse_event
from edge.wire.topics import device_cmd, job_events

LIMIT = 1 << 30
"""The agent's memory cgroup limit: room for the agent, not for a 1 GiB sample order."""
SAMPLES = 1 << 27
"""Samples of the dataset that does not fit: its order alone is 2^30 bytes."""


@pytest.fixture
def memory_cgroup() -> Iterator[Path]:
    """A memory cgroup of its own capped at :data:`LIMIT`; its ``cgroup.procs``."""
    controller = find_controllers(Path("/proc/self/mountinfo").read_text()).get("memory")
    if os.geteuid() != 0 or controller is None:
        pytest.skip("needs root and a usable memory cgroup controller")
    path = controller.root / f"edgetrain-test-{os.getpid()}" / "agent"
    make_cgroup(controller, path, cgroup_limits(controller, 1.0, LIMIT))
    try:
        yield path / "cgroup.procs"
    finally:
        remove_cgroup(path, timeout_s=30)
        remove_cgroup(path.parent)


@pytest.fixture
def agent(
    mosquitto: Broker, memory_cgroup: Path
) -> Iterator[tuple[str, LocalFleet, MqttTransport, list[Any]]]:
    """One agent started inside the cgroup; a connection watching every job event."""
    control = MqttTransport(MqttSettings(url=mosquitto.url))
    control.connect(timeout=10)
    events: list[Any] = []
    control.subscribe(job_events("+", "+"), lambda _t, p: events.append(parse_event(p)))
    in_cgroup = ["sh", "-c", CGROUP_EXEC, "sh", "1", str(memory_cgroup)]
    program = [*in_cgroup, sys.executable, "-m", "edgetrain.cli"]
    fleet = LocalFleet(1, mosquitto.url, threads=1, roles=AgentRoles(programs=[program])).start()
    try:
        fleet.wait_online(control, timeout=90)
        pid = fleet.procs[fleet.ids[0]].pid
        assert pid in [int(p) for p in memory_cgroup.read_text().split()]
        yield fleet.ids[0], fleet, control, events
    finally:
        fleet.stop()
        control.close()


def _assignment(job: str, **fields: Any) -> str:
    body = {
        "type": "assign",
        "job": job,
        "stage": 0,
        "num_stages": 1,
        "start": 0,
        "end": 3,
        "model": "mlp",
        "dataset": "synthetic-images",
        "dataset_options": {"shape": [1, 8, 8], "num_classes": 10, "size": 1024},
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


def test_an_agent_refuses_data_beyond_its_memory_and_keeps_serving(
    agent: tuple[str, LocalFleet, MqttTransport, list[Any]],
) -> None:
    device, fleet, control, events = agent
    huge = {"shape": [1, 8, 8], "num_classes": 10, "size": SAMPLES}
    control.publish(device_cmd(device), _assignment("huge", dataset_options=huge), 1)
    answer = _answer(events, "huge")
    assert isinstance(answer, StageFailed), answer
    assert answer.device == device and "\n" not in answer.error
    order = SAMPLES * 8
    assert answer.error.startswith(
        f"UserError: dataset 'synthetic-images': reading it takes {order + 10 * 64 * 8:,} bytes "
        f"(the order of {SAMPLES:,} samples at 8 bytes each, and its resident data), "
        "more than the "
    ), answer.error
    free = int(answer.error.rsplit("more than the ", 1)[1].split(" bytes")[0].replace(",", ""))
    assert 0 < free < LIMIT, answer.error  # the cgroup's headroom, not the host's memory

    reserved = {"seed": 3}
    control.publish(device_cmd(device), _assignment("seeded", model_options=reserved), 1)
    answer = _answer(events, "seeded")
    assert isinstance(answer, StageFailed), answer
    assert "model mlp: model_options may not set 'seed'" in answer.error, answer.error

    control.publish(device_cmd(device), _assignment("fits"), 1)
    assert isinstance(_answer(events, "fits"), StageReady)
    control.publish(device_cmd(device), CancelJob(job="fits").model_dump_json(), 1)
    assert fleet.procs[device].poll() is None
    assert "Traceback" not in fleet.log_path(device).read_text()
