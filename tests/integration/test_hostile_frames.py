"""A job keeps training, unchanged, while another client floods its stage topics with bad frames.

Three stages of a real job run as threads of this process, each on its own MQTT
connection to a real Mosquitto (as three devices would); a fourth client, any
client that can publish on the job's topics, sends what an inbox must refuse
([Note: bounded inboxes] in :mod:`edge.transport.inbox`): garbage bytes, a frame
of a few MiB whose header claims a huge shape, frames with a valid header but the
wrong shape or dtype, frames for steps far outside the window. Those of the
wrong shape or dtype arrive *before* the real frames of their keys. The job must
finish, every kind of frame must be counted under its reason, and the final
weights must equal the independent reference (:mod:`support.reference`).

The frames are sent from stage 1's report hook after step 2, on stage 1's
thread: stage 1 is then between steps 2 and 3 (its window is steps 3 and 4), so
no stage can have sent the real frames of step 4 to stage 1 or of step 3 to
stage 0 yet, and the hook waits until every forged frame has been counted.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
from support.mosquitto import Broker
from support.reference import assert_matches, one_thread, train_reference
from support.waiting import until

from coordinator.engine.assignments import make_assignments
from coordinator.engine.spec import JobSpec
from coordinator.planner.score import Plan
from edge.runtime.stage import StageRuntime
from edge.transport.mqtt import MqttSettings, MqttTransport
from edge.wire.frames import HEADER, Codec, Kind, encode_frame
from edge.wire.messages import StepReport
from edge.wire.topics import stage_topic

JOB = "hostile"
SPEC = JobSpec(
    model="cnn-digits", steps=8, batch_size=16, microbatches=4, seed=3, recv_timeout_s=60
)
CUTS = [0, 1, 2, 4]  # activations into stage 1: [4, 16, 8, 8]; into stage 2: [4, 32, 4, 4]
WAIT_S = 30.0


def _frame(kind: Kind, step: int, mb: int, tensor: torch.Tensor) -> bytes:
    return encode_frame(kind, JOB, step, mb, tensor, Codec.FP32)


def _huge_claim(size: int) -> bytes:
    """A valid header claiming a ``2**20 x 2**20`` tensor, then ``size`` bytes of junk."""
    header = bytearray(_frame(Kind.ACTIVATION, 4, 0, torch.zeros(2, 2))[: HEADER.size + 16])
    header[HEADER.size : HEADER.size + 16] = (1 << 20).to_bytes(8, "little") * 2
    return bytes(header) + b"\xab" * size


def _hostile() -> list[tuple[int, str, bytes, str]]:
    """``(stage, channel, payload, the reason its inbox must count)``."""
    act = torch.ones(4, 16, 8, 8)
    return [
        (1, "fwd", b"\x00not a frame" * 100, "bad-magic"),
        (1, "fwd", _huge_claim(4 << 20), "too-large"),
        (1, "fwd", _frame(Kind.ACTIVATION, 4, 0, torch.ones(4, 16, 4, 4)), "wrong-shape"),
        (1, "fwd", _frame(Kind.ACTIVATION, 4, 1, act.double()), "wrong-dtype"),
        (1, "fwd", _frame(Kind.ACTIVATION, 10_000, 0, act), "ahead"),
        (1, "fwd", _frame(Kind.ACTIVATION, 0, 0, act), "late"),
        (1, "bwd", _frame(Kind.GRADIENT, 4, 0, torch.ones(4, 64)), "wrong-shape"),
        (0, "bwd", _frame(Kind.GRADIENT, 3, 0, torch.ones(4, 8, 8, 16)), "wrong-shape"),
        (2, "fwd", _frame(Kind.LABELS, 3, 0, torch.ones(4)), "wrong-dtype"),
        (2, "fwd", _frame(Kind.LABELS, 3, 1, torch.arange(5)), "wrong-shape"),
        (2, "fwd", _frame(Kind.ACTIVATION, 1 << 40, 2, torch.ones(4, 32, 4, 4)), "ahead"),
    ]


@pytest.fixture
def transports(mosquitto: Broker) -> Iterator[list[MqttTransport]]:
    """Four connections: one per stage, and the attacker's."""
    made = [MqttTransport(MqttSettings(url=mosquitto.url)) for _ in range(4)]
    try:
        for transport in made:
            transport.connect(timeout=WAIT_S)
        yield made
    finally:
        for transport in made:
            transport.close()


def test_a_job_survives_hostile_frames_and_trains_like_the_reference(
    transports: list[MqttTransport],
) -> None:
    plan = Plan.of(*((f"d{s}", CUTS[s], CUTS[s + 1]) for s in range(3)))
    reports: list[StepReport] = []
    injected = threading.Event()
    attacker = transports[3]
    hostile = _hostile()
    runtimes: list[StageRuntime] = []

    def expected_drops(stage: int) -> dict[str, int]:
        out: dict[str, int] = {}
        for s, _channel, _payload, reason in hostile:
            if s == stage:
                out[reason] = out.get(reason, 0) + 1
        return out

    def counted(stage: int) -> bool:
        got = runtimes[stage].inbox.dropped
        return all(got[r] >= n for r, n in expected_drops(stage).items())

    def report(event: object) -> None:
        assert isinstance(event, StepReport)
        reports.append(event)
        if event.stage == 1 and event.step == 2:  # stage 1 waits here: see the module docstring
            for stage, channel, payload, _reason in hostile:
                attacker.publish(stage_topic(JOB, stage, channel), payload, qos=1)
            assert attacker.flush(WAIT_S)
            assert until(lambda: all(counted(s) for s in range(3)), WAIT_S)
            injected.set()

    failures: list[BaseException] = []

    def work(rt: StageRuntime) -> None:
        try:
            rt.run()
        except BaseException as exc:
            failures.append(exc)
            for other in runtimes:
                other.cancel()

    with one_thread():
        for a in make_assignments(JOB, SPEC, plan):
            runtimes.append(StageRuntime(a, transports[a.stage], report=report))
        threads = [threading.Thread(target=work, args=(rt,), daemon=True) for rt in runtimes]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert not failures, failures
    assert not any(t.is_alive() for t in threads)
    assert injected.is_set()

    # Every stage ran every step, and every injected frame was counted under its reason.
    assert {(r.stage, r.step) for r in reports} == {(s, t) for s in range(3) for t in range(8)}
    for stage, rt in enumerate(runtimes):
        assert dict(rt.inbox.dropped) == expected_drops(stage), (stage, rt.inbox.dropped)
        stats = rt.inbox.stats()
        assert {k: v for k, v in stats.items() if k.startswith("dropped.")} == {
            f"dropped.{r}": n for r, n in expected_drops(stage).items()
        }
        last = max((r for r in reports if r.stage == stage), key=lambda r: r.step)
        assert last.frames_dropped == sum(expected_drops(stage).values())
    # Nothing reached the transports' own counters: every frame went to an inbox.
    assert not any(k.startswith("dropped.") for t in transports[:3] for k in t.stats())

    losses = [r.loss for r in sorted(reports, key=lambda r: r.step) if r.stage == 2]
    weights: dict[str, torch.Tensor] = {}
    for rt in runtimes:
        weights.update({k: v.detach().clone() for k, v in rt.segment.state_dict().items()})
    reference = train_reference("cnn-digits", steps=8, batch_size=16, seed=3)
    assert_matches([float(x) for x in losses if x is not None], weights, reference)
