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
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch.distributed as dist

from edge.transport.base import Transport
from edge.transport.dist import DistTransport, Route
from edge.transport.routed import RoutedTransport
from edge.wire.messages import StageAssignment

__all__ = ["join_group", "leave_group"]

log = logging.getLogger(__name__)

LEAVE_TIMEOUT_S = 15.0
"""How long leaving waits for the other ranks to end their streams (a stage that
was cancelled may never send its end)."""


def join_group(a: StageAssignment, other: Transport) -> RoutedTransport:
    """Join ``a.dist``'s process group as ``a``'s rank; the stage's transport."""
    g = a.dist
    if g is None:
        raise ValueError(f"job {a.job} stage {a.stage} has no dist group")
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
