"""Stages on server-tier devices form one torch.distributed group, its store hosted here.

The store is a real ``TCPStore`` listening on a port of this machine; the rest of
the assignments are tests/unit/coordinator/engine/test_assignments.py's.
"""

from __future__ import annotations

from datetime import timedelta

import psutil
import pytest
import torch.distributed as dist
from support.waiting import until

from coordinator.engine.assignments import make_assignments
from coordinator.engine.monitor import JobFailed
from coordinator.engine.runners import _server_group
from coordinator.engine.spec import JobSpec
from coordinator.planner import Plan

SPEC = JobSpec(model="gpt-mini", steps=2, batch_size=8, microbatches=2)


def test_stages_on_two_servers_form_one_group_with_a_store_here() -> None:
    plan = Plan.of(("pi", 0, 2), ("box1", 2, 4), ("box2", 4, 6))
    out, store = _server_group(
        make_assignments("j1", SPEC, plan), plan, {"box1": "cpu", "box2": "cpu"}, "127.0.0.1"
    )
    assert out[0].dist is None
    group = out[1].dist
    assert group is not None and out[2].dist == group
    assert (group.ranks, group.world_size, group.backend) == ({1: 0, 2: 1}, 2, "gloo")
    assert group.store_port == store.port > 0
    # One server stage alone is no group.
    alone, none = _server_group(make_assignments("j1", SPEC, plan), plan, {"box1": "cpu"}, "h")
    assert none is None and all(a.dist is None for a in alone)


def test_the_store_listens_on_the_announced_address_only() -> None:
    """Not on every interface (what ``TCPStore`` does given a host): only where the ranks
    are told to find it; an address this machine lacks fails the job in one line."""
    plan = Plan.of(("box1", 0, 3), ("box2", 3, 6))
    servers = {"box1": "cpu", "box2": "cpu"}
    _out, store = _server_group(make_assignments("j1", SPEC, plan), plan, servers, "127.0.0.1")
    port = store.port

    def listening() -> set[str]:
        conns = psutil.Process().net_connections(kind="inet")
        return {
            c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN and c.laddr.port == port
        }

    assert listening() == {"127.0.0.1"}
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    client.set("k", "v")
    assert store.get("k") == b"v"
    del client, store
    assert until(lambda: not listening(), 10)  # the store closed the socket it was given
    with pytest.raises(JobFailed, match=r"^cannot host the rendezvous store on 192\.0\.2\.7: "):
        _server_group(make_assignments("j2", SPEC, plan), plan, servers, "192.0.2.7")
