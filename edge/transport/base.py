"""The one interface every tensor transport implements: :class:`Transport`, and its channels.

A transport moves encoded frames (:mod:`edge.wire.frames`) to a stage of a job
(to one member of a stage run by a group, [Note: groups on the wire] in
:mod:`edge.wire.groups`). A stage :meth:`Transport.attach`\\ es to get its
:class:`~edge.transport.inbox.Inbox`, then takes the frames it needs from it by key;
what an inbox keeps, and what it drops, is :mod:`edge.transport.inbox`'s.

Implementations: :mod:`edge.transport.inprocess`, :mod:`edge.transport.mqtt`,
:mod:`edge.transport.dist` and :mod:`edge.transport.routed`.

Tested in tests/integration/test_transport_conformance.py::TransportConformance, one
class that runs against every implementation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:  # the inbox files frames by channel: it imports this module
    from edge.transport.inbox import Inbox

__all__ = ["Channel", "Transport"]

Channel = Literal["fwd", "bwd", "reduce", "gather"]
"""What a frame travels on: ``fwd`` (activations, labels), ``bwd`` (gradients), and a
group's ``reduce`` and ``gather`` (its gradient chunks, [Note: groups on the wire] in
:mod:`edge.wire.groups`)."""


@runtime_checkable
class Transport(Protocol):
    """Moves frames between the stages of jobs (implementations: see the module)."""

    name: str

    def attach(self, job: str, stage: int, member: int = 0, *, members: int = 1) -> Inbox:
        """Start receiving frames for ``member`` of ``stage`` of ``job``; returns its inbox.

        ``members``: the stage's group size; above 1, also its ``reduce`` and ``gather``
        channels, from each other member."""
        ...

    def detach(self, job: str, stage: int, member: int = 0) -> None:
        """Stop receiving for ``member`` of ``stage`` of ``job`` and close its inbox."""
        ...

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
        """Deliver an encoded frame to ``member`` of ``stage`` of ``job`` on ``channel``;
        on ``reduce``, from member ``sender`` of the same stage (its own topic). On
        ``gather`` the frame goes, sent once, to every member of the stage but
        ``sender`` (``member`` is not used)."""
        ...

    def close(self) -> None:
        """Release everything; inboxes are closed."""
        ...
