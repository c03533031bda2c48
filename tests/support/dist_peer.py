"""A torch.distributed neighbour in another process, for the tests of one dist stage.

A stage of :class:`~edge.transport.dist.DistTransport` cannot be tested alone: a
frame is a ``send`` that completes only once the destination rank receives it,
and :meth:`~edge.transport.dist.DistTransport.detach` ends the stage's streams
and waits for its neighbours to end theirs (see edge.transport.dist). torch.distributed
keeps one rank per process, so the neighbour is another process.

:func:`dist_peer` spawns that process as rank 0 of a two-rank gloo world whose
rank 1 is the test's own process, for as long as the ``with`` block lasts (a
module fixture: the start costs about a second). :meth:`DistPeer.neighbour` gives,
per test, a real :class:`~edge.transport.dist.DistTransport` there, driven from
here through a :class:`Neighbour`, which is itself a
:class:`~edge.transport.base.Transport`.

[Note: the neighbour follows]
In a pipeline every stage of a job attaches before any frame moves and detaches
at its end; a test of one stage attaches, detaches and attaches again at will.
So the neighbour stage follows the test's stage, in rounds: it is attached from
the start, and when the test's stage ends its stream to it (a detach), it
detaches too (ending its own streams, which the test's detach waits for) and
attaches again for the next round. :meth:`Neighbour.attach` of the followed
stage hands over its inbox (that of the current round) rather than attaching it
a second time. :meth:`Neighbour.finish` ends the last round: the test's stage
attaches if it is not, the neighbour is told that the round now running or the
next one is its last, and the test's stage detaches. Every stream then has been
read up to its end, so the next test starts on clean streams of the same world.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from edge.transport.base import Channel
from edge.transport.dist import DistTransport, Route
from edge.transport.inbox import Inbox
from edge.wire.frames import Frame, Kind
from support.ranks import gloo_world

__all__ = ["DistPeer", "Neighbour", "RemoteInbox", "dist_peer"]

PEER_RANK, OWN_RANK = 0, 1
TIMEOUT_S = 30.0
"""The world's timeout, and how long a round may take to end."""


# -- in the peer's process ---------------------------------------------------------------


class _Follower:
    """Keeps ``stage`` of ``job`` attached in rounds (see [Note: the neighbour follows])."""

    def __init__(self, transport: DistTransport, job: str, stage: int) -> None:
        self.transport, self.job, self.stage = transport, job, stage
        self._cond = threading.Condition()
        self._inbox: Inbox | None = None
        self._last = False
        self._thread = threading.Thread(target=self._run, name="neighbour", daemon=True)
        self._thread.start()

    def inbox(self) -> Inbox:
        """The inbox of the round now running (between rounds: waits for the next)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._inbox is not None, TIMEOUT_S):
                raise TimeoutError("the neighbour stage did not attach")
            assert self._inbox is not None
            return self._inbox

    def _run(self) -> None:
        key = (self.job, self.stage)
        while True:
            with self._cond:
                self._inbox = self.transport.attach(self.job, self.stage)
                self._cond.notify_all()
            # White-box: the receivers end when the test's stage ends its streams to us.
            receivers = self.transport._attached[key][1]
            assert receivers, f"stage {self.stage} receives nothing: it would not follow"
            for t in receivers:
                t.join()
            with self._cond:
                last, self._inbox = self._last, None
            self.transport.detach(self.job, self.stage)
            if last:
                return

    def finish(self) -> None:
        """The round now running, or the next one if none is, is the last."""
        with self._cond:
            self._last = True

    def join(self) -> None:
        self._thread.join(TIMEOUT_S)
        if self._thread.is_alive():
            raise TimeoutError(f"the neighbour's last round did not end within {TIMEOUT_S} s")


class _Server:
    """What the peer does for :class:`Neighbour`: one transport and its follower per test."""

    def __init__(self) -> None:
        self.transport: DistTransport | None = None
        self.follower: _Follower | None = None
        self.inboxes: dict[tuple[str, int, int], Inbox] = {}

    def neighbour(self, stages: int, ranks: Mapping[int, int], job: str, stage: int) -> str:
        self.transport = DistTransport(Route(stages, ranks), join_timeout_s=TIMEOUT_S)
        self.follower = _Follower(self.transport, job, stage)
        self.inboxes = {}
        self.follower.inbox()  # attached before the test may send to it
        return self.transport.name

    def _inbox(self, job: str, stage: int, member: int) -> Inbox:
        f = self.follower
        if f is not None and (job, stage, member) == (f.job, f.stage, 0):
            return f.inbox()
        return self.inboxes[(job, stage, member)]

    def attach(self, job: str, stage: int, member: int, members: int) -> None:
        f = self.follower
        if f is not None and (job, stage, member) == (f.job, f.stage, 0):
            return  # the followed stage: already attached
        assert self.transport is not None
        self.inboxes[(job, stage, member)] = self.transport.attach(
            job, stage, member, members=members
        )

    def detach(self, job: str, stage: int, member: int) -> None:
        assert self.transport is not None
        self.transport.detach(job, stage, member)

    def send(self, *args: Any, sender: int | None) -> None:
        assert self.transport is not None
        self.transport.send(*args, sender=sender)

    def take(self, job: str, stage: int, member: int, *args: Any, first: int) -> Frame:
        frame = self._inbox(job, stage, member).take(*args, first=first)
        # Its own storage, not a view of the received buffer, to travel back.
        return dataclasses.replace(frame, tensor=frame.tensor.clone())

    def look(self, job: str, stage: int, member: int, name: str) -> Any:
        value = getattr(self._inbox(job, stage, member), name)
        return dict(value) if name == "dropped" else value

    def counters(self) -> tuple[int, int]:
        assert self.transport is not None
        return self.transport.frames_sent, self.transport.bytes_sent

    def finish(self) -> None:
        assert self.follower is not None
        self.follower.finish()

    def join(self) -> None:
        assert self.follower is not None and self.transport is not None
        self.follower.join()
        self.transport.close()
        self.transport = self.follower = None


def _serve(rank: int, conn: Connection, store_path: str) -> None:
    """The peer's process: answer each ``(method, args, kwargs)`` with ``(ok, result)``."""
    server = _Server()
    with gloo_world(rank, 2, store_path):
        while True:
            method, args, kwargs = conn.recv()
            if method == "stop":
                conn.send((True, None))
                return
            try:
                conn.send((True, getattr(server, method)(*args, **kwargs)))
            except Exception as exc:  # the test's process raises it
                conn.send((False, exc))


# -- in the test's process ----------------------------------------------------------------


class _Line:
    """The pipe to the peer: one call at a time, its exception raised here."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self._conn.send((method, args, kwargs))
            ok, result = self._conn.recv()
        if not ok:
            raise result
        return result


class RemoteInbox:
    """The inbox of a stage the peer runs: what the tests read of one."""

    def __init__(self, line: _Line, job: str, stage: int, member: int) -> None:
        self._line, self._where = line, (job, stage, member)

    def take(
        self,
        kind: Kind,
        step: int,
        microbatch: int,
        timeout: float | None = None,
        *,
        first: int = 0,
    ) -> Frame:
        frame: Frame = self._line.call(
            "take", *self._where, kind, step, microbatch, timeout, first=first
        )
        return frame

    @property
    def pending(self) -> int:
        return int(self._line.call("look", *self._where, "pending"))

    @property
    def closed(self) -> bool:
        return bool(self._line.call("look", *self._where, "closed"))

    @property
    def frames_received(self) -> int:
        return int(self._line.call("look", *self._where, "frames_received"))

    @property
    def dropped(self) -> dict[str, int]:
        return dict(self._line.call("look", *self._where, "dropped"))


class Neighbour:
    """A :class:`~edge.transport.dist.DistTransport` in the peer's process, driven from here;
    one stage of it follows a stage of this process ([Note: the neighbour follows])."""

    def __init__(self, line: _Line, name: str) -> None:
        self._line = line
        self.name = name

    def attach(self, job: str, stage: int, member: int = 0, *, members: int = 1) -> RemoteInbox:
        """The stage's :class:`RemoteInbox` (the followed stage: its current round's)."""
        self._line.call("attach", job, stage, member, members)
        return RemoteInbox(self._line, job, stage, member)

    def detach(self, job: str, stage: int, member: int = 0) -> None:
        self._line.call("detach", job, stage, member)

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
        self._line.call("send", job, stage, channel, bytes(frame), member, sender=sender)

    def close(self) -> None:
        """Nothing here: :meth:`finish` ends the neighbour."""

    @property
    def frames_sent(self) -> int:
        return int(self._line.call("counters")[0])

    @property
    def bytes_sent(self) -> int:
        return int(self._line.call("counters")[1])

    def finish(self, own: DistTransport, job: str, stage: int) -> None:
        """End the last round with ``stage`` of ``job`` on ``own`` (this process's transport,
        closed by it) and the neighbour's transport: see [Note: the neighbour follows]."""
        with contextlib.suppress(ValueError):  # already attached
            own.attach(job, stage)
        self._line.call("finish")
        own.close()
        self._line.call("join")


class DistPeer:
    """The peer process of :func:`dist_peer`."""

    def __init__(self, line: _Line) -> None:
        self._line = line

    def neighbour(self, route: Route, job: str, stage: int) -> Neighbour:
        """A fresh transport in the peer on ``route`` (the peer is rank 0, this process
        rank 1), its ``stage`` of ``job`` following this process's stage."""
        ranks = {s: r for s, r in route.ranks.items() if isinstance(r, int)}
        assert len(ranks) == len(route.ranks), "one rank per stage: no groups here"
        name = self._line.call("neighbour", route.num_stages, ranks, job, stage)
        return Neighbour(self._line, name)


@contextmanager
def dist_peer(store_path: str) -> Iterator[DistPeer]:
    """A two-rank gloo world, this process as rank 1 and a spawned peer as rank 0, for the
    block; torch.distributed's default group here meanwhile."""
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    peer = ctx.Process(target=_serve, args=(PEER_RANK, there, store_path), daemon=True)
    peer.start()
    try:
        store = dist.FileStore(store_path, 2)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=OWN_RANK,
            world_size=2,
            timeout=timedelta(seconds=TIMEOUT_S),
        )
        try:
            line = _Line(here)
            yield DistPeer(line)
            line.call("stop")
        finally:
            dist.destroy_process_group()
    finally:
        peer.join(10)
        if peer.is_alive():
            peer.kill()
            peer.join(10)
