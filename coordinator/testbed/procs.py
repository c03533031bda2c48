"""The processes of a testbed: how each is started, recorded and awaited.

Every process is detached (its own session, so it outlives the ``testbed up``
that started it and no terminal signal reaches it), writes its output to a file
under ``<state dir>/logs``, carries the testbed's token in its environment and
is recorded in the state (pid and start time) as soon as it runs:

- the **broker**: Mosquitto bound to 127.0.0.1 on a free port, with TLS and the
  dynamic-security plugin (:mod:`coordinator.testbed.access`); its config and private
  copies of its files in a directory of its own that the state records, which its
  user can read (:func:`coordinator.local.broker.write_mosquitto_config`). Where
  Mosquitto is not installed, the embedded amqtt broker, anonymous, in a process of
  its own (``python -m coordinator.testbed.procs amqtt PORT``);
- the **coordinator**: ``edgetrain coordinator`` on a free port, awaited on ``/healthz``,
  given the state directory (``--testbed-state``) so that jobs' kill and join
  faults act on the testbed's agents (:mod:`coordinator.testbed.actuator`), the
  broker's accounts record (``--broker-accounts``) so that its jobs' ACLs follow their
  plans, and the state's API token as ``EDGETRAIN_API_TOKEN``, in its environment
  (its owner's to read) rather than on its command line (anyone's), so that no other
  local process may enrol, revoke or submit;
- the **delay proxy** (kernel method): :mod:`coordinator.testbed.proxy`;
- one **agent** per device: ``edgetrain agent --credentials FILE`` announcing the
  profile file the testbed wrote; under the kernel method it is started by a tiny ``sh`` that
  writes its own pid into the agent's cgroups and then ``exec``s
  ``ip netns exec NS edgetrain agent ...``, so the agent is limited from its
  first instruction and keeps that pid.

Tested in tests/unit/coordinator/testbed/test_testbed_limits.py (the agents' command
lines), tests/integration/test_testbed_processes.py and tests/e2e/test_testbed.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from coordinator.engine.watch import DeviceFeed
from coordinator.local.broker import (
    BrokerSecurity,
    find_mosquitto,
    free_port,
    write_mosquitto_config,
)
from coordinator.testbed.state import ENV_TOKEN, State
from edge.errors import UserError
from edge.transport.mqtt import MqttTransport
from edge.transport.settings import MqttSettings
from edge.wire.messages import DeviceStatus

__all__ = [
    "API_TOKEN_ENV",
    "CGROUP_EXEC",
    "agent_command",
    "agent_states",
    "login_args",
    "spawn",
    "start_broker",
    "start_coordinator",
    "wait_http",
    "wait_online",
]

API_TOKEN_ENV = "EDGETRAIN_API_TOKEN"
"""The coordinator's setting that holds its API token (``Settings.api_token``)."""

PRIVATE_PREFIX = "edgetrain-testbed-broker-"
"""Name prefix of the broker's private directory (in the system's temporary directory)."""

CGROUP_EXEC = (
    'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 97; shift; n=$((n-1)); done; '
    'exec "$@"'
)
"""``sh -c`` script: ``sh -c CGROUP_EXEC sh N FILE1..FILEN CMD...`` joins N cgroups, runs CMD.

Arguments are positional parameters, never spliced into the script text.
"""


def spawn(
    state: State, name: str, cmd: list[str], env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` detached, its output in ``logs/<name>.log``, and record it in ``state``."""
    logs = state.dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    full_env = dict(env or os.environ)
    full_env[ENV_TOKEN] = state.token
    with (logs / f"{name.replace(':', '-')}.log").open("ab") as log:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
        )
    state.add_process(name, proc.pid)
    return proc


def log_tail(state: State, name: str, lines: int = 5) -> str:
    path = state.dir / "logs" / f"{name.replace(':', '-')}.log"
    text = path.read_text(errors="replace") if path.exists() else ""
    return " | ".join(text.strip().splitlines()[-lines:])


def _wait(
    check: Callable[[], bool],
    proc: subprocess.Popen[bytes],
    what: str,
    state: State,
    name: str,
    timeout_s: float,
) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}): {log_tail(state, name)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready within {timeout_s:g} s: {log_tail(state, name)}")
        time.sleep(0.05)


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def start_broker(
    state: State, port: int, security: BrokerSecurity | None, timeout_s: float = 15.0
) -> tuple[subprocess.Popen[bytes], str]:
    """The broker on 127.0.0.1:``port`` (secure with ``security``: Mosquitto only); its
    process and URL once it accepts."""
    binary = find_mosquitto()
    if binary is not None:
        private = Path(tempfile.mkdtemp(prefix=PRIVATE_PREFIX))
        state.intend("private_dirs", str(private))
        conf = write_mosquitto_config(private, port, security)
        cmd = [binary, "-c", str(conf)]
    elif security is not None:
        raise UserError("a secure testbed broker needs mosquitto; the amqtt one is anonymous")
    else:
        cmd = [sys.executable, "-m", "coordinator.testbed.procs", "amqtt", str(port)]
    proc = spawn(state, "broker", cmd)
    _wait(lambda: _accepts("127.0.0.1", port), proc, "the broker", state, "broker", timeout_s)
    return proc, f"{'mqtts' if security is not None else 'mqtt'}://127.0.0.1:{port}"


def wait_http(
    url: str, proc: subprocess.Popen[bytes], state: State, name: str, timeout_s: float
) -> None:
    """Wait until ``url`` answers 200 (and ``proc`` is alive)."""

    def ok() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    _wait(ok, proc, name, state, name, timeout_s)


def start_coordinator(
    state: State, broker_url: str, accounts: Path | None
) -> tuple[subprocess.Popen[bytes], str]:
    """``edgetrain coordinator`` on a free port (not awaited: see :func:`wait_http`), with
    the broker's accounts record ``accounts`` (``None``: an anonymous broker) and the API
    token ``state.api_token``, which it requires."""
    if not state.api_token:
        raise ValueError("a testbed's coordinator needs its API token (State.api_token)")
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "edgetrain.cli",
        "coordinator",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--broker",
        broker_url,
        "--data-dir",
        str(state.dir / "coordinator"),
        "--log-level",
        "warning",
        "--testbed-state",
        str(state.dir),
    ]
    if accounts is not None:
        cmd += ["--broker-accounts", str(accounts)]
    env = {**os.environ, API_TOKEN_ENV: state.api_token}
    return spawn(state, "coordinator", cmd, env), f"http://127.0.0.1:{port}"


def login_args(credentials: Path | None, broker_url: str) -> list[str]:
    """How an agent logs in: with its credentials file, or, on an anonymous broker (no
    credentials), by URL with ``--insecure``."""
    if credentials is not None:
        return ["--credentials", str(credentials)]
    return ["--broker", broker_url, "--insecure"]


def agent_command(
    login: list[str],
    device: str,
    *,
    profile: Path,
    data_dir: Path,
    threads: int,
    shaping: dict[str, float] | None = None,
    data: Sequence[str] = (),
) -> list[str]:
    """``edgetrain agent`` for ``device`` logging in by ``login`` (:func:`login_args`);
    ``shaping``: the software method's extra flags; ``data``: its ``--data NAME=SPEC``
    items (local datasets, [Note: local data] in :mod:`edge.models.local_data`)."""
    cmd = [
        sys.executable,
        "-m",
        "edgetrain.cli",
        "agent",
        *login,
        "--device-id",
        device,
        "--data-dir",
        str(data_dir),
        "--threads",
        str(threads),
        "--heartbeat-s",
        "0.5",
        "--profile",
        str(profile),
    ]
    for flag, value in (shaping or {}).items():
        cmd += [flag, f"{value:g}"]
    for item in data:
        cmd += ["--data", item]
    return cmd


def in_cgroups_and_netns(cmd: list[str], procs_files: list[Path], namespace: str) -> list[str]:
    """``cmd`` started inside the cgroups whose ``cgroup.procs`` are given, in ``namespace``."""
    return (
        ["sh", "-c", CGROUP_EXEC, "sh", str(len(procs_files))]
        + [str(p) for p in procs_files]
        + ["ip", "netns", "exec", namespace]
        + cmd
    )


def _watch(
    login: MqttSettings, client_id: str
) -> tuple[MqttTransport, dict[str, DeviceStatus], threading.Condition]:
    """A connection whose :class:`DeviceFeed` keeps each device's newest status in ``seen``."""
    control = MqttTransport(login.model_copy(update={"client_id": client_id}))
    control.connect(timeout=10)
    seen: dict[str, DeviceStatus] = {}
    cond = threading.Condition()

    def on_status(device: str, status: DeviceStatus) -> None:
        with cond:
            seen[device] = status
            cond.notify_all()

    DeviceFeed(control, on_status=on_status).start()  # ends with the connection
    return control, seen, cond


def wait_online(
    login: MqttSettings,
    ids: list[str],
    since: float,
    failed: Callable[[], str | None],
    timeout_s: float,
) -> None:
    """Wait until every device in ``ids`` says it is online (a status newer than ``since``).

    ``login``: the testbed's own (:func:`coordinator.testbed.access.coordinator_login`).
    ``failed()`` names an agent that exited (ending the wait with an error); past
    ``timeout_s`` the error names the devices still missing.
    """
    control, seen, cond = _watch(login, f"testbed-wait-{os.getpid()}")
    deadline = time.monotonic() + timeout_s
    try:
        with cond:
            while True:
                online = {d for d, s in seen.items() if s.state != "offline" and s.ts >= since - 1}
                missing = [d for d in ids if d not in online]
                if not missing:
                    return
                why = failed()
                if why:
                    raise RuntimeError(why)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"agents {missing} not online within {timeout_s:g} s")
                cond.wait(0.2)
    finally:
        control.close()


def agent_states(login: MqttSettings, ids: list[str], timeout_s: float = 2.0) -> dict[str, str]:
    """Each device's retained status (``online``, ``busy``, ``offline``; ``unknown`` if none)."""
    try:
        control, seen, cond = _watch(login, f"testbed-status-{os.getpid()}")
    except Exception:  # the broker is gone: nothing is known
        return dict.fromkeys(ids, "unknown")
    try:
        with cond:
            cond.wait_for(lambda: all(d in seen for d in ids), timeout_s)
            return {d: seen[d].state if d in seen else "unknown" for d in ids}
    finally:
        control.close()


def _amqtt_main(port: int) -> None:
    """The embedded broker as a process of its own, until SIGTERM."""
    import signal

    from coordinator.local.broker import running_broker

    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    with running_broker("amqtt", port):
        done.wait()


if __name__ == "__main__":
    if sys.argv[1:2] == ["amqtt"] and len(sys.argv) == 3:
        _amqtt_main(int(sys.argv[2]))
    else:
        sys.exit("usage: python -m coordinator.testbed.procs amqtt PORT")
