"""A docker-compose file for an emulated fleet: broker, coordinator, one agent per device.

This module owns the text of the compose file that ``edgetrain testbed compose``
prints and ``docker/compose.yaml`` ships. The numbers come from
:func:`coordinator.testbed.sizing.emulate`, so a container gets the same CPU share
(``cpus``) and memory limit (``mem_limit``, swap included) as the same device in
the local testbed. Each agent announces its catalogue profile (a DeviceSpec JSON
that the agent image's entry point hands to ``--profile``), and its link is
shaped to the profile's bandwidth with ``tc tbf`` (``cap_add: NET_ADMIN``) or,
without that capability, in software; latency is always added in software.

The broker is secure by default: TLS on port 8883 only, the dynamic-security
plugin's accounts, one per agent, and ACLs that the coordinator changes as its jobs'
plans say (``EDGETRAIN_BROKER_ACCOUNTS``): the coordinator creates the agents'
accounts in the broker as it starts, so agents wait for it to be healthy. Those
secrets are not in the file: it mounts, read-only, each service's part of a secrets
directory that :func:`coordinator.testbed.compose_secrets.write_secrets` writes
beside it (``./secrets`` by default), and each entry point copies its part for its
own user. The API listens on the container's every interface, so it needs a token:
``EDGETRAIN_API_TOKEN`` from the caller's environment, else the one in the secrets.

The file is compose format 2.4: the last format whose ``cpus`` and ``mem_limit``
both docker-compose v1 (what CI validates with) and Docker Compose v2 accept.
Rendering is deterministic: the same fleet gives the same bytes (the secrets, new
for each render, live only in the secrets directory).
"""

from __future__ import annotations

import json
import re
from typing import Any

import yaml

from coordinator.testbed.sizing import EmulatedDevice
from edge.errors import UserError
from edge.problem import DeviceSpec

__all__ = [
    "AGENT_IMAGE",
    "BROKER_IMAGE",
    "BROKER_PORT",
    "BROKER_SERVICE",
    "COORDINATOR_IMAGE",
    "DEFAULT_IMAGE_TAG",
    "DEFAULT_SECRETS",
    "HEALTH_USER",
    "INSTALLED",
    "MOUNTED",
    "agent_dir",
    "render_compose",
]

COMPOSE_VERSION = "2.4"
BROKER_IMAGE = "eclipse-mosquitto:2"
AGENT_IMAGE = "edgetrain/agent"
COORDINATOR_IMAGE = "edgetrain/coordinator"
DEFAULT_IMAGE_TAG = "latest"
"""Tag of the two edgetrain images (built from ``docker/Dockerfile``)."""
DEFAULT_SECRETS = "./secrets"
"""The secrets directory, as the file names it: beside the file."""

CPUS_DECIMALS = 4
"""``cpus`` is rounded to this many decimals: within 0.1% of the local testbed's quota."""

BROKER_SERVICE = "mosquitto"
BROKER_PORT = 8883
"""The broker's TLS listener, in its container."""
MOUNTED = "/run/secrets/edgetrain"
"""Where a service finds its part of the secrets (read-only, owned by whoever rendered them)."""
INSTALLED = "/run/edgetrain"
"""Where its entry point copies them for the user the service runs as."""
HEALTH_USER = "edgetrain-health"
"""The account of the broker's health check: it may read ``$SYS/broker/uptime``, no more."""
NETWORK = "fleet"
AGENT_DATA_DIR = "/var/lib/edgetrain/agent"
COORDINATOR_DATA_DIR = "/var/lib/edgetrain/coordinator"

# The broker's image runs as root and Mosquitto drops to its own user, which cannot read
# the mounted secrets (the renderer's, 0600): they are copied for it first.
BROKER_START = (
    f"test -f {MOUNTED}/mosquitto.conf || {{ echo 'no broker secrets in {MOUNTED}: "
    "make them with edgetrain testbed compose' >&2; exit 2; }; "
    f"rm -rf {INSTALLED} && mkdir -p {INSTALLED} && cp -R {MOUNTED}/. {INSTALLED}/ "
    f"&& chown -R mosquitto:mosquitto {INSTALLED} && chmod -R go= {INSTALLED} "
    f"&& exec mosquitto -c {INSTALLED}/mosquitto.conf"
)
# Healthy once the broker serves a TLS login: the health check's account may read
# $SYS/broker/uptime and nothing else ($$: a $ that compose leaves alone).
BROKER_HEALTH = (
    f"mosquitto_sub -h localhost -p {BROKER_PORT} --cafile {INSTALLED}/ca.pem "
    f'-u {HEALTH_USER} -P "$$(cat {INSTALLED}/health.password)" '
    "-t '$$SYS/broker/uptime' -C 1 -W 3"
)

# A compose service name (and container hostname): lowercase letters, digits, - _ .
_SERVICE_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")


def agent_dir(device: str) -> str:
    """``device``'s agent: its service, and its part of the secrets directory."""
    return f"agent-{device}"


def _service_name(device_id: str) -> str:
    name = agent_dir(device_id)
    if not _SERVICE_NAME.match(name):
        raise UserError(
            f"device {device_id!r}: not usable as a compose service name "
            "(lowercase letters, digits, '-', '_' and '.')"
        )
    return name


def _port(name: str, value: int) -> int:
    if not 1 <= value <= 65535:
        raise UserError(f"{name} must be between 1 and 65535 (got {value})")
    return value


def _build(context: str | None, target: str) -> dict[str, Any]:
    if context is None:
        return {}
    return {"build": {"context": context, "dockerfile": "docker/Dockerfile", "target": target}}


def _announced(e: EmulatedDevice) -> str:
    """The DeviceSpec the agent announces: the catalogue device under the agent's id."""
    spec = DeviceSpec(
        id=e.id,
        gflops=e.source.gflops,
        memory_bytes=e.memory_bytes,
        bandwidth_mbps=e.bandwidth_mbps,
        latency_ms=e.latency_ms,
        details={
            **(e.source.details or {}),
            "emulated_in": "docker",
            "cpus": round(e.cpus, CPUS_DECIMALS),
        },
    )
    return json.dumps(
        spec.model_dump(mode="json", exclude_none=True), sort_keys=True, separators=(",", ":")
    )


def _number(value: float) -> str:
    """A float for an environment variable: no trailing ``.0``, no exponent."""
    return f"{value:.6f}".rstrip("0").rstrip(".")


def _agent(e: EmulatedDevice, image: str, context: str | None, secrets: str) -> dict[str, Any]:
    return {
        "image": image,
        **_build(context, "agent"),
        "hostname": e.id,
        "command": [
            "--credentials",
            f"{INSTALLED}/credentials.json",
            "--device-id",
            e.id,
            "--threads",
            str(e.threads),
            "--data-dir",
            AGENT_DATA_DIR,
        ],
        "environment": {
            "EDGETRAIN_PROFILE_JSON": _announced(e),
            "EDGETRAIN_LINK_MBPS": _number(e.bandwidth_mbps),
            "EDGETRAIN_LINK_LATENCY_MS": _number(e.latency_ms),
        },
        "cpus": round(e.cpus, CPUS_DECIMALS),
        "mem_limit": e.memory_bytes,
        "memswap_limit": e.memory_bytes,  # no swap beyond the device's memory
        "cap_add": ["NET_ADMIN"],  # for tc in the entry point only; the agent drops it
        "volumes": [f"{secrets}/{agent_dir(e.id)}:{MOUNTED}:ro"],
        # The coordinator creates the agents' accounts in the broker as it starts.
        "depends_on": {
            BROKER_SERVICE: {"condition": "service_healthy"},
            "coordinator": {"condition": "service_healthy"},
        },
        "networks": [NETWORK],
        "restart": "unless-stopped",
    }


def _header(devices: list[EmulatedDevice], generated_by: str | None, secrets: str) -> str:
    lines = [
        "# An emulated fleet for Docker: a Mosquitto broker, the edgetrain coordinator and one",
        "# agent per device, each limited to its device's share of the host's CPUs and to its",
        "# memory, its link shaped to the device's bandwidth and latency.",
        f"# Generated by: {generated_by or 'coordinator.testbed.compose.render_compose'}",
        "# Do not edit by hand: generate it again. Broker and API listen on this host's",
        "# loopback only. The broker takes TLS logins only: an account per agent, rights",
        "# that follow the coordinator's plans. Their secrets are not in this file: the",
        f"# command that generates it writes them to {secrets}"
        + (" (relative to this file)," if not secrets.startswith("/") else ","),
        "# new each time; never commit them.",
        "#",
        "# device                     cpus   memory (MiB)   link",
    ]
    for e in devices:
        mib = e.memory_bytes / 2**20
        link = f"{_number(e.bandwidth_mbps)} Mbit/s, {_number(e.latency_ms)} ms"
        lines.append(f"#   {e.id:<24} {e.cpus:>6.4f} {mib:>14.0f}   {link}")
    return "\n".join(lines) + "\n"


def render_compose(
    devices: list[EmulatedDevice],
    *,
    image_tag: str = DEFAULT_IMAGE_TAG,
    broker_port: int = 8883,
    coordinator_port: int = 8000,
    build_context: str | None = None,
    generated_by: str | None = None,
    secrets: str = DEFAULT_SECRETS,
) -> str:
    """The compose file (YAML text) for ``devices``, as :func:`emulate` maps them.

    ``broker_port`` and ``coordinator_port`` are the host ports (on 127.0.0.1)
    that the broker and the API are published on. With ``build_context`` (the
    repository root, relative to the compose file) the edgetrain services build
    their images from ``docker/Dockerfile``; without it the images
    ``edgetrain/agent:TAG`` and ``edgetrain/coordinator:TAG`` must exist.
    ``generated_by`` is the command line named in the header comment. ``secrets`` is
    the secrets directory (:mod:`coordinator.testbed.compose_secrets`) as the file names
    it: relative to the file's directory, or absolute.
    Raises :class:`UserError` for an empty fleet, repeated device ids, an id that
    cannot name a service, a bad port or tag.
    """
    if not devices:
        raise UserError("--devices: no devices given")
    ids = [e.id for e in devices]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise UserError(f"device {repeated[0]!r} appears more than once in the fleet")
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}", image_tag):
        raise UserError(f"--image-tag {image_tag!r} is not a valid Docker tag")
    _port("--broker-port", broker_port)
    _port("--coordinator-port", coordinator_port)
    if broker_port == coordinator_port:
        raise UserError(f"the broker and the coordinator cannot share host port {broker_port}")
    if not secrets or any(c in secrets for c in ":$\n"):
        raise UserError(f"--secrets-dir {secrets!r}: a path without ':', '$' or line breaks")

    broker_url = f"mqtts://{BROKER_SERVICE}:{BROKER_PORT}"
    services: dict[str, Any] = {
        BROKER_SERVICE: {
            "image": BROKER_IMAGE,
            "command": ["sh", "-c", BROKER_START],
            "ports": [f"127.0.0.1:{broker_port}:{BROKER_PORT}"],
            "volumes": [f"{secrets}/broker:{MOUNTED}:ro"],
            "healthcheck": {
                "test": ["CMD-SHELL", BROKER_HEALTH],
                "interval": "2s",
                "timeout": "5s",
                "retries": 15,
            },
            "networks": [NETWORK],
            "restart": "unless-stopped",
        },
        "coordinator": {
            "image": f"{COORDINATOR_IMAGE}:{image_tag}",
            **_build(build_context, "coordinator"),
            "command": ["--host", "0.0.0.0", "--port", "8000", "--data-dir", COORDINATOR_DATA_DIR],
            "environment": {
                "EDGETRAIN_API_TOKEN": "${EDGETRAIN_API_TOKEN:-}",
                "EDGETRAIN_BROKER_URL": broker_url,
                "EDGETRAIN_BROKER_ACCOUNTS": INSTALLED,  # its part of the secrets
            },
            "ports": [f"127.0.0.1:{coordinator_port}:8000"],
            "volumes": [
                f"coordinator-data:{COORDINATOR_DATA_DIR}",
                f"{secrets}/coordinator:{MOUNTED}:ro",
            ],
            "depends_on": {BROKER_SERVICE: {"condition": "service_healthy"}},
            "networks": [NETWORK],
            "restart": "unless-stopped",
        },
    }
    agent_image = f"{AGENT_IMAGE}:{image_tag}"
    for e in devices:
        services[_service_name(e.id)] = _agent(e, agent_image, build_context, secrets)

    document = {
        "version": COMPOSE_VERSION,
        "services": services,
        "networks": {NETWORK: {"driver": "bridge"}},
        "volumes": {"coordinator-data": {}},
    }
    body = yaml.safe_dump(document, sort_keys=False, default_flow_style=False, width=2**16)
    return _header(devices, generated_by, secrets) + body
