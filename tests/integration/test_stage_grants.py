"""A stage's device may use exactly its stage's topics, on both brokers the coordinator owns.

For 3-stage plans (one device a stage, with and without replicas; groups 1,2,1 and
2,1,2 with hand-over; a U whose labels stay home, where the holders of stage 0 hold
the last stage too), the coordinator grants the plan
(:meth:`coordinator.access.accounts.BrokerAccounts.grant`, with the assignments
:func:`coordinator.engine.assignments.make_assignments` makes) on a real broker: Mosquitto
with its dynamic-security plugin, and the embedded amqtt broker of machines without
it. Each device of the plan, and one enrolled device holding no stage (its id extends
a holder's, as ``pi-10`` extends ``pi-1``), then logs in with its own credentials and

- subscribes to every topic of the job (:func:`support.grants.job_topics`, derived
  from the plan) and to wildcard filters over them, while the coordinator publishes
  on every one: it must receive exactly the topics it may read;
- publishes on every topic of the job, while the coordinator's account (which may
  read everything) listens: exactly the topics it may publish to must arrive.

What it may do is :func:`edge.wire.topics.stage_access` for the stages it holds, and
every topic it may read must be addressed to one of them
(:func:`support.grants.check_addressed`). So any grant broader than a stage's own
topics fails here, whatever its form: a wildcard on the job or on a stage, a
neighbour's input, another member's channel. Every refusal is seen next to the same
message delivered elsewhere (the coordinator receives every probe), so each
assertion can fail.
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from support.grants import (
    Device,
    Grant,
    check_addressed,
    contract,
    holders,
    job_topics,
    wildcards,
)
from support.markers import needs_mosquitto
from support.waiting import until

from coordinator.engine.assignments import make_assignments
from coordinator.engine.spec import JobSpec, new_job_id
from coordinator.local.owned import OwnedBroker, start_owned_broker
from coordinator.planner.score import Plan, Stage
from edge.transport.mqtt import MqttTransport
from edge.wire.topics import TOPIC_ROOT, device_cmd, device_heartbeat

WAIT_S = 10.0
SPEC = JobSpec(model="cnn-digits", steps=2, batch_size=8, microbatches=2)  # 4 units
LOCAL = JobSpec(
    model="cnn-digits",
    steps=2,
    batch_size=8,
    microbatches=2,
    data={"name": "digits", "labels": "local"},  # type: ignore[arg-type]
)


@dataclass(frozen=True)
class Variant:
    name: str
    sizes: tuple[int, ...]
    spec: JobSpec = SPEC
    u_shaped: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    """:func:`make_assignments`'s keyword arguments."""

    def plan(self, tag: str) -> Plan:
        units = [(0, 1), (1, 2), (2, 4)]
        stages = [
            Stage.group([f"{tag}-s{s}m{m}" for m in range(n)], *units[s])
            for s, n in enumerate(self.sizes)
        ]
        if self.u_shaped:  # the last stage is stage 0's devices again
            stages[-1] = Stage.group(list(stages[0].devices), *units[-1])
        return Plan(tuple(stages), u_shaped=self.u_shaped)


VARIANTS = [
    Variant("chain", (1, 1, 1)),
    Variant("chain-replicating", (1, 1, 1), options={"replicate_every": 2}),
    Variant("groups-121-replicating", (1, 2, 1), options={"replicate_every": 2}),
    Variant("groups-212-handover", (2, 1, 2), options={"handover": True}),
    Variant("labels-local-u", (2, 1, 2), spec=LOCAL, u_shaped=True),
]


@pytest.fixture(scope="module", params=[pytest.param("mosquitto", marks=needs_mosquitto), "amqtt"])
def owned(request: pytest.FixtureRequest) -> Iterator[OwnedBroker]:
    """The broker ``edgetrain coordinator`` starts (TLS, accounts), one per kind and module."""
    with tempfile.TemporaryDirectory(prefix="edgetrain-grants-") as tmp:
        broker = start_owned_broker(Path(tmp) / "broker", prefer=request.param, log_dir=Path(tmp))
        try:
            yield broker
        finally:
            broker.stop()


class Coordinator:
    """The coordinator's account: publishes anywhere, and keeps all it reads."""

    def __init__(self, owned: OwnedBroker) -> None:
        self._lock = threading.Lock()
        self.seen: list[tuple[str, bytes]] = []
        self.transport = MqttTransport(owned.settings())
        self.transport.connect(timeout=10)
        self.transport.subscribe(f"{TOPIC_ROOT}/#", self._keep)

    def _keep(self, topic: str, payload: bytes) -> None:
        with self._lock:
            self.seen.append((topic, payload))

    def got(self, prefix: bytes) -> list[tuple[str, bytes]]:
        with self._lock:
            return [(t, p) for t, p in self.seen if p.startswith(prefix)]


def _topics_of(messages: list[tuple[str, bytes]], prefix: bytes) -> set[str]:
    """The topics of ``messages`` whose payload is ``prefix`` + their own topic."""
    return {t for t, p in messages if p == prefix + t.encode()}


def _until(check: Callable[[], bool]) -> None:
    until(check, WAIT_S, interval=0.02)  # the assertions after it say what is missing


@pytest.mark.parametrize("variant", VARIANTS, ids=[v.name for v in VARIANTS])
def test_each_device_may_use_exactly_its_stages_topics(
    owned: OwnedBroker, variant: Variant
) -> None:
    accounts = owned.accounts
    assert accounts is not None
    tag = f"{owned.broker.kind[0]}{VARIANTS.index(variant)}"
    job = new_job_id()
    plan = variant.plan(tag)
    assignments = make_assignments(job, variant.spec, plan, **variant.options)
    held_by = holders(plan, assignments)
    bystander = f"{held_by[0]}0"  # holds no stage; its id extends a holder's, as pi-10 pi-1's
    devices = [*sorted(set(held_by)), bystander]
    want = contract(held_by, assignments)
    want[bystander] = Grant()
    for device in devices:
        held = [a for d, a in zip(held_by, assignments, strict=True) if d == device]
        check_addressed(device, want[device], held)
    topics = sorted(job_topics(job, plan, [bystander]))
    for device in devices:  # the universe covers every grant, and more than any one
        assert want[device].publish | want[device].read < set(topics), device

    creds = {d: accounts.enroll(d) for d in devices}
    coordinator = Coordinator(owned)
    clients: list[Device] = []
    try:
        for device in devices:
            clients.append(Device(owned.url, creds[device]))
        accounts.grant(job, list(zip(held_by, assignments, strict=True)))
        filters = [*topics, *wildcards(job, len(plan.stages))]
        for c in clients:
            granted = c.subscribe([*filters, device_cmd(c.name)])
            assert granted[-1], f"{c.name} may not read its own command topic"

        # Reading: the coordinator sends on every topic of the job, then "end" to each.
        for topic in topics:
            coordinator.transport.publish(topic, b"probe|" + topic.encode(), 1)
        for c in clients:
            coordinator.transport.publish(device_cmd(c.name), b"probe-end", 1)
        _until(
            lambda: (
                all(
                    c.got(b"probe-end")
                    and _topics_of(c.got(b"probe|"), b"probe|") >= want[c.name].read
                    for c in clients
                )
                and _topics_of(coordinator.got(b"probe|"), b"probe|") >= set(topics)
            )
        )
        assert _topics_of(coordinator.got(b"probe|"), b"probe|") == set(topics)
        for c in clients:
            read = _topics_of(c.got(b"probe|"), b"probe|")
            mine = want[c.name].read
            assert read == mine, (
                f"{c.name} read beyond its grant: {sorted(read - mine)}; "
                f"was refused its own: {sorted(mine - read)}"
            )

        # Publishing: each device sends on every topic of the job, then "end" on its own.
        for c in clients:
            prefix = f"leak|{c.name}|".encode()
            c.publish([(t, prefix + t.encode()) for t in topics])
            c.publish([(device_heartbeat(c.name), prefix + b"end")])

        def arrived(c: Device) -> set[str]:
            prefix = f"leak|{c.name}|".encode()
            return _topics_of(coordinator.got(prefix), prefix)

        _until(
            lambda: all(
                coordinator.got(f"leak|{c.name}|end".encode())
                and arrived(c) >= want[c.name].publish
                for c in clients
            )
        )
        for c in clients:
            sent, mine = arrived(c), want[c.name].publish
            assert sent == mine, (
                f"{c.name} published beyond its grant: {sorted(sent - mine)}; "
                f"was refused its own: {sorted(mine - sent)}"
            )
    finally:
        accounts.release(job)
        for c in clients:
            c.close()
        coordinator.transport.close()
