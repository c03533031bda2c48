"""Agents replicate stage state, keep their neighbour's, and resume a job from a state.

Real Mosquitto and real agent processes (the module's fleet, tests/e2e/conftest.py);
the test drives them with plain commands on their ``cmd`` topics, as a
coordinator does, and reads replicas off the broker with
:func:`edge.runtime.checkpoint.read_state`. Every job is the 2-stage plan of
``_assignments`` on two agents, and each run checks that both stages finished.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import safetensors.torch
import torch
from support.waiting import until

from coordinator.engine.assignments import make_assignments
from coordinator.engine.spec import JobSpec
from coordinator.local.fleet import LocalFleet
from coordinator.planner.score import Plan
from edge.runtime.checkpoint import encode_state, read_state
from edge.transport.mqtt import MqttTransport
from edge.wire.messages import (
    CancelJob,
    MessageError,
    OptimizerSpec,
    StageAssignment,
    StageDone,
    StageFailed,
    StageReady,
    StartJob,
    StepReport,
    parse_event,
)
from edge.wire.topics import TOPIC_ROOT, device_cmd, job_events_all, job_restore

STEPS, EVERY, RESUME_AT = 6, 2, 4
SPEC = JobSpec(
    model="mlp",
    steps=STEPS,
    batch_size=8,
    microbatches=2,
    seed=7,
    optimizer=OptimizerSpec(name="adamw", lr=1e-3),
    recv_timeout_s=30,
)


def _assignments(job: str, devices: list[str], **extra: Any) -> list[StageAssignment]:
    plan = Plan.of((devices[0], 0, 1), (devices[1], 1, 3))
    return [
        StageAssignment.model_validate(a.model_dump() | extra)
        for a in make_assignments(job, SPEC, plan)
    ]


class Job:
    """One job driven by hand: its events and the replicas its stages publish."""

    def __init__(self, control: MqttTransport, job: str) -> None:
        self.control, self.job = control, job
        self.events: list[Any] = []
        self.replicas: list[tuple[int, bytes]] = []  # (stage of the topic, blob)
        self._cond = threading.Condition()
        self._topics = [job_events_all(job), f"{TOPIC_ROOT}/jobs/{job}/replica/+"]
        control.subscribe(self._topics[0], self._on_event)
        control.subscribe(self._topics[1], self._on_replica)

    def _on_event(self, _topic: str, payload: bytes) -> None:
        try:
            event = parse_event(payload)
        except MessageError:
            return
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def _on_replica(self, topic: str, payload: bytes) -> None:
        with self._cond:
            self.replicas.append((int(topic.rsplit("/", 1)[1]), payload))

    def of(self, kind: type) -> list[Any]:
        with self._cond:
            return [e for e in self.events if isinstance(e, kind)]

    def wait(self, what: Any, timeout: float = 120.0) -> bool:
        with self._cond:
            return self._cond.wait_for(what, timeout)

    def run(self, assignments: list[StageAssignment], devices: list[str]) -> None:
        """Assign, wait for every stage to be ready (or one to fail), start, wait for done."""
        n = len(assignments)
        for a, device in zip(assignments, devices, strict=False):
            self.control.publish(device_cmd(device), a.model_dump_json(), 1)
        assert self.wait(lambda: self.of(StageFailed) or len(self.of(StageReady)) == n)
        if self.of(StageFailed):
            return
        for device in devices:
            self.control.publish(device_cmd(device), StartJob(job=self.job).model_dump_json(), 1)
        assert self.wait(lambda: self.of(StageFailed) or len(self.of(StageDone)) == n)

    def cancel(self, devices: list[str]) -> None:
        for device in devices:
            self.control.publish(device_cmd(device), CancelJob(job=self.job).model_dump_json(), 1)

    def losses(self) -> dict[int, float]:
        return {r.step: r.loss for r in self.of(StepReport) if r.loss is not None}

    def close(self) -> None:
        for topic in self._topics:
            self.control.unsubscribe(topic)


def _weights(fleet: LocalFleet, devices: list[str], job: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for stage, device in enumerate(devices):
        path = fleet.work_dir / device / job / f"stage{stage}.safetensors"
        out.update(safetensors.torch.load(path.read_bytes()))
    return out


@pytest.fixture(scope="module")
def reference(control: MqttTransport, fleet: LocalFleet) -> Job:
    """The uninterrupted job, its stages replicating every ``EVERY`` steps."""
    job = Job(control, "replref")
    devices = fleet.ids[:2]
    job.run(_assignments(job.job, devices, replicate_every=EVERY), devices)
    job.close()
    assert not job.of(StageFailed), job.of(StageFailed)
    assert sorted((d.stage, d.device) for d in job.of(StageDone)) == [
        (0, devices[0]),
        (1, devices[1]),
    ]
    return job


def test_stages_replicate_at_the_right_steps(reference: Job, fleet: LocalFleet) -> None:
    states = [(stage, read_state(blob)) for stage, blob in reference.replicas]
    assert sorted((stage, st.step) for stage, st in states) == [(0, 2), (0, 4), (1, 2), (1, 4)]
    for stage, st in states:
        assert (st.job, st.stage) == ("replref", stage)
        assert (st.start, st.end) == [(0, 1), (1, 3)][stage]
        assert st.optim and all(
            set(v) == {"step", "exp_avg", "exp_avg_sq"} for v in st.optim.values()
        )
        assert all(float(v["step"]) == st.step for v in st.optim.values())
    with_replica = [r for r in reference.of(StepReport) if r.replica_bytes]
    assert sorted((r.stage, r.step) for r in with_replica) == [(0, 1), (0, 3), (1, 1), (1, 3)]
    assert all(r.replica_s > 0 for r in with_replica)

    # Each device keeps its predecessor's newest state (stage 0 keeps the last stage's).
    for device, neighbour in ((fleet.ids[1], 0), (fleet.ids[0], 1)):
        path = fleet.work_dir / device / "replref" / f"replica-of-stage{neighbour}.safetensors"
        newest = [blob for stage, blob in reference.replicas if stage == neighbour][-1]
        assert until(lambda p=path, b=newest: p.exists() and p.read_bytes() == b, 10), path
        assert read_state(path.read_bytes()).step == 4
        assert not list(path.parent.glob(".*.tmp"))
        log = fleet.log_path(device).read_text()
        assert f"kept stage {neighbour}'s state for step 4" in log
        assert "replicated the state for step 2" in log


def test_a_restored_stage_resumes_where_the_state_left_off(
    reference: Job, control: MqttTransport, fleet: LocalFleet
) -> None:
    job = Job(control, "replresume")
    devices = [fleet.ids[2], fleet.ids[0]]  # other devices than the run the states came from
    blobs = {
        stage: encode_state(read_state(blob), job=job.job)
        for stage, blob in reference.replicas
        if read_state(blob).step == RESUME_AT
    }
    try:
        for stage, blob in blobs.items():
            control.publish(job_restore(job.job, stage), blob, 1, retain=True)
        assignments = _assignments(job.job, devices, first_step=RESUME_AT, restore=True)
        job.run(assignments, devices)
        assert not job.of(StageFailed), job.of(StageFailed)
        assert sorted(d.stage for d in job.of(StageDone)) == [0, 1]
    finally:
        for stage in blobs:
            control.publish(job_restore(job.job, stage), b"", 1, retain=True)
        job.close()
    resumed, expected = job.losses(), reference.losses()
    assert sorted(resumed) == list(range(RESUME_AT, STEPS))
    for step, loss in resumed.items():
        assert loss == pytest.approx(expected[step], rel=1e-6)
    ours = _weights(fleet, devices, job.job)
    theirs = _weights(fleet, fleet.ids[:2], "replref")
    assert ours.keys() == theirs.keys()
    assert all(torch.allclose(ours[k], theirs[k], rtol=1e-6, atol=0) for k in ours)
    assert "restored units [1, 3) for step 4" in fleet.log_path(devices[1]).read_text()


@pytest.mark.parametrize(
    ("case", "error"),
    [
        ("missing", "restore: no state on"),
        ("garbage", "restore: not a safetensors state"),
        ("step", "restore: the state is for step 2, the stage starts at step 4"),
    ],
)
def test_a_missing_or_bad_restore_state_fails_the_stage_not_the_agent(
    reference: Job, control: MqttTransport, fleet: LocalFleet, case: str, error: str
) -> None:
    name = f"rbad-{case}"
    job = Job(control, name)
    devices = fleet.ids[:2]
    early = next(b for s, b in reference.replicas if s == 0 and read_state(b).step == 2)
    blob = {
        "missing": None,
        "garbage": b"garbage, not a state",
        "step": encode_state(read_state(early), job=name),
    }[case]
    try:
        if blob is not None:
            control.publish(job_restore(name, 0), blob, 1, retain=True)
        assignments = _assignments(name, devices, first_step=RESUME_AT, recv_timeout_s=2)
        assignments[0] = StageAssignment.model_validate(
            assignments[0].model_dump() | {"restore": True}
        )
        job.run(assignments, devices)
        failed = job.of(StageFailed)
        assert [(f.stage, f.device) for f in failed] == [(0, devices[0])]
        assert error in failed[0].error
    finally:
        job.cancel(devices)  # stage 1 was built and waits: let it go
        if blob is not None:
            control.publish(job_restore(name, 0), b"", 1, retain=True)
        job.close()
    assert all(fleet.procs[d].poll() is None for d in devices)
    # The devices take the next job at once (the cancelled stage does not keep them busy).
    after = Job(control, f"{name}ok")
    try:
        after.run(_assignments(after.job, devices), devices)
        assert len(after.of(StageDone)) == 2, after.events
    finally:
        after.close()
