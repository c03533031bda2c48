"""Joining and leaving the torch.distributed group of one job, from an agent.

An agent whose assignment carries a :class:`~edge.wire.messages.DistGroup` joins
that job's process group before it reports ready: it connects to the
rendezvous store the coordinator hosts (under a prefix of the job's id, so one
store can serve several jobs), initialises the default process group as its
rank, and wraps its MQTT transport in a
:class:`~edge.transport.routed.RoutedTransport`. Joining blocks until every
rank has joined, at most ``timeout_s``. After the stage ends the agent leaves
(:func:`leave_group`), and the next job may join another group.

torch.distributed keeps one default group per process, so an agent is in at
most one such group at a time; agents run one stage at a time anyway.

An agent connects only to a store on an address it accepts
(:func:`accepts_store_host`): loopback, its broker's host, and the addresses its
owner added (``edgetrain agent --store-host``). An assignment naming any other
is refused before anything connects (:class:`StoreRefused`), so whoever can
publish an assignment cannot point the agent's c10d connections at an address
of their choice.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Collection
from datetime import timedelta

import torch.distributed as dist

from edge.transport.base import Transport
from edge.transport.dist import DistTransport, Route
from edge.transport.routed import RoutedTransport
from edge.wire.messages import StageAssignment

__all__ = ["StoreRefused", "accepts_store_host", "join_group", "leave_group"]

log = logging.getLogger(__name__)

LEAVE_TIMEOUT_S = 15.0
"""How long leaving waits for the other ranks to end their streams (a stage that
was cancelled may never send its end)."""


class StoreRefused(ValueError):
    """An assignment named a rendezvous store on an address this agent does not accept."""


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | str:
    """``host`` as an IP address when it is one (an IPv4-mapped IPv6 one as its IPv4),
    else as a lower-case name without a trailing dot."""
    bare = host.strip().removeprefix("[").removesuffix("]")
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError:
        return bare.lower().rstrip(".")
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def accepts_store_host(host: str, accepted: Collection[str]) -> bool:
    """Whether an agent may connect to a rendezvous store on ``host``: a loopback address
    (``127.0.0.0/8``, ``::1``, ``localhost``) or one of ``accepted`` (the broker's host
    and ``--store-host`` addresses). Addresses compare as addresses (``::1`` is
    ``0:0:0:0:0:0:0:1``), names as lower-case text; nothing is resolved, so a store
    named by address is accepted only when that address is listed."""
    wanted = _address(host)
    if wanted == "localhost" or (not isinstance(wanted, str) and wanted.is_loopback):
        return True
    return any(_address(a) == wanted for a in accepted)


def join_group(
    a: StageAssignment, other: Transport, accepted: Collection[str] = ()
) -> RoutedTransport:
    """Join ``a.dist``'s process group as ``a``'s rank; the stage's transport. A store on an
    address that :func:`accepts_store_host` refuses, given ``accepted``, is a
    :class:`StoreRefused`, before anything connects."""
    g = a.dist
    if g is None:
        raise ValueError(f"job {a.job} stage {a.stage} has no dist group")
    if not accepts_store_host(g.store_host, accepted):
        allowed = ", ".join(["loopback", *accepted])
        raise StoreRefused(
            f"job {a.job} stage {a.stage}: refused the rendezvous store at "
            f"{g.store_host}:{g.store_port}: this agent accepts stores on {allowed} "
            "(add an address with edgetrain agent --store-host)"
        )
    if dist.is_initialized():  # a stale group from a job that did not end cleanly
        dist.destroy_process_group()
    timeout = timedelta(seconds=g.timeout_s)
    store = dist.TCPStore(g.store_host, g.store_port, is_master=False, timeout=timeout)
    backend = "cpu:gloo,cuda:nccl" if g.backend == "nccl" else "gloo"
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(a.job, store),
        rank=g.ranks[a.stage],
        world_size=g.world_size,
        timeout=timeout,
    )
    log.info(
        "joined the process group of job %s as rank %d of %d (%s)",
        a.job,
        g.ranks[a.stage],
        g.world_size,
        backend,
        extra={"job": a.job},
    )
    route = Route(a.num_stages, dict(g.ranks))
    return RoutedTransport(other, DistTransport(route, join_timeout_s=LEAVE_TIMEOUT_S))


def leave_group() -> None:
    """Leave the process group (a no-op outside one)."""
    if dist.is_initialized():
        dist.destroy_process_group()
