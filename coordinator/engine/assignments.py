"""From a job and its plan to one stage assignment per device: :func:`make_assignments`.

Each device of the plan gets a :class:`~edge.wire.messages.StageAssignment`: its
stage's units, its links' codecs, its neighbours, its share of each microbatch in a
group (:func:`group_samples`), the data it reads (stage 0's, and with local labels the
last stage of a U-shaped plan's: :func:`u_tail`). A group's stage must hold no
BatchNorm (:func:`batchnorm_units`), refused here before anything is sent.

Tested in tests/unit/coordinator/engine/test_assignments.py (codecs, local labels and
U-shaped plans) and tests/unit/coordinator/engine/test_plan_groups.py (groups,
BatchNorm, every member a sample).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from coordinator.engine.spec import JobSpec, microbatches_of
from coordinator.planner.microbatches import first_microbatches, microbatch_choices
from coordinator.planner.score import Plan
from edge.errors import UserError
from edge.runtime.stage import batchnorm_in, group_batchnorm_error
from edge.wire.groups import split_samples
from edge.wire.messages import StageAssignment

__all__ = [
    "batchnorm_units",
    "group_samples",
    "make_assignments",
    "microbatch_choices_of",
    "planning_start",
    "u_tail",
]


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
    n = spec.batch_size // microbatches_of(spec)
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
    microbatches_of(spec)  # an "auto" job runs at its plan's number: refused unplanned
    if spec.schedule == "auto":
        raise ValueError('schedule "auto" is chosen with the plan: plan the job first')
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


def microbatch_choices_of(spec: JobSpec) -> tuple[int, ...]:
    """The numbers of microbatches a job of ``spec`` may split its batch into
    (:func:`~coordinator.planner.microbatches.microbatch_choices`): each microbatch of at
    least two rows where the model has BatchNorm (a batch statistic of one row is
    none), else one."""
    return microbatch_choices(spec.batch_size, min_rows=2 if batchnorm_units(spec) else 1)


def planning_start(spec: JobSpec) -> JobSpec:
    """``spec`` at the microbatches its planning starts from: itself, unless ``auto``, then
    the first of its choices (:func:`~coordinator.planner.microbatches.first_microbatches`),
    the shape its units are timed at before the plan chooses."""
    if spec.microbatches != "auto":
        return spec
    return spec.at_microbatches(first_microbatches(microbatch_choices_of(spec)))


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
