"""Devices time the model's units themselves (``time-units``), and only checked answers count.

Real parts: a Mosquitto with TLS and accounts (each device may publish its answer
only on its own ``units`` topic, as its grant says) and real ``edgetrain agent``
processes (:class:`~coordinator.local.fleet.LocalFleet`), one of them throttled.
Claims:

- every agent answers :func:`time_units_on_devices` with the model's units in
  order at both row counts, which become that device's own
  :class:`~coordinator.planner.predict.UnitSeconds` (its fixed part within its
  seconds), and a prediction then prices each device by its own;
- an agent holding a stage answers with why not (``busy``) and keeps its scaled
  seconds (:attr:`DeviceUnitSeconds.missing`); an agent asked for a model it may not
  import answers with the refusal and imports nothing;
- answers that do not check out are not used: one naming another device, one
  listing other units, one that does not parse; an answer to an earlier request is
  ignored (the device then has no answer in time); a device too small to hold the
  whole model is not asked.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.mosquitto import Broker
from support.waiting import until

from coordinator.engine.spec import JobSpec
from coordinator.engine.unit_profiles import (
    time_units_on_devices,
    timing_request,
    whole_model_bytes,
)
from coordinator.local.fleet import AgentRoles, LocalFleet
from coordinator.local.owned import OwnedBroker
from coordinator.planner.build import build_problem
from coordinator.planner.predict import UnitSeconds, predict
from coordinator.planner.score import Plan
from edge.models.zoo import get_model
from edge.problem import DeviceSpec, PlanningProblem
from edge.transport.mqtt import MqttSettings, MqttTransport
from edge.wire.messages import (
    CancelJob,
    StageAssignment,
    StageReady,
    TimeUnits,
    UnitTimes,
    parse_event,
    parse_unit_times,
)
from edge.wire.topics import device_cmd, device_units, job_events

pytestmark = pytest.mark.broker

SPEC = JobSpec(model="cnn-digits", steps=1, batch_size=16, microbatches=2)


@pytest.fixture(scope="module")
def fleet(
    secure_broker: OwnedBroker, secure_control: MqttTransport
) -> Iterator[tuple[LocalFleet, dict[str, DeviceSpec]]]:
    with LocalFleet(2, secure_broker, threads=1, roles=AgentRoles(slowdowns=[1.0, 2.0])) as local:
        profiles = local.wait_online(secure_control, timeout=90)
        yield local, profiles


def test_every_agent_times_the_units_and_the_prediction_takes_each_ones_own(
    secure_control: MqttTransport, fleet: tuple[LocalFleet, dict[str, DeviceSpec]]
) -> None:
    local, profiles = fleet
    devices = [profiles[d] for d in local.ids]
    got = time_units_on_devices(secure_control, devices, timing_request(SPEC), timeout_s=120)
    assert got.missing == {} and set(got.seconds) == set(local.ids)
    n = get_model(SPEC.model).num_units
    for own in got.seconds.values():
        assert len(own.seconds) == n and len(own.fixed) == n
        assert all(s > 0 for s in own.seconds)
        assert all(0 <= f <= s for f, s in zip(own.fixed, own.seconds, strict=True))
    # A pipeline over both: each stage's compute is its device's own seconds, whatever
    # the host's are (here ten times too fast).
    problem: PlanningProblem = build_problem(
        SPEC.model, devices, batch_size=SPEC.batch_size, microbatches=SPEC.microbatches
    )
    host = UnitSeconds(tuple(s / 10 for s in got.seconds[local.ids[0]].seconds), 1.0)
    units = UnitSeconds(host.seconds, host.gflops, devices=got.seconds)
    cut = n // 2
    plan = Plan.of((local.ids[0], 0, cut), (local.ids[1], cut, n))
    guess = predict(problem, plan, units)
    without = predict(problem, plan, host)
    for s, (device, start, end) in enumerate([(local.ids[0], 0, cut), (local.ids[1], cut, n)]):
        # The same fixed cost per microbatch on top; the compute its own, not the host's.
        per_microbatch = without.compute_s[s] - host.on_device(profiles[device], start, end, 1.0)
        own = sum(got.seconds[device].seconds[start:end])
        assert guess.compute_s[s] == pytest.approx(own + per_microbatch, rel=1e-9)
        assert own > sum(host.seconds[start:end])


def test_a_busy_agent_and_a_refused_model_say_why_and_keep_the_scaled_seconds(
    secure_broker: OwnedBroker,
    secure_control: MqttTransport,
    fleet: tuple[LocalFleet, dict[str, DeviceSpec]],
    tmp_path: Path,
) -> None:
    local, profiles = fleet
    busy, other = local.ids
    events: list[object] = []
    secure_control.subscribe(job_events("jbusy", busy), lambda _t, p: events.append(parse_event(p)))
    assignment = {
        "type": "assign",
        "job": "jbusy",
        "stage": 0,
        "num_stages": 1,
        "start": 0,
        "end": 3,
        "model": "mlp",
        "dataset": "digits",
        "steps": 1,
        "batch_size": 8,
    }
    assert secure_broker.accounts is not None
    secure_broker.accounts.grant("jbusy", [(busy, StageAssignment.model_validate(assignment))])
    secure_control.publish(device_cmd(busy), json.dumps(assignment), 1)
    assert until(lambda: any(isinstance(e, StageReady) for e in events), 60)
    try:
        got = time_units_on_devices(
            secure_control, [profiles[busy]], timing_request(SPEC), timeout_s=60
        )
        assert got.seconds == {} and got.missing == {busy: "busy with job jbusy"}
    finally:
        secure_control.publish(device_cmd(busy), CancelJob(job="jbusy").model_dump_json(), 1)
        secure_control.unsubscribe(job_events("jbusy", busy))
        secure_broker.accounts.release("jbusy")
    # Sent as anyone could: the coordinator itself never builds what it asks for here.
    pwned = tmp_path / "pwned"
    answers: list[UnitTimes] = []
    secure_control.subscribe(device_units(other), lambda _t, p: answers.append(parse_unit_times(p)))
    evil = timing_request(SPEC).model_copy(
        update={"model": "os:system", "model_options": {"command": f"touch {pwned}"}}
    )
    try:
        secure_control.publish(device_cmd(other), evil.model_dump_json(), 1)
        assert until(lambda: bool(answers), 60)
    finally:
        secure_control.unsubscribe(device_units(other))
    (answer,) = answers
    assert answer.request == evil.request and answer.full == [] and answer.small is None
    assert answer.error is not None
    assert answer.error.startswith("CodeNotAllowed: model 'os:system'"), answer.error
    assert not pwned.exists()
    assert local.procs[other].poll() is None and local.procs[busy].poll() is None


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ("other-device", "names device someone-else on the topic of ghost"),
        ("other-units", "its full-row times do not list the model's"),
        ("garbage", "unit times"),
        ("stale", "no answer in 3 s"),
        ("too-small", "holds 0.000 GB; the whole model needs"),
        ("good", None),
    ],
)
def test_answers_that_do_not_check_out_are_not_used(
    case: str, why: str | None, mosquitto: Broker
) -> None:
    """A device of an open broker (no ACLs, so anyone can answer for ``ghost``) answers
    each request the way ``case`` says; nothing it says becomes unit seconds, unless it
    checks out (``good``)."""
    url = mosquitto.url
    coordinator = MqttTransport(MqttSettings(url=url))
    device = MqttTransport(MqttSettings(url=url))
    coordinator.connect(timeout=10)
    device.connect(timeout=10)
    names = [u.name for u in get_model(SPEC.model).units]

    def answer(_topic: str, payload: bytes) -> None:
        asked = TimeUnits.model_validate_json(payload)
        timings = [{"name": n, "fwd_s": 0.01, "bwd_s": 0.02} for n in names]
        body = UnitTimes(
            request=asked.request, device="ghost", full=timings, small=timings
        ).model_dump(mode="json")
        if case == "other-device":
            body["device"] = "someone-else"
        elif case == "other-units":
            body["full"] = body["full"][:-1]
        elif case == "stale":
            body["request"] = "uold"
        raw = b"{not json" if case == "garbage" else json.dumps(body).encode()
        device.publish(device_units("ghost"), raw, 1)

    device.subscribe(device_cmd("ghost"), answer)
    memory = 1e3 if case == "too-small" else 1e9
    ghost = DeviceSpec(
        id="ghost", gflops=1.0, memory_bytes=memory, bandwidth_mbps=100, latency_ms=1
    )
    problem = build_problem(
        SPEC.model, [ghost], batch_size=SPEC.batch_size, microbatches=SPEC.microbatches
    )
    needs = whole_model_bytes(problem)
    assert 1e3 < needs < 1e9
    try:
        got = time_units_on_devices(
            coordinator, [ghost], timing_request(SPEC), timeout_s=3, needs_bytes=needs
        )
    finally:
        device.close()
        coordinator.close()
    if why is None:
        assert got.missing == {} and got.seconds["ghost"].seconds == (0.03,) * len(names)
        return
    assert got.seconds == {}
    assert why in got.missing["ghost"], got.missing
