"""Structured logs (edge/logs.py): what a process that called ``setup_logging`` writes.

The coordinator's own records are the point: the real :class:`DeviceRegistry`
(over a real store) sees a device come online and then miss its heartbeats, and
each change is a JSON line naming the device. Messages reach the registry through
a stand-in for the control connection (support.control), delivered as the broker would.
"""

from __future__ import annotations

import io
import json
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.control import HandDelivered
from support.waiting import until

from coordinator.service.events import EventBus
from coordinator.service.registry import DeviceRegistry
from coordinator.service.store.sqlite import Store
from edge.errors import UserError
from edge.logs import bind, setup_logging
from edge.wire.messages import DeviceStatus, Heartbeat
from edge.wire.topics import TOPIC_ROOT, device_status


@pytest.fixture
def output() -> Iterator[io.StringIO]:
    """What ``setup_logging`` writes; the root logger is put back afterwards."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    stream = io.StringIO()
    try:
        yield stream
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
        logging.captureWarnings(False)


def _lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_a_device_going_offline_is_a_json_line_from_the_registry(
    output: io.StringIO, tmp_path: Path
) -> None:
    setup_logging("info", stream=output)
    control = HandDelivered()
    bus = EventBus()
    with Store(tmp_path) as store:
        registry = DeviceRegistry(store, bus, control, heartbeat_timeout_s=0.3)  # type: ignore[arg-type]
        registry.start()
        try:
            status = DeviceStatus(device="pi-1", state="online")
            control.publish(device_status("pi-1"), status.model_dump_json().encode())
            beat = Heartbeat(device="pi-1")
            control.publish(f"{TOPIC_ROOT}/devices/pi-1/heartbeat", beat.model_dump_json().encode())
            assert until(lambda: registry.get("pi-1").state == "offline", 10)  # type: ignore[union-attr]
        finally:
            registry.stop()
            bus.close()
    lines = [line for line in _lines(output) if line["logger"] == "coordinator.service.registry"]
    assert [line["msg"] for line in lines] == [
        "device pi-1: offline -> online",
        "device pi-1: online -> offline",
    ]
    online, offline = lines
    assert online["level"] == "info" and online["device"] == "pi-1" and "reason" not in online
    assert offline["device"] == "pi-1" and offline["reason"] == "no heartbeat for 0.3 s"
    assert isinstance(offline["ts"], float) and offline["ts"] >= online["ts"]
    assert set(offline) == {"ts", "level", "logger", "msg", "device", "reason"}


def test_every_logger_and_warning_comes_out_as_json(output: io.StringIO) -> None:
    setup_logging("warning", stream=output)
    logging.getLogger("coordinator.service.manager").info("below the level: not written")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("coordinator.service.manager").exception(
            "job %s failed", "j1", extra={"job": "j1"}
        )
    bind(logging.getLogger("edge.agent"), job="j2", stage=1).warning("late", extra={"step": 7})
    logging.getLogger("uvicorn.error").warning("uvicorn's own")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("a library warning", UserWarning, stacklevel=1)
    failed, late, uvicorn, warned = _lines(output)
    assert failed["msg"] == "job j1 failed" and failed["job"] == "j1"
    assert failed["level"] == "error" and "RuntimeError: boom" in failed["error"]
    assert (late["job"], late["stage"], late["step"], late["logger"]) == ("j2", 1, 7, "edge.agent")
    assert (uvicorn["logger"], uvicorn["msg"]) == ("uvicorn.error", "uvicorn's own")
    assert warned["logger"] == "py.warnings" and "a library warning" in warned["msg"]


def test_the_device_is_on_every_line_of_an_agent(output: io.StringIO) -> None:
    setup_logging("debug", device="pi-2", stream=output)
    logging.getLogger("edge.transport.mqtt").debug("connected")
    (line,) = _lines(output)
    assert (line["device"], line["level"], line["msg"]) == ("pi-2", "debug", "connected")


def test_an_unknown_level_is_one_line(output: io.StringIO) -> None:
    with pytest.raises(UserError, match=r"--log-level: 'loud' is not one of debug, info"):
        setup_logging("loud", stream=output)
    setup_logging("WARNING", stream=output)  # any case
