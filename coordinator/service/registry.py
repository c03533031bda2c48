"""The fleet as the coordinator sees it: devices, their state, profile and last sign of life.

The registry listens to every device's retained ``status`` and ``profile``
topics and to heartbeats, through a :class:`~coordinator.engine.watch.DeviceFeed`.
A device is ``online`` (or ``busy``) from its status until its last-will says
``offline`` or no heartbeat has come for ``heartbeat_timeout_s``; it is then
marked ``offline`` with the time it was last seen, and a heartbeat brings it back.
A heartbeat of a device whose profile never came is ignored: it cannot be planned
on. A device's profile may list the datasets it holds ([Note: local data] in
:mod:`edge.models.local_data`): :attr:`DeviceView.datasets` reads them and
:meth:`DeviceRegistry.holders` finds the online devices that hold a dataset of a
name. Every change is written to
the store (heartbeats at most every few seconds per device) and announced on
the event bus, and every change of state is one log line (``device pi-1: online
-> offline``, with ``device`` and, when the registry decided it, ``reason``).

Tested in tests/unit/coordinator/service/api/routes/test_device_routes.py (datasets,
holders, heartbeats) and tests/e2e/test_service.py (a device that dies goes offline).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from coordinator.engine.watch import DeviceFeed
from coordinator.planner.predict import PLANNING_DETAILS
from coordinator.service.events import EventBus
from edge.models.local_data import DETAILS_KEY as DATASETS
from edge.models.local_data import LocalDatasetInfo, announced
from edge.problem import DeviceSpec
from edge.transport.mqtt import MqttTransport
from edge.wire.messages import DeviceStatus, Heartbeat

__all__ = ["DeviceRegistry", "DeviceView"]

log = logging.getLogger(__name__)

_PERSIST_EVERY_S = 5.0


@dataclass
class DeviceView:
    """What the coordinator knows of one device."""

    id: str
    state: str = "offline"
    last_seen: float | None = None
    profile: dict[str, Any] | None = None
    job: str | None = None
    stage: int | None = None

    @property
    def datasets(self) -> dict[str, LocalDatasetInfo]:
        """The local datasets its profile announces, by name."""
        return announced(self.profile)

    def to_json(self) -> dict[str, Any]:
        """Its fields, and ``datasets`` (each as JSON) read from the profile."""
        infos = {name: info.model_dump(mode="json") for name, info in self.datasets.items()}
        return {**asdict(self), "datasets": infos}


class DeviceRegistry:
    """Tracks devices from MQTT (see the module docstring)."""

    def __init__(
        self, store: Any, bus: EventBus, control: MqttTransport, heartbeat_timeout_s: float = 3.0
    ) -> None:
        self.store = store
        self.bus = bus
        self.control = control
        self.timeout = heartbeat_timeout_s
        self._lock = threading.Lock()
        self._devices: dict[str, DeviceView] = {}
        self._persisted: dict[str, float] = {}
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="device-watchdog", daemon=True)
        self._feed = DeviceFeed(
            control,
            on_status=self._on_status,
            on_profile=self._on_profile,
            on_heartbeat=self._on_heartbeat,
        )
        for record in store.list_devices():
            # What the store knew before a restart; MQTT's retained messages refresh it.
            self._devices[record.id] = DeviceView(
                id=record.id,
                state="offline",
                last_seen=record.last_seen,
                profile=record.profile,
                job=None,
                stage=None,
            )

    def start(self) -> None:
        self._feed.start()
        self._watchdog.start()

    def stop(self) -> None:
        self._feed.stop()
        self._stop.set()
        if self._watchdog.is_alive():
            self._watchdog.join(timeout=5)

    # -- reads -------------------------------------------------------------------------

    def devices(self) -> list[DeviceView]:
        with self._lock:
            return [
                DeviceView(**asdict(d)) for d in sorted(self._devices.values(), key=lambda d: d.id)
            ]

    def get(self, device: str) -> DeviceView | None:
        with self._lock:
            d = self._devices.get(device)
            return None if d is None else DeviceView(**asdict(d))

    def available(self, allowed: list[str] | None = None) -> list[DeviceSpec]:
        """Profiles of online, idle devices (in ``allowed`` when given), by id."""
        return self.planning_profiles(allowed, busy=False)

    def planning_profiles(
        self, allowed: list[str] | None = None, *, busy: bool = True
    ) -> list[DeviceSpec]:
        """Profiles of online devices, idle or (``busy``) running a job, in ``allowed``
        when given, by id: what the planner reads of them."""
        states = ("online", "busy") if busy else ("online",)
        out = []
        for d in self.devices():
            if d.state not in states or d.profile is None:
                continue
            if allowed is not None and d.id not in allowed:
                continue
            # Of the free-form details only what the planner reads reaches it (the cost
            # model's figures, the local datasets it holds); the rest stays on the record.
            got = d.profile.get("details") or {}
            keys = (*PLANNING_DETAILS, DATASETS)
            details = {k: got[k] for k in keys if k in got} or None
            out.append(DeviceSpec.model_validate({**d.profile, "id": d.id, "details": details}))
        return out

    def holders(self, dataset: str) -> dict[str, LocalDatasetInfo]:
        """The online devices (idle or busy) holding a local dataset named ``dataset``, by id."""
        out = {}
        for d in self.devices():
            info = d.datasets.get(dataset)
            if d.state != "offline" and info is not None:
                out[d.id] = info
        return out

    # -- MQTT callbacks (paho's network thread) ---------------------------------------

    def _update(
        self, device: str, persist: bool = True, reason: str | None = None, **fields: Any
    ) -> None:
        with self._lock:
            view = self._devices.setdefault(device, DeviceView(device))
            before = (view.state, view.job, view.stage, view.profile is None)
            for key, value in fields.items():
                setattr(view, key, value)
            changed = before != (view.state, view.job, view.stage, view.profile is None)
            snapshot = view.to_json()
        if snapshot["state"] != before[0]:
            log.info(
                "device %s: %s -> %s",
                device,
                before[0],
                snapshot["state"],
                extra={"device": device, "reason": reason},
            )
        now = time.monotonic()
        if persist or changed or now - self._persisted.get(device, 0) > _PERSIST_EVERY_S:
            self._persisted[device] = now
            self.store.upsert_device(
                device,
                state=snapshot["state"],
                last_seen=snapshot["last_seen"],
                profile=snapshot["profile"],
                job=snapshot["job"],
                stage=snapshot["stage"],
            )
        if changed or "profile" in fields:
            self.bus.publish("device", snapshot)

    def _on_status(self, device: str, status: DeviceStatus) -> None:
        seen = time.time() if status.state != "offline" else status.ts
        self._update(device, state=status.state, job=status.job, stage=status.stage, last_seen=seen)

    def _on_profile(self, device: str, spec: DeviceSpec) -> None:
        self._update(device, profile=spec.model_dump(mode="json", exclude_none=True))

    def _on_heartbeat(self, device: str, beat: Heartbeat) -> None:
        with self._lock:
            current = self._devices.get(device)
            state = current.state if current is not None else "offline"
        if current is None or current.profile is None:
            return  # not announced yet: its status and profile come first
        if state == "offline":
            state = "busy" if beat.job else "online"
        self._update(device, persist=False, state=state, last_seen=time.time())

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout / 3)):
            now = time.time()
            with self._lock:
                stale = [
                    d.id
                    for d in self._devices.values()
                    if d.state != "offline"
                    and d.last_seen is not None
                    and now - d.last_seen > self.timeout
                ]
            for device in stale:
                self._update(
                    device,
                    reason=f"no heartbeat for {self.timeout:g} s",
                    state="offline",
                    job=None,
                    stage=None,
                )
