"""``edgetrain agent``: run the device daemon until SIGTERM or Ctrl-C.

This module owns the command's options and what the agent announces: a measured
profile, a catalogue profile, or one read from a JSON file
(:func:`edge.profiling.catalog.load_device_file`), with the datasets given by
``--data`` ([Note: local data] in :mod:`edge.models.local_data`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import math
import re
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from edge.errors import UserError

if TYPE_CHECKING:
    from edge.problem import DeviceSpec
    from edge.transport.settings import MqttSettings

__all__ = ["agent_command"]

log = logging.getLogger("edgetrain.agent")


def _login(
    broker: str | None,
    credentials: Path | None,
    insecure: bool,
    username: str | None,
    password: str | None,
    tls_ca: Path | None,
) -> tuple[MqttSettings, str | None]:
    """How the agent logs in, and the device id its credentials name (``None`` without
    them); refuses (one line) conflicting options and a login without credentials unless
    ``insecure``."""
    from edge.transport.credentials import read_credentials
    from edge.transport.settings import MqttSettings, parse_broker_url

    if credentials is not None:
        if username or password or tls_ca:
            raise UserError("--credentials: give it alone, not with --username/--password/--tls-ca")
        creds = read_credentials(credentials)
        if broker is not None and broker != creds.broker:
            raise UserError(f"--broker {broker}: the credentials are for {creds.broker}")
        return creds.settings(), creds.device_id
    if broker is None:
        raise UserError("--broker or --credentials: say which broker to connect to")
    parse_broker_url(broker)
    if username is None and not insecure:
        raise UserError(
            f"no credentials for {broker}: anyone who can publish on it could drive this "
            "agent; give --credentials FILE (edgetrain fleet enroll), or --insecure to accept that"
        )
    extra: dict[str, Any] = {"username": username, "password": password, "tls_ca": tls_ca}
    settings = MqttSettings(url=broker, **{k: v for k, v in extra.items() if v is not None})
    return settings, None


def _measured(
    device_id: str, seconds: float, device: str, precision: str, slowdown: float = 1.0
) -> DeviceSpec:
    from edge.profiling.device import profile_device

    if device == "cpu":
        return profile_device(device_id, seconds=seconds, slowdown=slowdown).to_device_spec()
    return profile_device(
        device_id,
        seconds=seconds,
        device=device,
        precision=precision,  # type: ignore[arg-type]
        slowdown=slowdown,
    ).to_device_spec()


@contextlib.contextmanager
def _exclusive(path: Path | None) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (nothing without one, or where there is
    no ``fcntl``)."""
    try:
        import fcntl
    except ImportError:  # Windows: measure without the lock
        path = None
    if path is None:
        yield
        return
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _emulating(measured: DeviceSpec, name: str, slowdown: float) -> DeviceSpec:
    """What an agent emulating catalogue device ``name`` announces: the speed it really
    gets here (this machine's measured rate over ``slowdown``), the device's memory and
    power, this machine's link and fixed costs; ``details`` name what it emulates."""
    from edge.profiling.catalog import resolve

    source = resolve(name).to_device_spec(power=True)
    details = {
        **(measured.details or {}),
        "emulates": name,
        "emulated_gflops": source.gflops,
        "measured_gflops": measured.gflops,
        "slowdown": slowdown,
    }
    return measured.model_copy(
        update={
            "gflops": measured.gflops / slowdown,
            "memory_bytes": min(measured.memory_bytes, source.memory_bytes),
            "watts_busy": source.watts_busy,
            "watts_idle": source.watts_idle,
            "details": details,
        }
    )


_HOST_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")


def _check_host(host: str) -> None:
    """A ``--store-host`` is an IP address or a host name; else a one-line error."""
    try:
        ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        if not _HOST_NAME.match(host):
            raise UserError(f"--store-host: {host!r} is not an IP address or a host name") from None


def agent_command(
    broker: str | None = typer.Option(
        None,
        "--broker",
        envvar="EDGETRAIN_BROKER",
        help="Broker URL: mqtt://HOST:PORT or mqtts://; --credentials names it otherwise.",
    ),
    credentials: Path | None = typer.Option(
        None,
        "--credentials",
        envvar="EDGETRAIN_CREDENTIALS",
        metavar="FILE",
        help=(
            "This device's broker account, as `edgetrain fleet enroll` writes it: broker, "
            "user name, password and the CA to verify the broker by."
        ),
    ),
    device_id: str = typer.Option(
        socket.gethostname(),
        "--device-id",
        envvar="EDGETRAIN_DEVICE_ID",
        help="This device's id (default: the hostname).",
    ),
    profile: str | None = typer.Option(
        None,
        "--profile",
        envvar="EDGETRAIN_PROFILE",
        metavar="NAME|FILE.json",
        help=(
            "Announce a catalogue profile (e.g. rpi4-4gb), or the device in a JSON file "
            "(as `edgetrain profile --json` writes; its id becomes --device-id), "
            "instead of measuring this machine."
        ),
    ),
    emulate: str | None = typer.Option(
        None,
        "--emulate",
        envvar="EDGETRAIN_EMULATE",
        metavar="NAME",
        help=(
            "Emulate catalogue device NAME with --slowdown: measure this machine and "
            "announce the speed it gets slowed (measured GFLOP/s / slowdown), with NAME's "
            "memory, power and link (frames shaped to it unless --link-mbps or "
            "--link-latency-ms say otherwise), so the planner predicts what it measures."
        ),
    ),
    data_dir: Path = typer.Option(
        Path.home() / ".edgetrain" / "agent",
        "--data-dir",
        envvar="EDGETRAIN_DATA_DIR",
        help="Where stage weights are kept.",
    ),
    threads: int | None = typer.Option(
        None, "--threads", envvar="EDGETRAIN_THREADS", min=1, help="torch threads."
    ),
    heartbeat_s: float = typer.Option(
        1.0, "--heartbeat-s", envvar="EDGETRAIN_HEARTBEAT_S", min=0.05, help="Heartbeat period."
    ),
    measure_seconds: float = typer.Option(
        1.0,
        "--measure-seconds",
        envvar="EDGETRAIN_MEASURE_SECONDS",
        min=0.05,
        help="How long to time matmuls when measuring.",
    ),
    measure_lock: Path | None = typer.Option(
        None,
        "--measure-lock",
        envvar="EDGETRAIN_MEASURE_LOCK",
        metavar="FILE",
        help=(
            "Hold an exclusive lock on FILE while measuring, so agents sharing a machine "
            "measure one at a time instead of each other."
        ),
    ),
    slowdown: float = typer.Option(
        1.0,
        "--slowdown",
        envvar="EDGETRAIN_SLOWDOWN",
        min=1.0,
        help="Emulate a device this many times slower (software duty-cycling of compute).",
    ),
    link_mbps: float | None = typer.Option(
        None,
        "--link-mbps",
        envvar="EDGETRAIN_LINK_MBPS",
        metavar="MBPS",
        help=(
            "Emulate a link of this many Mbit/s each way for tensor frames (software "
            "shaping, for emulated devices; control traffic is not slowed)."
        ),
    ),
    link_latency_ms: float = typer.Option(
        0.0,
        "--link-latency-ms",
        envvar="EDGETRAIN_LINK_LATENCY_MS",
        metavar="MS",
        help="Emulate this one-way latency on tensor frames, each way (software shaping).",
    ),
    username: str | None = typer.Option(
        None, "--username", envvar="EDGETRAIN_USERNAME", help="Broker user name."
    ),
    password: str | None = typer.Option(
        None,
        "--password",
        # EDGETRAIN_MQTT_PASSWORD: its name before every option had a variable.
        envvar=["EDGETRAIN_PASSWORD", "EDGETRAIN_MQTT_PASSWORD"],
        help="Broker password.",
    ),
    tls_ca: Path | None = typer.Option(
        None, "--tls-ca", envvar="EDGETRAIN_TLS_CA", help="CA bundle for mqtts://."
    ),
    log_level: str = typer.Option(
        "info", "--log-level", envvar="EDGETRAIN_LOG_LEVEL", help="debug, info, warning or error."
    ),
    device: str = typer.Option(
        "cpu",
        "--device",
        envvar="EDGETRAIN_DEVICE",
        help="Where stages compute: cpu, cuda or cuda:N (a GPU server).",
    ),
    precision: str = typer.Option(
        "fp32",
        "--precision",
        envvar="EDGETRAIN_PRECISION",
        help="With cuda: announce the fp32 or the bf16 (autocast) rate.",
    ),
    server: bool = typer.Option(
        False,
        "--server",
        envvar="EDGETRAIN_SERVER",
        help="Server tier: may join torch.distributed groups (implied by cuda).",
    ),
    allow_code: list[str] | None = typer.Option(
        None,
        "--allow-code",
        envvar="EDGETRAIN_ALLOW_CODE",
        metavar="MODULE_PREFIX",
        help=(
            "Also run user models and datasets (package.module:function) whose module is "
            "under this prefix (mypkg allows mypkg.models, not mypkgevil); repeatable. "
            "Without it the agent runs zoo models and built-in datasets only."
        ),
    ),
    data: list[str] | None = typer.Option(
        None,
        "--data",
        envvar="EDGETRAIN_DATA",
        metavar="NAME=SPEC",
        help=(
            "A dataset that lives on this device, announced by size and shape only; "
            "repeatable. SPEC: a built-in dataset or a shard of it (digits:shard=1/3), a "
            "directory of .npz files (arrays x and y), a CSV file with a label column "
            "(data.csv:label=target), or package.module:function under --allow-code."
        ),
    ),
    insecure: bool = typer.Option(
        False,
        "--insecure",
        envvar="EDGETRAIN_INSECURE",
        help=(
            "Connect without broker credentials, although anyone on that broker could "
            "then drive this agent (a testbed on a closed network)."
        ),
    ),
    store_host: list[str] = typer.Option(
        [],
        "--store-host",
        envvar="EDGETRAIN_STORE_HOST",
        metavar="ADDR",
        help="Server tier: also join groups whose rendezvous store is on ADDR (repeatable); "
        "by default only stores on the broker's host or loopback are joined.",
    ),
) -> None:
    """Run the agent daemon: register this device and run the stages it is assigned.

    It connects with a last-will (offline, retained), publishes its profile and a
    heartbeat, runs assignments from its cmd topic, reports per-step timings on
    the job's events topic, and rides out the broker going away. Logs are JSON
    lines on standard error. SIGTERM stops it cleanly.

    Every option can also come from its environment variable, EDGETRAIN_ and the
    option's name (--device-id: EDGETRAIN_DEVICE_ID), as each option's help
    says; a flag on the command line wins over the variable.

    --slowdown, --link-mbps and --link-latency-ms emulate a slower device on
    this machine without root; a measured profile then announces the link as
    shaped (its rate capped, the latency added).

    --data registers data that stays on this device: its profile says each
    dataset's name, sample count and shapes, never a sample. A bad SPEC stops the
    agent with one line before it connects.

    The agent imports no code it is sent: an assignment naming a user model or
    dataset outside the --allow-code prefixes fails before anything is imported.
    Without broker credentials it refuses to start unless given --insecure.
    """
    if link_mbps is not None and not (math.isfinite(link_mbps) and link_mbps > 0):
        raise UserError(f"--link-mbps: must be a positive number (got {link_mbps:g})")
    if not (math.isfinite(link_latency_ms) and 0 <= link_latency_ms <= 60_000):
        raise UserError(f"--link-latency-ms: must be 0 to 60000 (got {link_latency_ms:g})")
    import torch

    from edge import __version__
    from edge.agent import Agent
    from edge.logs import setup_logging
    from edge.models.user_code import allow_prefixes
    from edge.runtime.allocator import tune_malloc

    if device != "cpu" and not device.startswith("cuda"):
        raise UserError(f"--device: {device!r} is not cpu, cuda or cuda:N")
    if precision not in ("fp32", "bf16"):
        raise UserError(f"--precision: {precision!r} is not fp32 or bf16")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device}: torch sees no CUDA GPU on this machine")
    login, named = _login(broker, credentials, insecure, username, password, tls_ca)
    device_id = named or device_id
    from edge.wire.topics import valid_device_id

    if not valid_device_id(device_id):
        raise UserError(
            f"--device-id: {device_id!r} is not 1-64 of A-Z a-z 0-9 _ . - "
            "(starting with a letter or digit)"
        )
    for host in store_host:
        _check_host(host)
    announced: DeviceSpec | None = None  # bad input fails here, before connecting
    if emulate is not None:
        if profile is not None:
            raise UserError("--emulate and --profile: give one")
        from edge.profiling.catalog import resolve

        source = resolve(emulate).to_device_spec()  # an unknown name fails here
        # Its link too: frames are shaped to the device's, which it then announces.
        link_mbps = link_mbps or source.bandwidth_mbps
        link_latency_ms = link_latency_ms or source.latency_ms
    if profile is not None and (profile.endswith(".json") or Path(profile).is_file()):
        from edge.profiling.catalog import load_device_file

        announced = load_device_file(Path(profile), device_id)
    elif profile is not None:
        from edge.profiling.catalog import resolve

        announced = resolve(profile).to_device_spec(device_id, power=True)
    allowed = allow_prefixes(allow_code or [])
    from edge.models.local_data import register

    local_data = register(data or [], allowed)
    setup_logging(log_level, device=device_id)
    tune_malloc()
    if threads is not None:
        torch.set_num_threads(threads)
    data_dir.mkdir(parents=True, exist_ok=True)
    settings = login.model_copy(update={"link_mbps": link_mbps, "link_latency_ms": link_latency_ms})
    if settings.username is None:
        log.warning(
            "--insecure: no broker credentials, so anyone who can publish on %s could drive "
            "this agent",
            settings.url,
        )

    tier = {"server": True, "torch_device": device} if server or device != "cpu" else {}

    def measure() -> DeviceSpec:
        if announced is None and measure_lock is not None:
            from edge.profiling.fixed_costs import prepare_fixed_costs

            prepare_fixed_costs()  # loading, not timing: beside the others, not in turn
        with _exclusive(measure_lock if announced is None else None):
            spec = announced or _measured(device_id, measure_seconds, device, precision, slowdown)
        if emulate is not None:
            spec = _emulating(spec, emulate, slowdown)
            link = {"bandwidth_mbps": link_mbps, "latency_ms": link_latency_ms}
            return spec.model_copy(update=link)
        if tier:
            spec = spec.model_copy(update={"details": {**(spec.details or {}), **tier}})
        if announced is not None or (link_mbps is None and not link_latency_ms):
            return spec
        # Shaping caps the rate of the real link and adds to its latency.
        bandwidth = min(spec.bandwidth_mbps, link_mbps or math.inf)
        latency = spec.latency_ms + link_latency_ms
        return spec.model_copy(update={"bandwidth_mbps": bandwidth, "latency_ms": latency})

    agent = Agent(
        settings,
        device_id,
        measure,
        data_dir=data_dir,
        heartbeat_s=heartbeat_s,
        version=__version__,
        slowdown=slowdown,
        torch_device=device,
        allow_code=allowed,
        store_hosts=store_host,
        local_data=local_data,
    )
    signal.signal(signal.SIGTERM, lambda *_: agent.stop())
    signal.signal(signal.SIGINT, lambda *_: agent.stop())
    raise typer.Exit(agent.run())
