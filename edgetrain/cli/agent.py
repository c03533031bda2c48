"""``edgetrain agent``: run the device daemon until SIGTERM or Ctrl-C.

This module owns the command's options, each with its environment variable
(``EDGETRAIN_`` and the option's name). What they mean is the library's: how the agent
logs in and runs (:mod:`edge.agent`), and what it announces of its device, measured,
emulated, or given as a catalogue name or a JSON file
(:mod:`edge.profiling.announcement`), with the datasets given by ``--data`` ([Note:
local data] in :mod:`edge.models.local_data`).
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Annotated, Literal

import typer

__all__ = ["agent_command"]

Broker = Annotated[
    str | None,
    typer.Option(
        "--broker",
        envvar="EDGETRAIN_BROKER",
        help="Broker URL: mqtt://HOST:PORT or mqtts://; --credentials names it otherwise.",
    ),
]
Credentials = Annotated[
    Path | None,
    typer.Option(
        "--credentials",
        envvar="EDGETRAIN_CREDENTIALS",
        metavar="FILE",
        help=(
            "This device's broker account, as `edgetrain fleet enroll` writes it: broker, "
            "user name, password and the CA to verify the broker by."
        ),
    ),
]
DeviceId = Annotated[
    str,
    typer.Option(
        "--device-id",
        envvar="EDGETRAIN_DEVICE_ID",
        help="This device's id (default: the hostname).",
    ),
]
Profile = Annotated[
    str | None,
    typer.Option(
        "--profile",
        envvar="EDGETRAIN_PROFILE",
        metavar="NAME|FILE.json",
        help=(
            "Announce a catalogue profile (e.g. rpi4-4gb), or the device in a JSON file "
            "(as `edgetrain profile --json` writes; its id becomes --device-id), "
            "instead of measuring this machine."
        ),
    ),
]
Emulate = Annotated[
    str | None,
    typer.Option(
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
]
DataDir = Annotated[
    Path,
    typer.Option("--data-dir", envvar="EDGETRAIN_DATA_DIR", help="Where stage weights are kept."),
]
Threads = Annotated[
    int | None,
    typer.Option("--threads", envvar="EDGETRAIN_THREADS", min=1, help="torch threads."),
]
HeartbeatS = Annotated[
    float,
    typer.Option(
        "--heartbeat-s", envvar="EDGETRAIN_HEARTBEAT_S", min=0.05, help="Heartbeat period."
    ),
]
MeasureSeconds = Annotated[
    float,
    typer.Option(
        "--measure-seconds",
        envvar="EDGETRAIN_MEASURE_SECONDS",
        min=0.05,
        help="How long to time matmuls when measuring.",
    ),
]
MeasureLock = Annotated[
    Path | None,
    typer.Option(
        "--measure-lock",
        envvar="EDGETRAIN_MEASURE_LOCK",
        metavar="FILE",
        help=(
            "Hold an exclusive lock on FILE while measuring, so agents sharing a machine "
            "measure one at a time instead of each other."
        ),
    ),
]
Slowdown = Annotated[
    float,
    typer.Option(
        "--slowdown",
        envvar="EDGETRAIN_SLOWDOWN",
        min=1.0,
        help="Emulate a device this many times slower (software duty-cycling of compute).",
    ),
]
LinkMbps = Annotated[
    float | None,
    typer.Option(
        "--link-mbps",
        envvar="EDGETRAIN_LINK_MBPS",
        metavar="MBPS",
        help=(
            "Emulate a link of this many Mbit/s each way for tensor frames (software "
            "shaping, for emulated devices; control traffic is not slowed)."
        ),
    ),
]
LinkLatencyMs = Annotated[
    float,
    typer.Option(
        "--link-latency-ms",
        envvar="EDGETRAIN_LINK_LATENCY_MS",
        metavar="MS",
        help="Emulate this one-way latency on tensor frames, each way (software shaping).",
    ),
]
Username = Annotated[
    str | None,
    typer.Option("--username", envvar="EDGETRAIN_USERNAME", help="Broker user name."),
]
Password = Annotated[
    str | None,
    typer.Option(
        "--password",
        # EDGETRAIN_MQTT_PASSWORD: its name before every option had a variable.
        envvar=["EDGETRAIN_PASSWORD", "EDGETRAIN_MQTT_PASSWORD"],
        help="Broker password.",
    ),
]
TlsCa = Annotated[
    Path | None,
    typer.Option("--tls-ca", envvar="EDGETRAIN_TLS_CA", help="CA bundle for mqtts://."),
]
LogLevel = Annotated[
    Literal["debug", "info", "warning", "error"],
    typer.Option(
        "--log-level",
        envvar="EDGETRAIN_LOG_LEVEL",
        case_sensitive=False,
        help="Log records of this level and above.",
    ),
]
Device = Annotated[
    str,
    typer.Option(
        "--device",
        envvar="EDGETRAIN_DEVICE",
        help="Where stages compute: cpu, cuda or cuda:N (a GPU server).",
    ),
]
PrecisionChoice = Annotated[
    Literal["fp32", "bf16"],
    typer.Option(
        "--precision",
        envvar="EDGETRAIN_PRECISION",
        help="With cuda: announce the fp32 or the bf16 (autocast) rate.",
    ),
]
Server = Annotated[
    bool,
    typer.Option(
        "--server",
        envvar="EDGETRAIN_SERVER",
        help="Server tier: may join torch.distributed groups (implied by cuda).",
    ),
]
AllowCode = Annotated[
    list[str] | None,
    typer.Option(
        "--allow-code",
        envvar="EDGETRAIN_ALLOW_CODE",
        metavar="MODULE_PREFIX",
        help=(
            "Also run user models and datasets (package.module:function) whose module is "
            "under this prefix (mypkg allows mypkg.models, not mypkgevil); repeatable. "
            "Without it the agent runs zoo models and built-in datasets only."
        ),
    ),
]
Data = Annotated[
    list[str] | None,
    typer.Option(
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
]
Insecure = Annotated[
    bool,
    typer.Option(
        "--insecure",
        envvar="EDGETRAIN_INSECURE",
        help=(
            "Connect without broker credentials, although anyone on that broker could "
            "then drive this agent (a testbed on a closed network)."
        ),
    ),
]
StoreHost = Annotated[
    list[str] | None,
    typer.Option(
        "--store-host",
        envvar="EDGETRAIN_STORE_HOST",
        metavar="ADDR",
        help="Server tier: also join groups whose rendezvous store is on ADDR (repeatable); "
        "by default only stores on the broker's host or loopback are joined.",
    ),
]


def agent_command(
    broker: Broker = None,
    credentials: Credentials = None,
    device_id: DeviceId = socket.gethostname(),
    profile: Profile = None,
    emulate: Emulate = None,
    data_dir: DataDir = Path.home() / ".edgetrain" / "agent",
    threads: Threads = None,
    heartbeat_s: HeartbeatS = 1.0,
    measure_seconds: MeasureSeconds = 1.0,
    measure_lock: MeasureLock = None,
    slowdown: Slowdown = 1.0,
    link_mbps: LinkMbps = None,
    link_latency_ms: LinkLatencyMs = 0.0,
    username: Username = None,
    password: Password = None,
    tls_ca: TlsCa = None,
    log_level: LogLevel = "info",
    device: Device = "cpu",
    precision: PrecisionChoice = "fp32",
    server: Server = False,
    allow_code: AllowCode = None,
    data: Data = None,
    insecure: Insecure = False,
    store_host: StoreHost = None,
) -> None:
    """Run the agent daemon: register this device and run the stages it is assigned.

    It connects with a last-will (offline, retained), publishes its profile and a
    heartbeat, runs assignments from its cmd topic, reports per-step timings on
    the job's events topic, and rides out the broker going away. Logs are JSON
    lines on standard error. SIGTERM stops it cleanly.

    Every option can also come from its environment variable, EDGETRAIN_ and the
    option's name (--device-id: EDGETRAIN_DEVICE_ID); a flag on the command line
    wins. A bad option stops the agent with one line before it connects. The agent
    imports no code it is sent, and without broker credentials it refuses to start
    unless given --insecure.
    """
    from edge.agent import Agent, AgentOptions, agent_login
    from edge.logs import setup_logging
    from edge.models.local_data import register
    from edge.models.user_code import allow_prefixes
    from edge.profiling.announcement import AnnounceOptions, resolve_announcement

    announcing = AnnounceOptions(  # each step checks its options before anything connects
        link_mbps=link_mbps,
        link_latency_ms=link_latency_ms,
        device=device,
        precision=precision,
        server=server,
        profile=profile,
        emulate=emulate,
        slowdown=slowdown,
        measure_seconds=measure_seconds,
        measure_lock=measure_lock,
    )
    login, device_id = agent_login(
        device_id,
        broker,
        credentials=credentials,
        username=username,
        password=password,
        tls_ca=tls_ca,
        insecure=insecure,
    )
    announcement = resolve_announcement(device_id, announcing)
    allowed = allow_prefixes(allow_code or [])
    options = AgentOptions(
        device_id=device_id,
        data_dir=data_dir,
        heartbeat_s=heartbeat_s,
        slowdown=slowdown,
        torch_device=device,
        allow_code=allowed,
        local_data=register(data or [], allowed),
        store_hosts=tuple(store_host or ()),
    )
    setup_logging(log_level, device=device_id)
    agent = Agent(announcement.shaped(login), options, announcement.measure)
    raise typer.Exit(agent.serve(threads))
