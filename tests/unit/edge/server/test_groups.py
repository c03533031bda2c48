"""Which rendezvous stores an agent joins: loopback, its broker's host, its --store-host ones.

A refused store is refused before anything connects: ``join_group`` raises before it
makes a ``TCPStore`` or touches torch.distributed (tests/integration/test_server_group.py
joins a real store; tests/e2e/test_agent.py has an agent refuse one).
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from coordinator.engine.assignments import make_assignments
from coordinator.engine.spec import JobSpec
from coordinator.planner import Plan
from edge.server.groups import StoreRefused, accepts_store_host, join_group
from edge.transport.inprocess import InProcessTransport
from edge.wire.messages import DistGroup

BROKER = ("broker.lan",)


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        "127.8.9.10",
        "::1",
        "[::1]",
        "0:0:0:0:0:0:0:1",
        "localhost",
        "LocalHost",
        "::ffff:127.0.0.1",
    ],
)
def test_loopback_is_always_accepted(host: str) -> None:
    assert accepts_store_host(host, ())


@pytest.mark.parametrize(
    ("host", "accepted"),
    [
        ("broker.lan", BROKER),
        ("Broker.LAN.", BROKER),  # names compare without case or the root's dot
        ("10.0.0.5", ("broker.lan", "10.0.0.5")),
        ("fd00::5", ("fd00:0:0:0:0:0:0:5",)),  # addresses compare as addresses
        ("::ffff:10.0.0.5", ("10.0.0.5",)),
    ],
)
def test_the_brokers_host_and_listed_addresses_are_accepted(
    host: str, accepted: tuple[str, ...]
) -> None:
    assert accepts_store_host(host, accepted)


@pytest.mark.parametrize(
    ("host", "accepted"),
    [
        ("10.0.0.6", ("broker.lan", "10.0.0.5")),
        ("evil.example", BROKER),
        ("broker.lan.evil.example", BROKER),
        ("0.0.0.0", BROKER),  # unspecified is not loopback
        ("10.0.0.5", ("broker.lan",)),  # nothing is resolved: an address must be listed
        ("localhost.evil.example", ()),
    ],
)
def test_any_other_host_is_refused(host: str, accepted: tuple[str, ...]) -> None:
    assert not accepts_store_host(host, accepted)


def test_join_group_refuses_before_connecting() -> None:
    spec = JobSpec(model="mlp", steps=1, batch_size=4, microbatches=1)
    plan = Plan.of(("a", 0, 1), ("b", 1, 3))
    group = DistGroup(store_host="192.0.2.7", store_port=29500, world_size=2, ranks={0: 0, 1: 1})
    a = make_assignments("j1", spec, plan)[1].model_copy(update={"dist": group})
    with pytest.raises(StoreRefused) as refused:
        join_group(a, InProcessTransport(), BROKER)
    assert str(refused.value) == (
        "job j1 stage 1: refused the rendezvous store at 192.0.2.7:29500: this agent accepts "
        "stores on loopback, broker.lan (add an address with edgetrain agent --store-host)"
    )
    assert not dist.is_initialized()
