"""What each device of a plan may do on a job's topics, and a probe of what a broker lets it.

The contract is :func:`edge.wire.topics.stage_access`, applied to each device's
assignments as the coordinator's grants must apply it (a device holding two stages
of a U gets both). :func:`job_topics` derives from the plan every topic of the job
(every stage's and member's frames, every group's reduce and gather channels, every
stage's weights, replica and restore, every device's events, and those of one member
more per stage: a grant by wildcard reaches them too), so a broker that lets a device
use anything beyond its grant is seen, whatever form the extra grant takes.
:func:`check_addressed` is the privacy half of the contract, said without
``stage_access``: every topic a device reads is addressed to a stage it holds.

:class:`Device` is a paho client logged in with an enrolled device's credentials
(TLS, its bound client id) that records what it receives.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import paho.mqtt.client as mqtt

from coordinator.planner.score import Plan
from edge.transport.credentials import Credentials, device_client_id
from edge.transport.settings import parse_broker_url, tls_context
from edge.wire.messages import StageAssignment
from edge.wire.topics import (
    TOPIC_ROOT,
    job_events,
    job_replica,
    job_restore,
    job_weights,
    parse_stage_topic,
    stage_access,
    stage_topic,
)

__all__ = [
    "Device",
    "Grant",
    "check_addressed",
    "contract",
    "holders",
    "job_topics",
    "wildcards",
]

TIMEOUT = 10.0


@dataclass
class Grant:
    """The exact topics one device may publish to and read, for one job."""

    publish: set[str] = field(default_factory=set)
    read: set[str] = field(default_factory=set)


def holders(plan: Plan, assignments: Sequence[StageAssignment]) -> list[str]:
    """The device of each assignment (as :func:`coordinator.engine.runners.run_on_agents`)."""
    return [plan.stages[a.stage].devices[a.member] for a in assignments]


def contract(devices: Iterable[str], assignments: Sequence[StageAssignment]) -> dict[str, Grant]:
    """What each of ``devices`` (given in assignment order) may do: the union of
    :func:`stage_access` over the stages it holds; nothing for a device that holds none."""
    out: dict[str, Grant] = {}
    for device, a in zip(devices, assignments, strict=True):
        sizes = None if a.group_samples is None else [len(g) for g in a.group_samples]
        access = stage_access(
            a.job,
            a.stage,
            a.num_stages,
            device,
            replicate=bool(a.replicate_every or a.handover),
            member=a.member,
            group_sizes=sizes,
            labels_local=a.labels_local,
        )
        grant = out.setdefault(device, Grant())
        grant.publish |= set(access.publish)
        grant.read |= set(access.read)
    return out


def job_topics(job: str, plan: Plan, others: Iterable[str] = ()) -> set[str]:
    """Every topic of ``job`` under ``plan`` (see the module docstring); ``others`` are
    further devices whose events topics count."""
    sizes = [len(st.devices) for st in plan.stages]
    topics = set()
    for s, size in enumerate(sizes):
        topics |= {job_weights(job, s), job_replica(job, s), job_restore(job, s)}
        for m in range(size + 1):  # one member more than the stage has
            topics |= {stage_topic(job, s, "fwd", m), stage_topic(job, s, "bwd", m)}
            topics.add(stage_topic(job, s, "gather", sender=m))
            topics |= {stage_topic(job, s, "reduce", m, k) for k in range(size + 1) if k != m}
    devices = {d for st in plan.stages for d in st.devices} | set(others)
    return topics | {job_events(job, d) for d in devices}


def wildcards(job: str, num_stages: int) -> list[str]:
    """Subscription filters that would cover other stages' topics, were they granted."""
    root = f"{TOPIC_ROOT}/jobs/{job}"
    per_stage = [f"{root}/stage/{s}/#" for s in range(num_stages)]
    return [
        "#",
        f"{TOPIC_ROOT}/#",
        f"{root}/#",
        f"{root}/stage/+/fwd",
        f"{root}/stage/+/bwd",
        f"{root}/+/+",
        f"{TOPIC_ROOT}/jobs/+/restore/+",
        f"$share/g/{root}/#",
        *per_stage,
    ]


def check_addressed(device: str, grant: Grant, held: Iterable[StageAssignment]) -> None:
    """Every topic ``device`` may read is addressed to a ``(stage, member)`` it holds: its
    own frames, reduce chunks sent to it and its co-members' gathers, its stage's restore
    state and (replicating) its predecessor's replica. Raises ``AssertionError``."""

    def to(a: StageAssignment, topic: str) -> bool:
        parsed = parse_stage_topic(topic)
        if parsed is None:
            replicating = bool(a.replicate_every or a.handover)
            previous = job_replica(a.job, (a.stage - 1) % a.num_stages)
            return topic == job_restore(a.job, a.stage) or (replicating and topic == previous)
        job, stage, channel, member, sender = parsed
        if (job, stage) != (a.job, a.stage) or sender == a.member:
            return False  # another stage's, or what this member sends itself
        return channel == "gather" or member == a.member

    mine = list(held)
    stray = sorted(t for t in grant.read if not any(to(a, t) for a in mine))
    assert not stray, f"{device} may read topics not addressed to its stages: {stray}"


class Device:
    """A paho client logged in as an enrolled device (over the broker's TLS, its bound
    client id); every message it receives is kept in :attr:`received`."""

    def __init__(self, url: str, creds: Credentials) -> None:
        self.name = creds.device_id
        self.received: list[tuple[str, bytes]] = []
        self._lock = threading.Lock()
        self._events: queue.Queue[tuple[str, object]] = queue.Queue()
        c = mqtt.Client(
            callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
            client_id=device_client_id(creds.device_id),
            protocol=mqtt.MQTTv311,
        )
        c.username_pw_set(creds.username, creds.password.get_secret_value())
        c.tls_set_context(tls_context(creds.settings()))
        c.on_connect = lambda _c, _u, _f, rc, _p: self._events.put(("connack", rc))
        c.on_subscribe = lambda _c, _u, _m, rcs, _p: self._events.put(("suback", rcs))
        c.on_message = lambda _c, _u, msg: self._keep(msg.topic, bytes(msg.payload))
        _scheme, host, port = parse_broker_url(url)
        c.connect(host, port, keepalive=30)
        c.loop_start()
        self.mqtt = c
        rc = self._wait("connack")
        assert not rc.is_failure, f"{self.name} was refused: {rc}"  # type: ignore[attr-defined]

    def _keep(self, topic: str, payload: bytes) -> None:
        with self._lock:
            self.received.append((topic, payload))

    def _wait(self, kind: str) -> object:
        deadline = time.monotonic() + TIMEOUT
        while True:
            try:
                got, value = self._events.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"{self.name}: no {kind} within {TIMEOUT:g} s") from None
            if got == kind:
                return value

    def subscribe(self, filters: Sequence[str]) -> list[bool]:
        """Subscribe to ``filters`` in one SUBSCRIBE; which ones the broker granted."""
        self.mqtt.subscribe([(f, 1) for f in filters])
        codes = self._wait("suback")
        return [not code.is_failure for code in codes]  # type: ignore[attr-defined]

    def publish(self, messages: Sequence[tuple[str, bytes]]) -> None:
        """Publish each ``(topic, payload)`` at QoS 1, in order; returns once all were
        acknowledged (a broker acknowledges a refused one too, and drops it)."""
        infos = [self.mqtt.publish(topic, payload, qos=1) for topic, payload in messages]
        for (topic, _payload), info in zip(messages, infos, strict=True):
            info.wait_for_publish(timeout=TIMEOUT)
            assert info.is_published(), f"{self.name}: no PUBACK on {topic}"

    def got(self, prefix: bytes) -> list[tuple[str, bytes]]:
        """What it received whose payload starts with ``prefix``."""
        with self._lock:
            return [(t, p) for t, p in self.received if p.startswith(prefix)]

    def close(self) -> None:
        self.mqtt.disconnect()
        self.mqtt.loop_stop()
