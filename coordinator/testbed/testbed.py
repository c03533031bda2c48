"""Bringing a testbed up and down: the Python API behind ``edgetrain testbed``.

:meth:`Testbed.up` maps the devices onto this machine
(:func:`~coordinator.testbed.sizing.emulate`), measures this machine's
single-core speed once (so each agent announces the speed it really gets),
picks the method (:func:`~coordinator.testbed.limits.detect`), and starts, each
recorded in the state before it exists (:mod:`coordinator.testbed.state`):

1. the broker (127.0.0.1 only): Mosquitto with TLS and an account per agent, each
   agent enrolled first and given its credentials file
   (:mod:`coordinator.testbed.access`); and, unless its :class:`StartOptions` say
   ``coordinator=False``, the coordinator, which administers those accounts (it
   creates them in the broker at its start, so it is awaited before the agents
   start); without it the testbed attaches them itself (:attr:`Testbed.accounts`).
   The coordinator requires an API token generated here (:attr:`Testbed.api_token`,
   kept in the state) on its write routes, so that no other process on this machine
   enrols a device in its name or submits a job;
2. kernel and scalar methods: per agent a cgroup in the cpu and memory hierarchies,
   a namespace with a tbf-shaped veth pair, and one delay proxy for all of them (the
   links' addresses are fixed before the broker starts: its certificate names them);
3. the agents, each announcing ``<state dir>/profiles/<id>.json`` (under the scalar
   method with its compute throttle, ``--slowdown``: [Note: two speeds of a device]
   in :mod:`coordinator.testbed.sizing`);

then waits until every agent is online. If anything fails, everything made so
far is removed before the error is raised. The processes are detached: the
fleet keeps running after the process that called ``up`` exits, until
:func:`down` (which needs only the state directory).

:meth:`Testbed.join` adds one agent to a running software-method testbed (a
``join`` fault: the coordinator does it, holding the state's lock), emulated at
the scale the others got, enrolled on the running broker, and records it so that
``down`` removes it too.
"""

from __future__ import annotations

import contextlib
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from coordinator.access.accounts import BrokerAccounts
from coordinator.local.broker import BrokerSecurity, free_port
from coordinator.testbed import access, limits, netns, procs
from coordinator.testbed.limits import METHODS, MethodChoice
from coordinator.testbed.sizing import MIN_CPUS, EmulatedDevice, emulate
from coordinator.testbed.state import State, locked
from coordinator.testbed.teardown import down, status, teardown
from edge.errors import UserError
from edge.files import write_atomic
from edge.problem import DeviceSpec
from edge.profiling.fixed_costs import measure_fixed_costs
from edge.transport.credentials import Credentials
from edge.transport.mqtt import MqttTransport
from edge.transport.settings import MqttSettings

__all__ = ["MethodChoice", "StartOptions", "Testbed", "down", "measure_core_gflops", "status"]


@dataclass(frozen=True)
class StartOptions:
    """How :meth:`Testbed.up` starts a testbed, whatever its devices."""

    method: MethodChoice = "auto"
    """``kernel`` limits (cgroups, namespaces, tc; the quota at the FLOP share),
    ``scalar`` (the same, the quota at the scalar share and compute throttled on to the
    FLOP share) or the ``software`` throttle; ``auto``: ``kernel`` where this machine
    allows it (:func:`~coordinator.testbed.limits.detect`), else ``software``."""
    coordinator: bool = True
    """Start the coordinator too (it then administers the broker's accounts)."""
    measure_s: float = 1.0
    """How long to time this machine's single-core speed."""
    online_timeout_s: float = 90.0
    """How long every agent may take to come online."""


def measure_core_gflops(seconds: float) -> float:
    """This machine's fp32 matmul GFLOP/s on one thread (torch's thread count restored)."""
    import torch

    from edge.profiling.matmul import measure_matmul_gflops

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return measure_matmul_gflops(seconds=seconds)
    finally:
        torch.set_num_threads(before)


class Testbed:
    """A running testbed (see the module docstring); a context manager that downs it."""

    __test__ = False  # not a test class, whatever pytest makes of its name

    def __init__(
        self, state: State, devices: list[EmulatedDevice], announced: dict[str, DeviceSpec]
    ) -> None:
        self.state = state
        self.devices = devices
        self.announced = announced
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._cpu_limits: list[tuple[Path, dict[str, str]]] = []
        self._logins: dict[str, list[str]] = {}  # device -> how its agent logs in
        self._data: dict[str, list[str]] = {}  # device -> its agent's --data items
        self._admin: MqttTransport | None = None
        self.accounts: BrokerAccounts | None = None
        """The broker's accounts, attached by the testbed itself when it started no
        coordinator (which would administer them): the ``access`` of a job run on the
        agents directly (``run_on_agents``), so that its stages may use their topics.
        ``None`` with a coordinator, or on the anonymous amqtt broker."""

    @property
    def state_dir(self) -> Path:
        return self.state.dir

    @property
    def broker_url(self) -> str:
        """``mqtts://127.0.0.1:PORT`` (``mqtt://`` for the anonymous amqtt broker): the
        broker, as the root namespace reaches it."""
        return self.state.broker_url

    def login(self) -> MqttSettings:
        """MQTT settings of the coordinator's account on the broker (anonymous on amqtt)."""
        return access.coordinator_login(self.state)

    @property
    def coordinator_url(self) -> str | None:
        return self.state.coordinator_url

    @property
    def api_token(self) -> str | None:
        """The token the coordinator's write routes require (``Authorization: Bearer``;
        clients: ``--token`` or ``EDGETRAIN_API_TOKEN``); ``None`` without a coordinator."""
        return self.state.api_token

    @property
    def method(self) -> str:
        """``kernel`` or ``software``."""
        return self.state.method

    @property
    def method_reason(self) -> str:
        return self.state.method_reason

    @property
    def method_line(self) -> str:
        """What ``testbed up`` prints after ``limits:``."""
        return self.state.method_line

    @property
    def core_gflops(self) -> float:
        """This machine's single-thread matmul GFLOP/s, measured at ``up``."""
        return self.state.core_gflops

    @classmethod
    def up(
        cls,
        devices: list[DeviceSpec],
        *,
        state_dir: Path,
        scale: float | None = None,
        links: dict[str, float] | None = None,
        data: dict[str, list[str]] | None = None,
        start: StartOptions = StartOptions(),
    ) -> Testbed:
        """Start a testbed emulating ``devices`` (see the module docstring), as ``start``
        says, its state in ``state_dir``. ``scale`` and ``links``: how the devices are
        emulated (:func:`~coordinator.testbed.sizing.emulate`); ``data`` maps a device to
        the local datasets its agent holds (``edgetrain agent --data`` items)."""
        method = start.method
        emulated = emulate(devices, scale, links=links)
        strangers = sorted(set(data or {}) - {d.id for d in devices})
        if strangers:
            raise UserError(f"local data for {strangers[0]!r}: no such device in the fleet")
        if method not in METHODS:
            raise UserError(f"--method: {method!r} is not one of {', '.join(METHODS)}")
        state_dir = state_dir.expanduser().resolve()
        with locked(state_dir):
            existing = State.load(state_dir)
            if existing is not None:
                raise UserError(
                    f"a testbed ({existing.phase}) already uses {state_dir}: "
                    f"run 'edgetrain testbed down --state-dir {state_dir}' first"
                )
            detection = limits.detect(method)
            if method in ("kernel", "scalar") and detection.method != method:
                raise UserError(f"--method {method} is not available here: {detection.reason}")
            state = State(
                dir=state_dir,
                id=secrets.token_hex(2),
                token=secrets.token_hex(8),
                api_token=secrets.token_urlsafe(24) if start.coordinator else None,
                method=detection.method,
                method_reason=detection.reason,
                method_line=detection.line,
                cpus_per_gflops=emulated[0].cpus / emulated[0].source.gflops,
            )
            state.save()
            bed = cls(state, emulated, {})
            bed._data = dict(data or {})
            try:
                bed._start(detection, start)
            except BaseException:
                bed._detach()
                teardown(state)
                bed.reap()
                raise
            state.phase = "up"
            state.save()
        return bed

    def _start(self, detection: limits.Detection, start: StartOptions) -> None:
        state = self.state
        state.core_gflops = measure_core_gflops(start.measure_s)
        state.core_fixed_costs = measure_fixed_costs().to_json()
        profiles = state.dir / "profiles"
        profiles.mkdir(parents=True, exist_ok=True)
        for dev in self.devices:
            self.announced[dev.id] = dev.announced(
                state.core_gflops,
                state.core_fixed_costs,
                quota=dev.quota_cpus(detection.method),
            )
            write_atomic(profiles / f"{dev.id}.json", self.announced[dev.id].model_dump_json())
        port = free_port()
        kernel = detection.method in ("kernel", "scalar")
        links = self._links() if kernel else []
        secure = access.secure_possible()
        # Where each agent reaches the broker: its link's host end (through the delay
        # proxy) under the kernel and scalar methods, else 127.0.0.1.
        hosts = [link.host_ip for link in links] or ["127.0.0.1"] * len(self.devices)
        urls = [f"{'mqtts' if secure else 'mqtt'}://{host}:{port}" for host in hosts]
        accounts, security = None, None
        if secure:
            accounts, tls = access.start_accounts(state, port, [link.host_ip for link in links])
            for dev, url in zip(self.devices, urls, strict=True):
                self._logins[dev.id] = procs.login_args(
                    access.enroll(accounts, state, dev.id, url), url
                )
            security = BrokerSecurity(tls, accounts.plugin_config())
        else:
            for dev, url in zip(self.devices, urls, strict=True):
                self._logins[dev.id] = procs.login_args(None, url)
        self._procs["broker"], state.broker_url = procs.start_broker(state, port, security)
        state.save()
        if start.coordinator:
            self._procs["coordinator"], state.coordinator_url = procs.start_coordinator(
                state, state.broker_url, access.broker_dir(state) if security else None
            )
            state.save()
            # Its start creates the agents' accounts in the broker: before they log in.
            procs.wait_http(
                f"{state.coordinator_url}/healthz",
                self._procs["coordinator"],
                state,
                "coordinator",
                timeout_s=60,
            )
        elif accounts is not None:
            self._admin = access.attach(state, accounts)
            self.accounts = accounts
        started = time.time()
        if kernel:
            self._start_kernel_agents(detection, links)
        else:
            self._start_software_agents()
        procs.wait_online(
            self.login(),
            [d.id for d in self.devices],
            started,
            self._dead_agent,
            start.online_timeout_s,
        )
        for path, wanted in self._cpu_limits:  # see [Note: agents start unthrottled]
            limits.write_limits(path, wanted)

    def _links(self) -> list[netns.Link]:
        """Each agent's namespace and veth pair, as the kernel method will make them."""
        subnet = netns.free_subnet(self.state.id)
        return [netns.link_names(self.state.id, i, subnet) for i in range(len(self.devices))]

    def _agent_cmd(self, dev: EmulatedDevice, shaping: dict[str, float] | None) -> list[str]:
        return procs.agent_command(
            self._logins[dev.id],
            dev.id,
            profile=self.state.dir / "profiles" / f"{dev.id}.json",
            data_dir=self.state.dir / "agents" / dev.id,
            threads=dev.threads,
            shaping=shaping,
            data=self._data.get(dev.id, ()),
        )

    def _row(self, dev: EmulatedDevice, **extra: Any) -> dict[str, Any]:
        return {
            "id": dev.id,
            "emulates": dev.source.id,
            "cpus": dev.cpus,
            "scalar_cpus": dev.general_cpus,
            "threads": dev.threads,
            "slowdown": dev.slowdown,
            "memory_bytes": dev.memory_bytes,
            "bandwidth_mbps": dev.bandwidth_mbps,
            "latency_ms": dev.latency_ms,
            "gflops": self.announced[dev.id].gflops,
            **extra,
        }

    def _start_software_agents(self) -> None:
        for dev in self.devices:
            self._start_software_agent(dev)

    def _start_software_agent(self, dev: EmulatedDevice) -> None:
        shaping = {
            "--slowdown": dev.slowdown,
            "--link-mbps": dev.bandwidth_mbps,
            "--link-latency-ms": dev.latency_ms,
        }
        self.state.devices.append(self._row(dev))
        name = f"agent:{dev.id}"
        self._procs[name] = procs.spawn(self.state, name, self._agent_cmd(dev, shaping))

    @classmethod
    def attach(cls, state: State) -> Testbed:
        """The testbed ``state`` describes, to add agents to (it starts nothing itself)."""
        return cls(state, [], {})

    def join(self, source: DeviceSpec, enroll: Callable[[str], Credentials] | None = None) -> str:
        """Start one more agent emulating ``source`` at this testbed's scale; its device id.

        Software method only (a kernel testbed's delay proxy has its routes fixed at
        ``up``). On a secure broker the device is enrolled first by whoever attached
        the accounts: ``enroll`` (the testbed coordinator's, which may then grant the
        newcomer a stage), else :attr:`accounts`. The agent is recorded (process and
        device row) before this returns and is not awaited: it announces itself like
        the others. The caller holds the state's lock
        (:func:`~coordinator.testbed.state.locked`).
        """
        state = self.state
        if state.method != "software":
            raise UserError(
                f"devices can join only a software-method testbed; this one uses {state.method}"
            )
        if enroll is None and self.accounts is not None:
            enroll = self.accounts.enroll
        if access.is_secure(state) and enroll is None:
            raise UserError(
                "a device joins a secure testbed through the accounts of its coordinator "
                "(a join fault) or of the process that brought it up"
            )
        if not state.cpus_per_gflops > 0:
            raise UserError(f"the testbed in {state.dir} predates joins: bring it up again")
        cpus = state.cpus_per_gflops * source.gflops
        if cpus < MIN_CPUS:
            raise UserError(f"device {source.id}: {cpus:.4f} cores is too small to emulate")
        taken = {d["id"] for d in state.devices}
        n = 1
        while f"{source.id}-joined-{n}" in taken:
            n += 1
        dev = EmulatedDevice(
            id=f"{source.id}-joined-{n}",
            source=source,
            cpus=cpus,
            memory_bytes=int(source.memory_bytes),
            bandwidth_mbps=source.bandwidth_mbps,
            latency_ms=source.latency_ms,
        )
        self.devices.append(dev)
        # A device that joins runs in software (see _start_software_agent): no quota.
        self.announced[dev.id] = dev.announced(state.core_gflops, state.core_fixed_costs)
        profile = state.dir / "profiles" / f"{dev.id}.json"
        write_atomic(profile, self.announced[dev.id].model_dump_json())
        credentials = None
        if enroll is not None and access.is_secure(state):
            credentials = access.write_credentials(state, enroll(dev.id))
        self._logins[dev.id] = procs.login_args(credentials, state.broker_url)
        self._start_software_agent(dev)
        return dev.id

    def _start_kernel_agents(self, detection: limits.Detection, links: list[netns.Link]) -> None:
        state = self.state
        assert detection.cpu is not None and detection.memory is not None
        controllers = [detection.cpu, detection.memory]
        port = int(state.broker_url.rsplit(":", 1)[1])
        routes: list[str] = []
        for i, (dev, link) in enumerate(zip(self.devices, links, strict=True)):
            for ctl in controllers:
                parent = limits.cgroup_parent(ctl, state.id)
                state.intend("cgroups", str(parent))
                state.intend("cgroups", str(parent / f"agent-{i}"))
                # [Note: agents start unthrottled] The CPU quota is written once the
                # agent is online: a 0.03-core quota would stretch importing torch to a minute.
                quota = dev.quota_cpus(detection.method)
                assert quota is not None
                wanted = limits.cgroup_limits(ctl, quota, dev.memory_bytes)
                if ctl.name == "cpu":
                    self._cpu_limits.append((parent / f"agent-{i}", wanted))
                    wanted = limits.cpu_unlimited(ctl)
                limits.make_cgroup(ctl, parent / f"agent-{i}", wanted)
            state.intend("namespaces", link.namespace)
            state.intend("veths", link.host_if)
            netns.make_link(link, dev.bandwidth_mbps)
            routes += [
                "--route",
                f"{link.host_ip}:{port}",
                f"127.0.0.1:{port}",
                f"{dev.latency_ms:g}",
            ]
        ready = state.dir / "proxy.ready"
        ready.unlink(missing_ok=True)
        proxy = procs.spawn(
            state,
            "proxy",
            [
                sys.executable,
                "-m",
                "coordinator.testbed.proxy",
                *routes,
                "--ready-file",
                str(ready),
            ],
        )
        self._procs["proxy"] = proxy
        deadline = time.monotonic() + 30
        while not ready.exists():
            if proxy.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the delay proxy did not start: {procs.log_tail(state, 'proxy')}"
                )
            time.sleep(0.05)
        for i, (dev, link) in enumerate(zip(self.devices, links, strict=True)):
            cgroups = [limits.cgroup_parent(c, state.id) / f"agent-{i}" for c in controllers]
            # The scalar method's compute throttle: blocks stretched on to the FLOP share.
            throttle = {"--slowdown": dev.slowdown} if detection.method == "scalar" else None
            cmd = procs.in_cgroups_and_netns(
                self._agent_cmd(dev, throttle),
                [c / "cgroup.procs" for c in cgroups],
                link.namespace,
            )
            state.devices.append(
                self._row(
                    dev,
                    namespace=link.namespace,
                    address=link.agent_ip,
                    cgroups=[str(c) for c in cgroups],
                )
            )
            name = f"agent:{dev.id}"
            self._procs[name] = procs.spawn(state, name, cmd)

    def _dead_agent(self) -> str | None:
        for name, proc in self._procs.items():
            if proc.poll() is not None:
                return f"{name} exited ({proc.returncode}): {procs.log_tail(self.state, name)}"
        return None

    def reap(self) -> None:
        """Collect the exit status of this object's processes that ended (no zombies)."""
        for proc in self._procs.values():
            with contextlib.suppress(Exception):
                proc.poll()

    def status(self) -> dict[str, Any]:
        """See :func:`status`."""
        return status(self.state.dir)

    def _detach(self) -> None:
        """Close the testbed's own connection to the broker's plugin, if it has one."""
        if self._admin is not None:
            self._admin.close()
            self._admin, self.accounts = None, None

    def down(self) -> list[str]:
        """See :func:`down`."""
        self._detach()
        removed = down(self.state.dir)
        self.reap()
        return removed

    def __enter__(self) -> Testbed:
        return self

    def __exit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self.down()
