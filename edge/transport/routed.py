"""A stage with neighbours on two wires: torch.distributed to some, another transport to the rest.

In a hybrid pipeline (edge devices run the first units, a server tier the
rest) a server stage next to an edge device receives that device's frames over
MQTT and talks to its fellow servers over c10d. :class:`RoutedTransport` gives
such a stage one :class:`~edge.transport.base.Transport`: one inbox, filled by
both wires, and each frame sent on the wire that reaches its destination (the
group's route says which stages are servers).

Tested in tests/integration/test_transport_conformance.py::TestRoutedTransportToAServer,
::TestRoutedTransportToAnEdgeDevice and
::test_a_routed_stage_takes_from_both_wires_and_sends_each_frame_on_its_own; whole
hybrid jobs in tests/e2e/test_hybrid.py.
"""

from __future__ import annotations

from edge.transport.base import Channel, Transport
from edge.transport.dist import DistTransport
from edge.transport.inbox import Inbox

__all__ = ["RoutedTransport"]


class RoutedTransport:
    """``dist`` for the stages in its route, ``other`` for every other stage."""

    def __init__(self, other: Transport, dist: DistTransport) -> None:
        self.other = other
        self.dist = dist
        self.name = f"{dist.name}+{other.name}"

    def attach(self, job: str, stage: int, member: int = 0, *, members: int = 1) -> Inbox:
        if member or members > 1:
            raise ValueError("a hybrid stage (MQTT and torch.distributed) runs on one device")
        inbox = self.other.attach(job, stage)
        try:
            self.dist.attach(job, stage, inbox=inbox)
        except BaseException:
            self.other.detach(job, stage)
            raise
        return inbox

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
        if stage in self.dist.route.ranks:
            self.dist.send(job, stage, channel, frame)
        else:
            self.other.send(job, stage, channel, frame, member, sender=sender)

    def detach(self, job: str, stage: int, member: int = 0) -> None:
        try:
            self.dist.detach(job, stage)
        finally:
            self.other.detach(job, stage)

    def close(self) -> None:
        """Close the dist side; ``other`` belongs to whoever made it (the agent)."""
        self.dist.close()
