"""The attacker inside: a device that holds a stage of the running job reads and speaks
for that stage only.

tests/security/test_attacker.py's attacker holds no stage. Here an enrolled device
("insider") is granted stage 1 of a 3-stage job (the very assignment the coordinator
gives the fleet's agent of stage 1, replicas every 2 steps) while the job runs on the
fleet's three agents (real processes) over the secure broker (Mosquitto, TLS,
dynamic-security accounts). From before the job starts the insider is subscribed to
every topic of the job (:func:`support.grants.job_topics`) and to wildcard filters
over them, and from step 1 it publishes a frame on every topic of the job that is not
its stage's to send: stage 1's own inputs (as stage 0 and stage 2 would), the other
stages' inputs, weights, replicas and restore states, the other devices' events.

The broker must let through exactly its stage's part: the insider receives the real
activations and gradients of stage 1 and stage 0's replica (its grant,
:func:`edge.wire.topics.stage_access`), and none of the activations, gradients,
labels and states that the coordinator's spy sees flow to stages 0 and 2 meanwhile;
none of its frames reaches anyone; and the job ends with the weights of the plain
PyTorch reference.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from support.grants import Device, check_addressed, contract, job_topics, wildcards
from support.reference import assert_matches, train_reference
from support.waiting import until

from coordinator.engine.assignments import make_assignments
from coordinator.engine.options import RunOptions
from coordinator.engine.runners import Attempt, run_on_agents
from coordinator.engine.spec import JobSpec, new_job_id
from coordinator.local.fleet import LocalFleet
from coordinator.local.owned import OwnedBroker
from coordinator.planner.score import Plan
from edge.transport.mqtt import MqttTransport
from edge.wire.frames import Codec, Kind, encode_frame
from edge.wire.messages import StepReport
from edge.wire.topics import (
    TOPIC_ROOT,
    device_heartbeat,
    job_events,
    job_replica,
    job_restore,
    job_weights,
    stage_topic,
)

pytestmark = pytest.mark.slow

STEPS = 150
REPLICATE = 2
MODEL = "cnn-digits"  # 4 units: stages [0, 1), [1, 2), [2, 4)
MARK = b"INSIDER-5c1d"  # in every payload the insider publishes


def _spec() -> JobSpec:
    return JobSpec(model=MODEL, steps=STEPS, batch_size=16, microbatches=4, seed=3)


def test_a_stage_holder_reads_and_speaks_for_its_stage_only(
    secure_broker: OwnedBroker, secure_control: MqttTransport, secure_fleet: LocalFleet
) -> None:
    accounts = secure_broker.accounts
    assert accounts is not None
    creds = accounts.enroll("insider")
    ids = secure_fleet.ids
    plan = Plan.of((ids[0], 0, 1), (ids[1], 1, 2), (ids[2], 2, 4))
    job = new_job_id()
    stage1 = make_assignments(job, _spec(), plan, replicate_every=REPLICATE)[1]
    grant = contract(["insider"], [stage1])["insider"]
    check_addressed("insider", grant, [stage1])
    topics = job_topics(job, plan, ["insider"])
    frame = encode_frame(Kind.ACTIVATION, job, 5, 0, torch.full((4, 8), 7.0), Codec.FP32)
    attacks = [(t, frame + MARK) for t in sorted(topics - grant.publish)]
    done = (device_heartbeat("insider"), MARK + b"-done")  # its own topic: it arrives

    seen: list[tuple[str, bytes]] = []  # the spy: everything the coordinator may read
    spy = MqttTransport(secure_broker.settings())
    spy.connect(timeout=10)
    spy.subscribe(f"{TOPIC_ROOT}/#", lambda t, p: seen.append((t, bytes(p))))
    insider: Device | None = None
    window: dict[str, float] = {}
    failed: list[BaseException] = []

    def attack() -> None:
        assert insider is not None
        window["start"] = time.time()
        try:
            insider.publish([*attacks, done])
        except BaseException as exc:  # reported by the test's thread
            failed.append(exc)
        window["end"] = time.time()

    thread = threading.Thread(target=attack, daemon=True)

    def on_step(report: StepReport) -> None:
        if report.step == 1 and not thread.is_alive() and "start" not in window:
            thread.start()

    try:
        insider = Device(secure_broker.url, creds)
        accounts.grant(job, [("insider", stage1)])  # as the fleet's stage 1 is, next
        insider.subscribe([*sorted(topics), *wildcards(job, len(plan.stages))])
        result = run_on_agents(
            _spec(),
            plan,
            secure_control,
            job=job,
            on_step=on_step,
            options=RunOptions(timeout_s=300, access=accounts),
            attempt=Attempt(replicate_every=REPLICATE),
        )
        if thread.ident is not None:  # started at step 1
            thread.join(timeout=60)
        # One client's messages arrive in order: anything let through came before this.
        until(lambda: done in seen, 10)
    finally:
        accounts.release(job)  # run_on_agents took the job's grants back: a no-op then
        if insider is not None:
            insider.close()
        spy.close()

    # The attack ran while the job did: after step 1, and done before its last step.
    assert "end" in window and not failed and done in seen, (window, failed)
    last = max(r.ts for r in result.reports if r.step == STEPS - 1)
    assert window["start"] < window["end"] < last, (window, last)

    # It read its stage's frames and its predecessor's replica, and nothing else, while
    # the other stages' inputs and states flowed (the spy saw them from the agents).
    read, live = {t for t, _p in insider.received}, grant.read - {job_restore(job, 1)}
    assert read == live, f"beyond its grant: {sorted(read - live)}, missed: {sorted(live - read)}"
    flowed = {t for t, p in seen if MARK not in p}
    others = {
        stage_topic(job, 0, "bwd"),  # stage 1's gradients for stage 0
        stage_topic(job, 2, "fwd"),  # stage 1's activations and stage 0's labels
        job_replica(job, 2),  # stage 2's weights and optimizer state
        job_weights(job, 0),
        job_weights(job, 2),
        job_events(job, ids[2]),
    }
    assert others <= flowed, sorted(others - flowed)

    # None of its frames reached anyone: not the coordinator's spy, not the agents.
    leaked = sorted({t for t, p in seen if MARK in p and (t, p) != done})
    assert leaked == [], leaked
    assert len(attacks) > 20  # every stage's and member's topic but its own outputs
    assert result.rejected == {}
    for device in ids:
        assert "lost the broker" not in secure_fleet.log_path(device).read_text(), device

    reference = train_reference(MODEL, steps=STEPS, batch_size=16, seed=3, microbatches=4)
    assert_matches(result.losses, result.weights, reference)
