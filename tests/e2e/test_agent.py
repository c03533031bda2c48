"""The agent daemon as a process: announce, obey, ride out the broker, stop cleanly.

The jobs here are one stage on one agent on purpose: what is under test is the
daemon (commands, busy refusals, broker restarts), not a pipeline; pipelines of
agents are tested in test_pipeline_parity.py, test_api.py and the others.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest
from support.markers import needs_mosquitto
from support.mosquitto import mosquitto_broker
from support.waiting import until

from coordinator.engine.assignments import make_assignments
from coordinator.engine.monitor import JobFailed
from coordinator.engine.options import RunOptions
from coordinator.engine.runners import run_on_agents
from coordinator.engine.spec import JobSpec
from coordinator.local.fleet import LocalFleet
from coordinator.planner.score import Plan
from edge.transport.mqtt import MqttSettings, MqttTransport
from edge.wire.messages import DeviceStatus, DistGroup, StageFailed, parse_event
from edge.wire.topics import device_cmd, device_status, job_events

pytestmark = needs_mosquitto


def _watch_status(control: MqttTransport, device: str) -> Callable[[], DeviceStatus | None]:
    seen: list[DeviceStatus] = []
    control.subscribe(
        device_status(device), lambda _t, p: seen.append(DeviceStatus.model_validate_json(p))
    )
    return lambda: seen[-1] if seen else None


@pytest.fixture
def one_agent() -> Iterator[tuple[str, MqttTransport, LocalFleet]]:
    with mosquitto_broker() as broker:
        control = MqttTransport(MqttSettings(url=broker.url))
        control.connect(timeout=10)
        fleet = LocalFleet(1, broker.url, threads=1).start()
        try:
            fleet.wait_online(control, timeout=60)
            yield broker.url, control, fleet
        finally:
            fleet.stop()
            control.close()


def test_sigterm_publishes_offline_and_exits_zero(one_agent) -> None:  # type: ignore[no-untyped-def]
    _url, control, fleet = one_agent
    device = fleet.ids[0]
    status = _watch_status(control, device)
    assert until(lambda: status() is not None and status().state == "online", 10)
    fleet.kill(device, signal.SIGTERM)
    assert fleet.procs[device].wait(15) == 0
    assert until(lambda: status().state == "offline", 10)  # type: ignore[union-attr]


def test_sigkill_leaves_last_will_and_no_process(one_agent) -> None:  # type: ignore[no-untyped-def]
    _url, control, fleet = one_agent
    device = fleet.ids[0]
    pid = fleet.procs[device].pid
    status = _watch_status(control, device)
    fleet.kill(device, signal.SIGKILL)
    fleet.procs[device].wait(10)
    # The broker notices the dead connection (keepalive or socket close) and publishes the will.
    assert until(lambda: status() is not None and status().state == "offline", 60)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_store_on_an_address_the_agent_does_not_accept_fails_the_stage(one_agent) -> None:  # type: ignore[no-untyped-def]
    """Not loopback, not the broker's host, no --store-host: the stage fails at once, naming
    the address; joining would have waited for the store (two minutes) instead."""
    _url, control, fleet = one_agent
    device = fleet.ids[0]
    spec = JobSpec(model="mlp", steps=1, batch_size=8, microbatches=2)
    (a,) = make_assignments("storejob", spec, Plan.of((device, 0, 3)))
    group = DistGroup(store_host="192.0.2.7", store_port=29500, world_size=1, ranks={0: 0})
    events: list[Any] = []
    control.subscribe(job_events("storejob", device), lambda _t, p: events.append(parse_event(p)))
    control.publish(device_cmd(device), a.model_copy(update={"dist": group}).model_dump_json(), 1)
    assert until(lambda: events, 20), fleet.tail(device)
    (failed,) = events
    assert isinstance(failed, StageFailed) and failed.stage == 0
    assert "refused the rendezvous store at 192.0.2.7:29500" in failed.error
    assert fleet.procs[device].poll() is None


@pytest.mark.slow
def test_bad_commands_are_ignored_and_a_busy_agent_refuses_a_second_job(one_agent) -> None:  # type: ignore[no-untyped-def]
    """One stage is the point: a single agent's reaction to junk and to a second job."""
    _url, control, fleet = one_agent
    device = fleet.ids[0]
    for junk in (b"not json", b'{"type": "assign"}', b'{"type": "launch-missiles"}', b"\xff" * 9):
        control.publish(device_cmd(device), junk, 1)
    spec = JobSpec(model="mlp", steps=3, batch_size=8, microbatches=2)
    result = run_on_agents(
        spec, Plan.of((device, 0, 3)), control, options=RunOptions(timeout_s=120)
    )
    assert len(result.losses) == 3 and {r.stage for r in result.reports} == {0}
    assert fleet.procs[device].poll() is None
    assert "ignored a command" in fleet.log_path(device).read_text()

    # A long job keeps it busy; a second job on the same device is refused, not queued.
    long = JobSpec(model="gpt-mini", steps=400, batch_size=8, microbatches=2)
    done = threading.Event()
    errors: list[BaseException] = []

    def first() -> None:
        try:
            run_on_agents(
                long,
                Plan.of((device, 0, 6)),
                control,
                job="longjob",
                options=RunOptions(timeout_s=20),
            )
        except BaseException as exc:  # the test cancels it by timing out
            errors.append(exc)
        done.set()

    threading.Thread(target=first, daemon=True).start()
    time.sleep(3)
    with pytest.raises(JobFailed, match="busy"):
        run_on_agents(
            spec, Plan.of((device, 0, 3)), control, job="second", options=RunOptions(timeout_s=30)
        )
    done.wait(60)
    assert fleet.procs[device].poll() is None


@pytest.mark.slow
def test_agent_rides_out_a_broker_restart() -> None:
    """One stage is the point: one agent announces itself again and takes a job."""
    with mosquitto_broker() as first:
        port, url = first.port, first.url
        fleet = LocalFleet(1, url, threads=1).start()
        try:
            control = MqttTransport(MqttSettings(url=url))
            control.connect(timeout=10)
            fleet.wait_online(control, timeout=60)
            control.close()
            first.stop()
            time.sleep(1.0)
            with mosquitto_broker(port=port) as second:
                control = MqttTransport(MqttSettings(url=second.url))
                control.connect(timeout=10)
                try:
                    status = _watch_status(control, fleet.ids[0])
                    # The new broker has no retained state: the agent must announce again.
                    assert until(lambda: status() is not None and status().state == "online", 30)
                    result = run_on_agents(
                        JobSpec(model="mlp", steps=2, batch_size=8, microbatches=2),
                        Plan.of((fleet.ids[0], 0, 3)),
                        control,
                        options=RunOptions(timeout_s=60),
                    )
                    assert len(result.losses) == 2
                finally:
                    control.close()
            assert fleet.procs[fleet.ids[0]].poll() is None
        finally:
            fleet.stop()
