"""Faults done to a testbed's devices by the coordinator it runs: kill, slow, join.

A coordinator given a testbed's state directory (``edgetrain coordinator
--testbed-state DIR``; ``edgetrain testbed up`` starts its coordinator so) acts
on that testbed's agents when a job's faults fire (:mod:`coordinator.engine.faults`):

- ``kill``: SIGKILL to the agent process the state records for the device, after
  checking that the pid still names that process (its start time, as ``down``
  does): only processes the testbed started are ever signalled;
- ``slow``: a ``Throttle`` command on the device's ``cmd`` topic (any device);
- ``join``: one more emulated agent, started through the testbed
  (:meth:`~coordinator.testbed.testbed.Testbed.join`) under the state's lock and
  recorded there, so ``testbed down`` removes it with the rest; enrolled on the
  broker by the coordinator's own accounts (``enroll``), which then may grant it a stage.

The state file is read anew for every fault: agents that joined are in it.

Tested in tests/unit/coordinator/testbed/test_testbed_actuator.py (what it refuses) and
tests/integration/test_testbed_processes.py (real processes killed).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

from coordinator.engine.faults import Fault, ThrottleActuator
from coordinator.testbed.state import State, locked, proc_alive
from coordinator.testbed.testbed import Testbed
from edge.errors import UserError
from edge.transport.credentials import Credentials
from edge.transport.mqtt import MqttTransport

__all__ = ["TestbedActuator"]


class TestbedActuator(ThrottleActuator):
    """Kills, slows and adds the agents of the testbed in ``state_dir``; ``enroll`` gives a
    joining device its broker account (``None``: the testbed enrols it itself)."""

    __test__ = False  # not a test class, whatever pytest makes of its name

    def __init__(
        self,
        state_dir: Path,
        control: MqttTransport,
        enroll: Callable[[str], Credentials] | None = None,
    ) -> None:
        super().__init__(control)
        self.enroll = enroll
        self.state_dir = state_dir.expanduser().resolve()
        self._beds: list[Testbed] = []  # what join started: reaped when they end
        self._lock = threading.Lock()

    def _state(self) -> State:
        state = State.load(self.state_dir)
        if state is None or state.phase != "up":
            raise UserError(f"no running testbed in {self.state_dir}")
        return state

    def refusal(self, fault: Fault) -> str | None:
        if fault.kind == "slow":  # a command over MQTT: any device, no testbed needed
            return None
        try:
            state = self._state()
        except UserError as exc:
            return f"{fault.kind} faults: {exc.message}"
        if fault.kind == "join":
            if state.method != "software":
                return (
                    f"join faults need a software-method testbed; the one in {self.state_dir} "
                    f"uses {state.method} limits"
                )
            from edge.profiling.catalog import resolve

            try:
                resolve(fault.profile or "")
            except UserError as exc:
                return exc.message
        return None

    def kill(self, device: str) -> str:
        self._reap()
        state = self._state()
        records = [p for p in state.processes if p.name == f"agent:{device}"]
        if not records:
            raise UserError(f"{device} is not an agent of the testbed in {self.state_dir}")
        record = records[-1]
        if not proc_alive(record.pid, record.start):
            raise UserError(f"the agent of {device} (pid {record.pid}) is not running")
        os.kill(record.pid, signal.SIGKILL)
        return f"SIGKILL to the agent of {device} (pid {record.pid})"

    def join(self, profile: str) -> str:
        from edge.profiling.catalog import resolve

        source = resolve(profile).to_device_spec()
        self._reap()
        with self._lock, locked(self.state_dir):
            bed = Testbed.attach(self._state())
            device = bed.join(source, self.enroll)
            self._beds.append(bed)
        return device

    def _reap(self) -> None:
        with self._lock:
            for bed in self._beds:
                with contextlib.suppress(Exception):
                    bed.reap()
