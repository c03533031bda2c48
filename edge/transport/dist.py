"""Frames between stages on servers, over torch.distributed point-to-point.

This module owns :class:`DistTransport`, the :class:`~edge.transport.base.Transport`
of the server tier: the stages of one pipeline replica are ranks of one
torch.distributed job, and a frame to another stage is a ``send`` to that
stage's rank. It carries exactly the frames (:mod:`edge.wire.frames`) the MQTT and
in-process transports carry, so a stage runs the same code, the same schedule
actions and gets the same bits whatever the wire.

Each frame is two messages on one ``(source, destination, tag)`` stream: its
length as one int64, then its bytes as uint8. The tag is the channel (``fwd``
0, ``bwd`` 1), and c10d keeps each stream in order. On :meth:`~DistTransport.attach`
one receiver thread per incoming stream (the previous stage's ``fwd``, stage
0's labels on the last stage, the next stage's ``bwd``) posts receives and files
frames in the stage's inbox; a zero length ends a stream, and
:meth:`~DistTransport.detach` sends one to every outgoing stream, so every
receiver stops once both sides are done.

A stage may run on a group ([Note: groups on the wire] in :mod:`edge.wire.groups`):
each member is a rank, and a stream joins every member of one stage to every
member of its neighbour (a pair whose rows do not meet carries only its end).
The group's gradient sum is not a frame here: it is one bucketed all-reduce
over the members' process group (:class:`edge.server.data_parallel.DataParallel`),
so the ``reduce`` channel carries nothing on this transport.

[Note: why not torch.distributed.pipelining]
``torch.distributed.pipelining`` runs its own schedules over ``PipelineStage``
objects, with one loss function on the last stage and its own microbatch
splitting. edgetrain's plans, 1F1B and GPipe action lists, loss scaling
([Note: loss scaling] in :mod:`edge.runtime.stage`), codecs, step reports and
state blobs are those of :class:`~edge.runtime.stage.StageRuntime`; running
that executor over c10d keeps one schedule implementation and makes a
server-tier run bit-comparable with an MQTT run and able to move between tiers
(same checkpoints). What the server tier needs from c10d is point-to-point
transfer, which this module provides, and the gradient all-reduce of data
parallelism (:mod:`edge.server.data_parallel`).

[Note: host frames]
Frames are host bytes (the wire format every transport shares), so they travel
on a gloo group even when the stages compute on GPUs; the data-parallel
gradient all-reduce, the heavy collective, uses NCCL there. Receiving in
threads while the stage sends from its own is safe with gloo, whose
point-to-point operations are independent per call; NCCL orders operations per
communicator, and threads on two ranks would post them in different orders.

Tested in tests/unit/edge/transport/test_dist_transport.py (each stage's streams),
tests/integration/test_dist_transport_ranks.py (refusals; frames between two spawned
ranks) and tests/integration/test_transport_conformance.py::TestDistTransport.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from edge.transport.base import Channel
from edge.transport.inbox import Inbox

__all__ = ["DistTransport", "Route"]

log = logging.getLogger(__name__)

_TAGS: dict[Channel, int] = {"fwd": 0, "bwd": 1}


@dataclass(frozen=True)
class Route:
    """Where the stages of one pipeline replica run: stage ``s`` is rank ``ranks[s]``, or,
    on a group, the ranks ``ranks[s]`` of its members in member order.

    A stage missing from ``ranks`` is not in this torch.distributed job (in a
    hybrid pipeline it is an edge device reached over MQTT).
    """

    num_stages: int
    ranks: Mapping[int, int | tuple[int, ...]]
    members: dict[int, tuple[int, ...]] = field(init=False, repr=False)
    """Stage -> its members' ranks (one for a stage on one device)."""

    def __post_init__(self) -> None:
        members = {s: (r,) if isinstance(r, int) else tuple(r) for s, r in self.ranks.items()}
        if any(not m for m in members.values()):
            raise ValueError(f"a stage without ranks in {dict(self.ranks)}")
        object.__setattr__(self, "members", members)

    def incoming(self, stage: int) -> list[tuple[int, Channel]]:
        """The ``(source stage, channel)`` streams ``stage`` receives, within this job."""
        last = self.num_stages - 1
        streams: list[tuple[int, Channel]] = []
        if stage > 0:
            streams.append((stage - 1, "fwd"))
        if stage == last and stage > 1:
            streams.append((0, "fwd"))  # stage 0 sends the labels straight to the last
        if stage < last:
            streams.append((stage + 1, "bwd"))
        return [(s, c) for s, c in streams if s in self.ranks]

    def outgoing(self, stage: int) -> list[tuple[int, Channel]]:
        """The ``(destination stage, channel)`` streams ``stage`` sends on, within this job."""
        last = self.num_stages - 1
        streams: list[tuple[int, Channel]] = []
        if stage < last:
            streams.append((stage + 1, "fwd"))
        if stage == 0 and last > 1:
            streams.append((last, "fwd"))
        if stage > 0:
            streams.append((stage - 1, "bwd"))
        return [(s, c) for s, c in streams if s in self.ranks]


class DistTransport:
    """Sends frames to other ranks of an initialised torch.distributed job (see the module)."""

    name = "dist"

    def __init__(
        self, route: Route, group: dist.ProcessGroup | None = None, join_timeout_s: float = 120.0
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised")
        self.route = route
        self.group = group
        self.join_timeout_s = join_timeout_s
        """How long :meth:`detach` waits for the peers to end their streams."""
        self.rank = dist.get_rank()
        self._lock = threading.Lock()
        self._attached: dict[tuple[str, int], tuple[Inbox, list[threading.Thread]]] = {}
        self.frames_sent = 0
        self.bytes_sent = 0

    def attach(
        self,
        job: str,
        stage: int,
        member: int = 0,
        *,
        members: int = 1,
        inbox: Inbox | None = None,
    ) -> Inbox:
        """Start receiving for ``member`` of ``stage`` of ``job`` (into ``inbox`` if given:
        hybrid routes). A group (``members`` above 1) needs no channel here: it sums its
        gradients with a collective (see the module)."""
        ranks = self.route.members.get(stage, ())
        if member >= len(ranks) or ranks[member] != self.rank:
            raise ValueError(f"stage {stage} member {member} does not run on rank {self.rank}")
        with self._lock:
            if (job, stage) in self._attached:
                raise ValueError(f"job {job} stage {stage} is already attached")
            box = inbox or Inbox(job, stage, member)
            threads = [
                threading.Thread(
                    target=self._receive,
                    args=(box, src_rank, channel),
                    name=f"dist-recv-{src}.{m}-{channel}",
                    daemon=True,
                )
                for src, channel in self.route.incoming(stage)
                for m, src_rank in enumerate(self.route.members[src])
            ]
            self._attached[(job, stage)] = (box, threads)
        for t in threads:
            t.start()
        return box

    def _receive(self, inbox: Inbox, src: int, channel: Channel) -> None:
        tag = _TAGS[channel]
        size = torch.empty(1, dtype=torch.int64)
        try:
            while True:
                dist.recv(size, src, group=self.group, tag=tag)
                n = int(size.item())
                if n <= 0:
                    return
                buf = torch.empty(n, dtype=torch.uint8)
                dist.recv(buf, src, group=self.group, tag=tag)
                inbox.deliver(buf.numpy().data, channel)
        except RuntimeError as exc:  # the process group went away under us
            log.warning("receiving from rank %d (%s) stopped: %s", src, channel, exc)
            inbox.close()

    def send(
        self,
        job: str,
        stage: int,
        channel: Channel,
        frame: bytes,
        member: int = 0,
        *,
        sender: int | None = None,
    ) -> None:
        """Send ``frame`` to the rank of ``member`` of ``stage`` (blocks until it is on its way).
        No ``reduce`` channel here, so no ``sender`` either (see the module)."""
        ranks = self.route.members.get(stage, ())
        if member >= len(ranks):
            raise ValueError(f"stage {stage} member {member} is not in this torch.distributed job")
        if channel not in _TAGS or sender is not None:
            raise ValueError(
                f"no {channel!r} channel over torch.distributed (see edge.transport.dist)"
            )
        dst, tag = ranks[member], _TAGS[channel]
        with warnings.catch_warnings():  # read-only bytes: torch only reads them here
            warnings.simplefilter("ignore", UserWarning)
            payload = torch.frombuffer(frame, dtype=torch.uint8)
        dist.send(torch.tensor([len(frame)], dtype=torch.int64), dst, group=self.group, tag=tag)
        dist.send(payload, dst, group=self.group, tag=tag)
        with self._lock:
            self.frames_sent += 1
            self.bytes_sent += len(frame)

    def detach(self, job: str, stage: int, member: int = 0) -> None:
        """End this stage's outgoing streams, wait for its incoming ones to end, close it."""
        with self._lock:
            entry = self._attached.pop((job, stage), None)
        if entry is None:
            return
        inbox, threads = entry
        end = torch.zeros(1, dtype=torch.int64)
        for dst, channel in self.route.outgoing(stage):
            for rank in self.route.members[dst]:
                dist.send(end, rank, group=self.group, tag=_TAGS[channel])
        for t in threads:
            t.join(self.join_timeout_s)
            if t.is_alive():
                log.warning(
                    "job %s stage %d: %s did not end within %.0f s",
                    job,
                    stage,
                    t.name,
                    self.join_timeout_s,
                )
        inbox.close()

    def close(self) -> None:
        """Detach every stage still attached."""
        for job, stage in list(self._attached):
            self.detach(job, stage)
