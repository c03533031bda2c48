"""A group's gradient sum through a real Mosquitto: the same bits everywhere, and what each
member publishes ([Note: the all-gather is one publish] in :mod:`edge.runtime.group_sum`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
from support.mosquitto import Broker

from coordinator.engine.spec import JobSpec
from edge.runtime.group_sum import MIN_PIECE_BYTES, GroupSum
from edge.transport.mqtt import MqttSettings, MqttTransport
from edge.wire.groups import split_samples
from edge.wire.messages import StageAssignment

pytestmark = pytest.mark.broker

G = 3
JOB = "j1"
SPEC = JobSpec(model="mlp", steps=4, batch_size=6, microbatches=1, seed=0)


def _member(m: int) -> StageAssignment:
    split = tuple(split_samples(6, [1.0] * G))
    return StageAssignment.for_stage(
        SPEC,
        job=JOB,
        stage=0,
        num_stages=2,
        start=0,
        end=1,
        dataset="digits",
        dataset_options={},
        member=m,
        group_samples=(split, (6,)),
        recv_timeout_s=30.0,
    )


@pytest.fixture
def transports(mosquitto: Broker) -> Iterator[list[MqttTransport]]:
    made = [MqttTransport(MqttSettings(url=mosquitto.url)) for _ in range(G)]
    try:
        for t in made:
            t.connect(timeout=10)
        yield made
    finally:
        for t in made:
            t.close()


def test_each_member_publishes_g_chunks_and_receives_two_g_minus_one(
    transports: list[MqttTransport],
) -> None:
    """Three members, chunks of two pieces: each publishes its ``g - 1`` reduce-scatter
    chunks and its summed chunk once (``g`` chunks, ``2 g`` frames), receives ``2 (g - 1)``
    chunks, and every member ends with the bits of the sum in member order."""
    numel = G * (MIN_PIECE_BYTES // 4 + 7)  # chunks of 2^16 + 7 elements: two pieces
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(numel, generator=gen) for _ in range(G)]
    params = [torch.nn.Parameter(torch.zeros(numel)) for _ in range(G)]
    members = []
    for m, (t, p) in enumerate(zip(transports, params, strict=True)):
        p.grad = grads[m].clone()
        summer = GroupSum(_member(m), t, [p])
        inbox = t.attach(JOB, 0, m, members=G)
        inbox.expect(summer.expected, microbatches=1, step=0, members=G)
        members.append((summer, inbox))
    assert len(members[0][0].pieces) == 2
    threads = [
        threading.Thread(target=summer.sum, args=(inbox, 0, None)) for summer, inbox in members
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    want = grads[0] + grads[1] + grads[2]  # member order, as every owner adds
    for p in params:
        assert p.grad is not None and torch.equal(p.grad, want)
    pieces = 2
    for t in transports:
        assert t.frames_sent == G * pieces  # (g - 1) reduce-scatter chunks + 1 all-gather
        assert t.frames_received == 2 * (G - 1) * pieces
        assert not t.dropped
