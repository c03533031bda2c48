"""Watching a job's stages: :class:`JobMonitor` folds their events into a :class:`JobResult`.

A :class:`JobMonitor` counts an event only from the device that holds its stage, and
folds the stages' events into losses, timings and a failure, if any (a
:class:`JobFailed`, or a :class:`JobAborted` when the caller gave a reason to stop); a
:class:`JobResult` holds the per-step losses, the per-stage step reports and the
trained weights of the whole model. The runners that use them are in
:mod:`coordinator.engine.runners`.

Tested in tests/unit/coordinator/engine/test_senders.py (who an event counts from, a
group's final weights) and, running whole jobs, tests/e2e/test_agent.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import safetensors.torch
import torch

from coordinator.engine.spec import JobSpec
from coordinator.planner.score import Plan
from edge.wire.messages import StageDone, StageFailed, StageReady, StepReport

log = logging.getLogger("edgetrain.engine")

__all__ = ["JobAborted", "JobFailed", "JobMonitor", "JobResult"]


class JobFailed(RuntimeError):
    """A stage reported a failure, or the job timed out."""


class JobAborted(JobFailed):
    """The caller's ``abort`` check gave a reason to stop (e.g. a device died)."""


@dataclass
class JobResult:
    job: str
    plan: Plan
    spec: JobSpec
    losses: list[float]
    reports: list[StepReport]
    wall_s: float
    """From the start of the first step to the end of the last."""
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    rejected: dict[str, int] = field(default_factory=dict)
    """Messages for the job that were ignored, by reason (``JobMonitor.rejected``)."""

    @property
    def samples_per_s(self) -> float:
        return self.spec.steps * self.spec.batch_size / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def compile_s(self) -> float:
        """Seconds the slowest stage member spent compiling (``compile: true``): the stages
        compile at once, in their first step, so the job's wall time holds about this."""
        spent: dict[tuple[int, int], float] = {}
        for r in self.reports:
            spent[r.stage, r.member] = spent.get((r.stage, r.member), 0.0) + r.compile_s
        return max(spent.values(), default=0.0)

    def traffic(self) -> dict[str, float]:
        """The job's payload on the wire, from every member's step reports: what the devices
        sent (to the broker, or their peers) and received, and their sum per training sample.
        Through a broker each byte crosses two links, so both count. Frames' payloads only:
        not MQTT's headers, TLS, nor the final weights and replicas sent outside the steps."""
        sent = sum(r.bytes_sent for r in self.reports)
        received = sum(r.bytes_received for r in self.reports)
        samples = self.spec.steps * self.spec.batch_size
        return {
            "bytes_sent": sent,
            "bytes_received": received,
            "samples": samples,
            "bytes_per_sample": (sent + received) / samples if samples else 0.0,
        }

    def stage_summary(self) -> list[dict[str, float]]:
        """Per stage, totals over the job: compute, compiling (``compile: true``), waiting,
        sending, bytes."""
        out = []
        for s in range(len(self.plan.stages)):
            rs = [r for r in self.reports if r.stage == s]
            out.append(
                {
                    "stage": s,
                    "compute_s": sum(r.compute_s for r in rs),
                    "compile_s": sum(r.compile_s for r in rs),
                    "wait_s": sum(r.wait_s for r in rs),
                    "send_s": sum(r.send_s for r in rs),
                    "bytes_sent": sum(r.bytes_sent for r in rs),
                    "bytes_received": sum(r.bytes_received for r in rs),
                    "frames_dropped": max((r.frames_dropped for r in rs), default=0),
                }
            )
        return out

    def weights_bytes(self) -> bytes:
        return safetensors.torch.save(self.weights)


class JobMonitor:
    """Folds one job's events into its state; safe to feed from any thread.

    Given the ``devices`` that hold the stages (per stage, its device or its group's,
    in member order), an event counts only when it came on the events topic of the
    device that holds its stage (as the member it names) and names that device: the
    sender is who the broker says, not what the payload claims. Anything else is
    ignored and counted in :attr:`rejected` by reason. :attr:`ready` and :attr:`done`
    hold ``(stage, member)`` pairs; ``group_sizes`` says how many members each stage
    has (one each by default).
    """

    def __init__(
        self,
        job: str,
        num_stages: int,
        on_step: Callable[[StepReport], None] | None = None,
        abort: Callable[[], str | None] | None = None,
        devices: Sequence[str | Sequence[str]] | None = None,
        group_sizes: Sequence[int] | None = None,
    ) -> None:
        self.job = job
        self.num_stages = num_stages
        sizes = list(group_sizes) if group_sizes is not None else [1] * num_stages
        self.members = sum(sizes)
        """Stage-member pairs that must be ready, and done."""
        self.devices = (
            [(d,) if isinstance(d, str) else tuple(d) for d in devices]
            if devices is not None
            else None
        )
        self.rejected: Counter[str] = Counter()
        self.on_step = on_step
        self.abort = abort
        """Polled while waiting (every 50 ms): a reason to stop waiting, or ``None``."""
        self.ready: set[tuple[int, int]] = set()
        self.done: set[tuple[int, int]] = set()
        self.digests: dict[tuple[int, int], str] = {}
        """SHA-256 of each member's final weights, as its ``done`` event says."""
        self.failures: list[StageFailed] = []
        self.reports: list[StepReport] = []
        self.losses: dict[int, float] = {}
        self._cond = threading.Condition()

    def reject(self, reason: str, what: str) -> None:
        """Count an ignored message (``reason`` names the check it failed) and log it."""
        with self._cond:
            self.rejected[reason] += 1
        log.warning("job %s: ignored %s (%s)", self.job, what, reason)

    def on_event(self, event: Any, sender: str | None = None) -> None:
        """Fold in ``event``, which came on ``sender``'s events topic (``None``: in process)."""
        if getattr(event, "job", None) != self.job:
            self.reject("other-job", f"an event of job {getattr(event, 'job', None)}")
            return
        if self.devices is not None:
            stage, member = event.stage, event.member
            group = self.devices[stage] if stage < len(self.devices) else ()
            holder = group[member] if member < len(group) else None
            if holder is None:
                self.reject("no-such-stage", f"a {event.type} event for stage {stage}")
                return
            if sender != holder or event.device != holder:
                self.reject(
                    "wrong-sender",
                    f"a {event.type} event for stage {stage} (held by {holder}) "
                    f"sent by {sender} as {event.device}",
                )
                return
        with self._cond:
            if isinstance(event, StageReady):
                self.ready.add((event.stage, event.member))
            elif isinstance(event, StepReport):
                self.reports.append(event)
                if event.loss is not None:
                    self.losses[event.step] = event.loss
            elif isinstance(event, StageDone):
                self.done.add((event.stage, event.member))
                if event.weights_sha256:
                    self.digests[(event.stage, event.member)] = event.weights_sha256
            elif isinstance(event, StageFailed):
                self.failures.append(event)
            self._cond.notify_all()
        if isinstance(event, StepReport) and self.on_step is not None:
            self.on_step(event)

    def _wait(self, what: Callable[[], bool], timeout: float, label: str) -> None:
        """Wait until ``what()`` holds; raise on an ``abort`` reason, a failure or the timeout.

        ``abort`` is called without the lock held: it may take seconds (a resilient run
        weighs a migration in it), and every event fed to :meth:`on_event`, on the MQTT
        client's thread, would wait for it meanwhile, heartbeats of other devices too.
        """
        deadline = time.monotonic() + timeout
        while True:
            with self._cond:
                if what():
                    return
            reason = self.abort() if self.abort is not None else None
            if reason is not None:
                raise JobAborted(f"job {self.job}: {reason}")
            with self._cond:
                if what():
                    return
                if self.failures:
                    f = self.failures[0]
                    raise JobFailed(f"stage {f.stage} on {f.device} failed: {f.error}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise JobFailed(f"job {self.job}: timed out after {timeout:.0f} s {label}")
                self._cond.wait(remaining if self.abort is None else min(remaining, 0.05))

    def wait_ready(self, timeout: float) -> None:
        self._wait(lambda: len(self.ready) == self.members, timeout, "waiting for stages")

    def wait_done(self, timeout: float) -> None:
        self._wait(lambda: len(self.done) == self.members, timeout, "waiting for the end")

    def check_same_weights(self) -> None:
        """Raise :class:`JobFailed` unless every member of a group reported the digest of
        its member 0's final weights (members step identically: they must end alike)."""
        with self._cond:
            digests = dict(self.digests)
        for (stage, member), digest in sorted(digests.items()):
            if member and digest != digests.get((stage, 0)):
                raise JobFailed(
                    f"job {self.job}: member {member} of stage {stage} ended with other "
                    "weights than member 0"
                )

    @property
    def finished(self) -> bool:
        """Whether every stage's every member reported done."""
        with self._cond:
            return len(self.done) == self.members

    def loss_list(self, steps: int) -> list[float]:
        with self._cond:
            return [self.losses[s] for s in range(steps) if s in self.losses]

    def result(
        self, spec: JobSpec, plan: Plan, wall_s: float, weights: dict[str, torch.Tensor]
    ) -> JobResult:
        """The job's result: every step's loss and every report heard, with ``weights``."""
        return JobResult(
            job=self.job,
            plan=plan,
            spec=spec,
            losses=self.loss_list(spec.steps),
            reports=self.reports,
            wall_s=wall_s,
            weights=weights,
            rejected=dict(self.rejected),
        )
