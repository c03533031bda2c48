"""A stage group's gradient sum over MQTT, measured against the planner's ring model.

For each group size ``g`` and gradient size ``P`` (fp32 bytes) the bench starts
``g`` members, each an :class:`~edge.transport.mqtt.MqttTransport` whose stage
frames pass an emulated link of ``--mbps`` Mbit/s and ``--latency-ms`` each way
(software shaping, :mod:`edge.transport.shaping`), all through one Mosquitto on
127.0.0.1, and times :meth:`edge.runtime.group_sum.GroupSum.sum` (the
reduce-scatter then all-gather of [Note: groups on the wire]) for ``--steps``
steps after one untimed step. A step's time is its slowest member's. It prints,
and with ``--json`` writes, the median beside the planner's prediction for the
same link (``shared/spec/planning-v2.md``'s ring term):

    R = 2 (g - 1) * latency + 2 (g - 1) / g * P * 8 / bandwidth

and each member's bytes sent per step beside what the contract says it sends
(``P``: its reduce-scatter chunks and its summed chunk once, [Note: the
all-gather is one publish] in :mod:`edge.runtime.group_sum`) and the ring's
``2 (g - 1) / g * P``, which is still what each member's link receives. Over a
broker every transfer crosses two emulated links (the sender's up, the
receiver's down), so the latency part is paid twice; the bandwidth part is
not, as chunks travel in pieces that the two links pass concurrently ([Note:
pieces of a chunk] in :mod:`edge.runtime.group_sum`). The bench runs well under
a minute with its defaults; ``--mbps 10000 --latency-ms 0`` all but takes the
links away and leaves the sum's CPU.

    .venv/bin/python bench/group_reduce.py [--mbps 100] [--latency-ms 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from coordinator.engine.spec import JobSpec
from coordinator.local.owned import start_owned_broker
from edge.runtime.group_sum import GroupSum
from edge.transport.inbox import Inbox
from edge.transport.mqtt import MqttSettings, MqttTransport
from edge.wire.groups import sum_traffic
from edge.wire.messages import StageAssignment
from edgetrain.cli.signals import exit_on_sigterm

RESULTS = Path(__file__).resolve().parent / "results" / "group_reduce.json"
JOB = "bench-group"


def predicted_s(g: int, nbytes: int, mbps: float, latency_ms: float) -> float:
    """The spec's ring all-reduce term for ``g`` members on identical links."""
    return 2 * (g - 1) * latency_ms / 1e3 + 2 * (g - 1) / g * nbytes * 8 / (mbps * 1e6)


def _assignment(g: int, member: int) -> StageAssignment:
    spec = JobSpec(model="mlp", steps=1_000, batch_size=2 * g, microbatches=1, seed=0)
    return StageAssignment.for_stage(
        spec,
        job=JOB,
        stage=0,
        num_stages=2,
        start=0,
        end=1,
        dataset="digits",
        dataset_options={},
        member=member,
        group_samples=((2,) * g, (2 * g,)),
        recv_timeout_s=120.0,
    )


def measure(
    url: str, g: int, numel: int, steps: int, mbps: float, latency_ms: float
) -> dict[str, Any]:
    """Median seconds per sum (slowest member) and bytes each member sent per step."""
    settings = MqttSettings(url=url, link_mbps=mbps, link_latency_ms=latency_ms)
    transports = [MqttTransport(settings) for _ in range(g)]
    try:
        for t in transports:
            t.connect(timeout=15)
        members = []
        for m, t in enumerate(transports):
            a = _assignment(g, m)
            param = torch.nn.Parameter(torch.zeros(numel))
            param.grad = torch.full((numel,), float(m + 1))
            summer = GroupSum(a, t, [param])
            inbox = t.attach(JOB, 0, m, members=g)
            inbox.expect(summer.expected, microbatches=1, step=0, members=g)
            members.append((summer, inbox, param))
        times: list[float] = []
        sent: list[int] = []
        for step in range(steps + 1):
            took = [0.0] * g
            start = threading.Barrier(g)
            threads = [
                threading.Thread(
                    target=_one_sum, args=(members[m], m, step, start, took), daemon=True
                )
                for m in range(g)
            ]
            try:
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
            finally:  # a SIGTERM between two starts: the started ones stop waiting
                start.abort()
            want = float(g * (g + 1) // 2)
            grads = [p.grad for _, _, p in members]
            assert all(t is not None and bool(torch.all(t == want)) for t in grads), "wrong sum"
            if step:  # the first step warms the links and the broker up
                times.append(max(took))
                sent.append(members[0][0].bytes_sent)
        return {"median_s": statistics.median(times), "bytes_sent": sent[-1]}
    finally:
        for t in transports:
            t.close()


def _one_sum(
    member: tuple[GroupSum, Inbox, torch.nn.Parameter],
    m: int,
    step: int,
    start: threading.Barrier,
    took: list[float],
) -> None:
    """Member ``m``'s sum of ``step``, its gradients reset first; seconds into ``took``."""
    summer, inbox, param = member
    param.grad = torch.full((param.numel(),), float(m + 1))
    try:
        start.wait()
    except threading.BrokenBarrierError:  # the run is stopping
        return
    t0 = time.perf_counter()
    summer.sum(inbox, step, None)
    took[m] = time.perf_counter() - t0
    inbox.forget_before(step + 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mbps", type=float, default=100.0)
    parser.add_argument("--latency-ms", type=float, default=5.0)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", action="store_true", help=f"also write {RESULTS}")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="edgetrain-bench-") as tmp:
        broker = start_owned_broker(Path(tmp) / "broker", secure=False, prefer="mosquitto")
        try:
            for g in (2, 3, 4):
                for mib in (1, 4):
                    numel = mib * (1 << 20) // 4
                    got = measure(broker.url, g, numel, args.steps, args.mbps, args.latency_ms)
                    nbytes = numel * 4
                    pred = predicted_s(g, nbytes, args.mbps, args.latency_ms)
                    rows.append(
                        {
                            "members": g,
                            "gradient_mib": mib,
                            "measured_s": got["median_s"],
                            "predicted_s": pred,
                            "measured_over_predicted": got["median_s"] / pred,
                            "bytes_sent_per_member": got["bytes_sent"],
                            "contract_bytes_per_member": sum_traffic(g)[0] * nbytes,
                            "ring_bytes_per_member": 2 * (g - 1) / g * nbytes,
                        }
                    )
                    r = rows[-1]
                    print(
                        f"g={g} P={mib} MiB: {r['measured_s']:.3f} s measured, "
                        f"{pred:.3f} s predicted (x{r['measured_over_predicted']:.2f}); "
                        f"{r['bytes_sent_per_member'] / 2**20:.3f} MiB sent per member "
                        f"(contract: {r['contract_bytes_per_member'] / 2**20:.3f}, "
                        f"ring: {r['ring_bytes_per_member'] / 2**20:.3f})"
                    )
        finally:
            broker.stop()
    if args.json:
        RESULTS.parent.mkdir(exist_ok=True)
        link = {"mbps": args.mbps, "latency_ms": args.latency_ms, "steps": args.steps}
        RESULTS.write_text(json.dumps({"link": link, "rows": rows}, indent=2) + "\n")
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    exit_on_sigterm()  # a stopped run stops the broker and agents it started
    main()
