"""Network namespaces, veth pairs and ``tc tbf`` shaping for the kernel method.

Each agent gets a namespace ``et-<tb>-<i>`` (``<tb>``: the testbed id) joined to
the root namespace by a veth pair: ``et<tb>h<i>`` stays in the root namespace
with ``10.X.Y.(4i+1)/30``, ``et<tb>a<i>`` moves into the agent's namespace with
``10.X.Y.(4i+2)/30`` (names stay within IFNAMSIZ, 15 characters). ``10.X.Y``
is a /24 that no interface of this machine uses.

Bandwidth: a ``tbf`` qdisc on both ends, at the device's rate: the host end's
egress is the agent's download, the agent end's egress its upload.
[Note: tbf burst and limit] The bucket (``burst``) must hold at least what
arrives between two dequeues; too small a bucket cripples throughput at high
rates (and one smaller than a packet stalls the queue), too big a one lets a
slow link run at line rate for a long burst. It is 4 ms worth of the rate, at
least 16 KiB (ten full frames). The queue (``limit``) holds 50 ms worth of the
rate (at least 64 KiB) on top of the burst: TCP senders here are local, so
TCP Small Queues push back before it overflows, and a long queue would only add
delay the profile does not have.

Removal deletes the namespace, which deletes the veth pair with it; a host end
left behind (a half-made pair) is deleted by name.

Tested in tests/unit/coordinator/testbed/test_testbed_limits.py (the ``tbf`` burst and
limit, link names within IFNAMSIZ) and, as root, a real shaped namespace in
tests/integration/test_profile_broker.py.
"""

from __future__ import annotations

import ipaddress
import random
import subprocess
from dataclasses import dataclass

__all__ = [
    "Link",
    "NetnsError",
    "delete_link",
    "delete_namespace",
    "free_subnet",
    "link_names",
    "list_links",
    "list_namespaces",
    "make_link",
    "tbf_args",
]

MIN_BURST = 16 * 1024
MIN_LIMIT = 64 * 1024
BURST_S = 0.004
QUEUE_S = 0.050


class NetnsError(RuntimeError):
    """An ``ip`` or ``tc`` command failed; the message holds the command and its output."""


@dataclass(frozen=True)
class Link:
    """One agent's namespace and veth pair."""

    namespace: str
    host_if: str
    agent_if: str
    host_ip: str
    agent_ip: str


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=15)
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)}: {(proc.stderr or proc.stdout).strip()}")
    return proc


def link_names(testbed: str, index: int, subnet: str) -> Link:
    """The names and addresses of agent ``index``'s link in ``subnet`` (``10.X.Y``)."""
    base = int(ipaddress.IPv4Address(f"{subnet}.0")) + 4 * index
    if index < 0 or index >= 64:
        raise ValueError(f"agent index {index}: a testbed has at most 64 agents")
    return Link(
        namespace=f"et-{testbed}-{index}",
        host_if=f"et{testbed}h{index}",
        agent_if=f"et{testbed}a{index}",
        host_ip=str(ipaddress.IPv4Address(base + 1)),
        agent_ip=str(ipaddress.IPv4Address(base + 2)),
    )


def tbf_args(mbps: float) -> list[str]:
    """``tbf`` parameters for ``mbps`` Mbit/s (see [Note: tbf burst and limit])."""
    rate_bytes = mbps * 1e6 / 8
    burst = max(MIN_BURST, int(rate_bytes * BURST_S))
    limit = burst + max(MIN_LIMIT, int(rate_bytes * QUEUE_S))
    rate_kbit = max(8, round(mbps * 1000))
    return ["tbf", "rate", f"{rate_kbit}kbit", "burst", str(burst), "limit", str(limit)]


def free_subnet(seed: str) -> str:
    """A ``10.X.Y`` /24 that no address of this machine is in (``X`` in 200-249)."""
    out = _run(["ip", "-4", "-o", "addr", "show"]).stdout
    used = set()
    for line in out.splitlines():
        words = line.split()
        if "inet" in words:
            addr = words[words.index("inet") + 1].split("/")[0]
            used.add(addr.rsplit(".", 1)[0])
    rng = random.Random(seed)
    for _ in range(1000):
        subnet = f"10.{rng.randrange(200, 250)}.{rng.randrange(256)}"
        if subnet not in used:
            return subnet
    raise NetnsError("no free 10.X.Y.0/24 subnet for the testbed's links")


def make_link(link: Link, mbps: float) -> None:
    """Create ``link``'s namespace and veth pair, address both ends, shape both with tbf."""
    ns = ["ip", "netns", "exec", link.namespace]
    _run(["ip", "netns", "add", link.namespace])
    _run([*ns, "ip", "link", "set", "lo", "up"])
    _run(["ip", "link", "add", link.host_if, "type", "veth", "peer", "name", link.agent_if])
    _run(["ip", "link", "set", link.agent_if, "netns", link.namespace])
    _run(["ip", "addr", "add", f"{link.host_ip}/30", "dev", link.host_if])
    _run(["ip", "link", "set", link.host_if, "up"])
    _run([*ns, "ip", "addr", "add", f"{link.agent_ip}/30", "dev", link.agent_if])
    _run([*ns, "ip", "link", "set", link.agent_if, "up"])
    _run(["tc", "qdisc", "add", "dev", link.host_if, "root", *tbf_args(mbps)])
    _run([*ns, "tc", "qdisc", "add", "dev", link.agent_if, "root", *tbf_args(mbps)])


def list_namespaces() -> list[str]:
    """Names from ``ip netns list`` (its lines may carry ``(id: N)``)."""
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def list_links() -> list[str]:
    """Interface names in the root namespace (``ip -o link``, without ``@peer``)."""
    out = _run(["ip", "-o", "link", "show"], check=False).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names


def delete_namespace(name: str) -> bool:
    """Delete namespace ``name``; whether it existed."""
    if name not in list_namespaces():
        return False
    proc = _run(["ip", "netns", "delete", name], check=False)
    if proc.returncode != 0 and name in list_namespaces():
        raise NetnsError(f"ip netns delete {name}: {proc.stderr.strip()}")
    return True


def delete_link(name: str) -> bool:
    """Delete interface ``name`` in the root namespace (and its veth peer); whether it existed."""
    if name not in list_links():
        return False
    # Deleting a namespace deletes its veth pair a moment later: it may be gone by now.
    proc = _run(["ip", "link", "delete", name], check=False)
    if proc.returncode != 0 and name in list_links():
        raise NetnsError(f"ip link delete {name}: {proc.stderr.strip()}")
    return True
