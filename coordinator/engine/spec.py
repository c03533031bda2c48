"""Running a training job: from a plan to stage assignments, stages to results.

A :class:`JobSpec` says what to train; :func:`make_assignments` turns it and a
plan into one :class:`~edge.wire.messages.StageAssignment` per stage; a
:class:`JobMonitor` folds the stages' events into losses, timings and a
failure, if any; a :class:`JobResult` holds the per-step losses, the per-stage
step reports and the trained weights of the whole model. The runners that use
them are in :mod:`coordinator.engine.runners`.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Protocol

import safetensors.torch
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from coordinator.planner.score import Plan
from edge.config import RecvTimeout, ReplicateEvery, TrainConfig
from edge.errors import UserError
from edge.runtime.stage import batchnorm_in, group_batchnorm_error
from edge.wire.groups import split_samples
from edge.wire.messages import (
    StageAssignment,
    StageDone,
    StageFailed,
    StageReady,
    StepReport,
)

log = logging.getLogger("edgetrain.engine")

__all__ = [
    "DataPlacement",
    "JobAborted",
    "JobAccess",
    "JobFailed",
    "JobMonitor",
    "JobResult",
    "JobSpec",
    "batchnorm_units",
    "group_samples",
    "largest_message_bytes",
    "make_assignments",
    "new_job_id",
    "u_tail",
]


class DataPlacement(BaseModel):
    """Where a job's data lives: ``local``, on the devices that hold it, which form stage
    0's group ([Note: local data] in :mod:`edge.models.local_data`;
    :mod:`coordinator.planner.holders`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """The name the holders registered it under (``edgetrain agent --data NAME=SPEC``)."""
    placement: Literal["local"] = "local"
    min_local_units: int = Field(default=1, ge=1)
    """Units every holder runs on its own samples before anything leaves it."""
    labels: Literal["central", "local"] = "central"
    """``local``: the labels never leave their holders either. The last units and the
    loss run on the holders too, each on its own samples (the plan is U-shaped:
    holders, helpers, holders; [Note: labels stay home] in :mod:`edge.runtime.stage`);
    ``central``: the last stage, on a helper, takes the labels from the holders."""

    @property
    def labels_local(self) -> bool:
        return self.labels == "local"


class JobSpec(TrainConfig):
    """What to train and how (:class:`~edge.config.TrainConfig`, with the engine's own
    settings on top); the plan says where."""

    recv_timeout_s: RecvTimeout = 120.0
    pin_first: str | None = None
    """The device that must run stage 0 (it holds the data); planning only."""
    partition: Literal["plan", "even"] = "plan"
    """How the units are split: ``plan``, the planner's best plan; ``even``, the same number
    of units on each device (:mod:`coordinator.planner.partition`); planning only."""
    stages: int | None = Field(default=None, ge=1)
    """Exactly this many stages (``None``: what the partition gives), each on a device or,
    where the planner places groups, a group of devices; planning only. A re-plan over
    fewer survivors plans as many as survive."""
    replicate_every: ReplicateEvery = 0
    """Fault tolerance in the service: replicate every stage's state every R steps
    (0: off). Such a job survives devices dying and the coordinator restarting."""
    group_sizes: tuple[Annotated[int, Field(ge=1)], ...] | None = Field(default=None, min_length=1)
    """With ``partition="even"``: how many devices each stage runs on, in stage order (their
    sum is the number of devices); a stage of several trains data-parallel, each member
    on a share of every microbatch by its speed ([Note: groups on the wire]). Planning only."""
    objective: Literal["time", "energy"] = "time"
    """What the planner minimises: the step time, or the energy per step (from the
    devices' power figures: predictions); planning only."""
    max_step_time_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """Only plans whose predicted step time is at most this; planning only."""
    unit_times: Literal["host", "devices"] = "host"
    """Where the cost model's seconds of each unit come from: ``host``, the coordinator's
    machine, scaled to each device by its matmul rate; ``devices``, each device times
    the units itself before the job is planned, under its own limits (once per device,
    model and batch shape; [Note: a device's own unit seconds] in
    :mod:`coordinator.engine.unit_profiles`): a slower start, a closer prediction where
    a device differs from the host unit by unit. Planning only."""
    faults: tuple[str, ...] = ()
    """Faults the service injects into this job (``kill:STAGE@STEP`` and the other forms
    of :mod:`coordinator.engine.faults`); for testing fault tolerance, so only with it."""

    data: DataPlacement | None = None
    """Data that stays home: the job trains on the union of every online holder's local
    dataset of that name (its model's dataset then only says what samples look like)."""

    @model_validator(mode="after")
    def _check_groups(self) -> JobSpec:
        if self.data is not None:
            if self.partition != "plan" or self.group_sizes is not None:
                raise ValueError("local data needs partition plan: the holders are stage 0")
            if self.pin_first is not None:
                raise ValueError("local data places stage 0 on its holders: no pin_first")
            if self.data.labels_local and (self.replicate_every or self.faults):
                raise ValueError(
                    'labels "local" cannot be combined with fault tolerance yet '
                    "(replicate_every, faults)"
                )
        sizes = self.group_sizes
        if sizes is not None:
            if self.partition != "even":
                raise ValueError("group_sizes needs partition even")
            if self.stages is not None and self.stages != len(sizes):
                raise ValueError(f"stages={self.stages}, but group_sizes has {len(sizes)} stages")
        return self


class JobFailed(RuntimeError):
    """A stage reported a failure, or the job timed out."""


class JobAborted(JobFailed):
    """The caller's ``abort`` check gave a reason to stop (e.g. a device died)."""


_MQTT_MAX = 268_435_455  # MQTT's own limit on one packet


def largest_message_bytes(spec: JobSpec) -> int:
    """An upper bound on any one MQTT message of ``spec``, for a broker started for it.

    The largest is either a tensor frame (one microbatch's activations or gradients
    after any unit, at fp32) or a stage's state (its weights with the optimizer's state,
    at most two more copies of them: AdamW), each bounded here by the whole model's;
    with a margin for headers and metadata. MQTT's own limit when the model cannot be
    profiled here.
    """
    from edge.models.unit_costs import profile_model
    from edge.models.zoo import get_model

    try:
        model = get_model(spec.model, seed=spec.seed, **spec.model_options)
        microbatch = max(1, spec.batch_size // spec.microbatches)
        units = profile_model(model, microbatch, timing=False).units
    except Exception:  # a user model that will fail later, with its own message
        return _MQTT_MAX
    frame = max(u.out_bytes for u in units)
    state = 3 * sum(u.param_bytes for u in units)
    return min(_MQTT_MAX, int(1.25 * max(frame, state)) + (1 << 20))


def new_job_id() -> str:
    return "j" + secrets.token_hex(6)


def group_samples(
    spec: JobSpec, plan: Plan, shares: Sequence[Sequence[float]] | None = None
) -> tuple[tuple[int, ...], ...] | None:
    """Per stage, each member's samples of a microbatch (:func:`edge.wire.groups.split_samples`
    of its ``shares``, equal ones if ``None``); ``None`` when no stage is a group. A share
    too small for one sample is a :class:`~edge.errors.UserError`."""
    if not plan.grouped:
        return None
    stages = plan.stages
    shares = shares if shares is not None else [[1.0] * len(st.devices) for st in stages]
    if len(shares) != len(stages):
        raise ValueError(f"{len(shares)} stages of shares for a plan of {len(stages)}")
    n = spec.batch_size // spec.microbatches
    out = []
    for s, (st, ours) in enumerate(zip(stages, shares, strict=True)):
        if len(ours) != len(st.devices):
            raise ValueError(f"stage {s}: {len(ours)} shares for {len(st.devices)} devices")
        try:
            out.append(tuple(split_samples(n, ours)))
        except ValueError as exc:
            raise UserError(f"stage {s}: {exc}") from None
    return tuple(out)


def make_assignments(
    job: str,
    spec: JobSpec,
    plan: Plan,
    *,
    first_step: int = 0,
    replicate_every: int = 0,
    restore: bool = False,
    shares: Sequence[Sequence[float]] | None = None,
    handover: bool = False,
) -> list[StageAssignment]:
    """One assignment per device of ``plan``, stage by stage (a group's members in its
    order); each link uses the plan's codec for it (``plan.codecs``), else ``spec.codec``
    (fp32 for ``auto``). A group's members split each microbatch by ``shares`` (per
    stage, per member; equal if ``None``), see :func:`group_samples`.

    ``first_step``, ``replicate_every`` and ``restore`` are for fault tolerance
    (:mod:`coordinator.engine.resilient`): start at that step, publish the stage's state
    every that many steps, load the state published for the stage before starting.
    With ``spec.data``, stage 0's devices are the holders, each reading its own samples
    (``shares`` for stage 0 then follow the holders' data, not their speed).
    With ``labels`` local the plan must be U-shaped (:func:`u_tail`): its last stage's
    devices read their own labels too, and no stage sends any.
    ``handover`` (for a plan with groups) has every stage keep its previous step's state,
    so the survivors of a group can hand over ([Note: a group member dies] in
    :mod:`coordinator.engine.handover`).
    """
    dataset, options = spec.resolve_data()
    stages = plan.stages
    default = spec.link_codec
    links = list(plan.codecs) if plan.codecs else [default] * (len(stages) - 1)
    if len(links) != len(stages) - 1:
        raise ValueError(f"the plan has {len(links)} link codecs for {len(stages) - 1} links")
    samples = group_samples(spec, plan, shares)
    if samples is not None:
        _refuse_batchnorm(spec, plan)
    tail = u_tail(spec, plan)
    if tail is not None and samples is not None and samples[tail] != samples[0]:
        raise ValueError(
            f"the holders' samples of a microbatch differ at the two ends: "
            f"{list(samples[0])} and {list(samples[tail])}"
        )
    local = spec.data.name if spec.data is not None else None
    reads = {0} | ({tail} if tail is not None else set())
    out = []
    for s, st in enumerate(stages):
        for member in range(len(st.devices)):
            out.append(
                StageAssignment.for_stage(
                    spec,
                    job=job,
                    stage=s,
                    num_stages=len(stages),
                    start=st.start,
                    end=st.end,
                    dataset=dataset,
                    dataset_options=options,
                    codec_in=links[s - 1] if s > 0 else default,
                    codec_out=links[s] if s + 1 < len(stages) else default,
                    prev_device=stages[s - 1].device if s > 0 else None,
                    next_device=stages[s + 1].device if s + 1 < len(stages) else None,
                    recv_timeout_s=spec.recv_timeout_s,
                    first_step=first_step,
                    replicate_every=replicate_every,
                    restore=restore,
                    member=member,
                    group_samples=samples,
                    handover=handover and samples is not None,
                    local_data=local if s in reads else None,
                    labels_local=tail is not None,
                )
            )
    return out


def u_tail(spec: JobSpec, plan: Plan) -> int | None:
    """With ``labels`` local, the stage where the holders take the model back: the last
    of a U-shaped plan (holders, helpers, holders: the same devices in the same order at
    both ends, no holder in between); ``None`` otherwise, and for the holders alone (one
    stage, which reads its labels anyway). Any other plan is a :class:`ValueError`."""
    local = spec.data is not None and spec.data.labels_local
    if plan.u_shaped and not local:
        raise ValueError('a U-shaped plan is for labels "local" only')
    if not local or len(plan.stages) == 1:
        return None
    first, last = plan.stages[0].devices, plan.stages[-1].devices
    middle = {d for st in plan.stages[1:-1] for d in st.devices}
    if not plan.u_shaped or len(plan.stages) < 3 or first != last or middle & set(first):
        raise ValueError(
            'labels "local" needs a U-shaped plan: the holders, helpers, then the same '
            f"holders in the same order (got {[list(st.devices) for st in plan.stages]})"
        )
    return len(plan.stages) - 1


def batchnorm_units(spec: JobSpec) -> frozenset[int] | None:
    """The units of ``spec``'s model that hold BatchNorm (which no group may train, see
    :func:`~edge.runtime.stage.group_batchnorm_error`); ``None`` for a user model that
    cannot be built here. Built on the meta device: no weights are made."""
    from edge.models.zoo import get_model

    try:
        model = get_model(spec.model, seed=spec.seed, **spec.model_options)
        with torch.device("meta"):
            return frozenset(
                i for i in range(model.num_units) if batchnorm_in(model.build_segment(i, i + 1))
            )
    except Exception:  # a user model: its stages check when they build it
        return None


def _refuse_batchnorm(spec: JobSpec, plan: Plan) -> None:
    """A group's stage must not hold BatchNorm: its statistics would be over a member's
    share of each microbatch, so the step would differ from single-device training (the
    stage runtime refuses it too; here it fails before anything is sent)."""
    from edge.models.zoo import get_model

    try:
        model = get_model(spec.model, seed=spec.seed, **spec.model_options)
    except Exception:  # a user model: its stages check when they build it
        return
    for s, st in enumerate(plan.stages):
        if len(st.devices) > 1:
            with torch.random.fork_rng(devices=[]):
                segment = model.build_segment(st.start, st.end)
            norm = batchnorm_in(segment)
            if norm is not None:
                raise UserError(group_batchnorm_error(s, len(st.devices), norm))


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

    def stage_summary(self) -> list[dict[str, float]]:
        """Per stage, totals over the job: compute, waiting, sending, bytes."""
        out = []
        for s in range(len(self.plan.stages)):
            rs = [r for r in self.reports if r.stage == s]
            out.append(
                {
                    "stage": s,
                    "compute_s": sum(r.compute_s for r in rs),
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


class JobAccess(Protocol):
    """A broker whose ACLs follow the plan (``coordinator.access.BrokerAccounts``)."""

    def grant(self, job: str, stages: list[tuple[str, StageAssignment]]) -> None:
        """Let each ``(device, assignment)`` use that stage's topics, and no other job's."""
        ...

    def release(self, job: str) -> None:
        """Take back every right granted for ``job`` (nothing if none was)."""
        ...


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
