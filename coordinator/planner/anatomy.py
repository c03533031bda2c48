"""Where a step's time goes, per stage member: predicted for a plan, measured in a run.

A plan's step is ``(M - 1) * tau + sum(T) + sum(C) + P + R`` (the spec's shape, over the
spec's terms or the internal model's: :mod:`coordinator.planner.score`,
:mod:`coordinator.planner.predict`): ``M`` microbatches, ``T_s`` a stage's time per
microbatch, ``C_s`` a link's, ``tau`` the largest of them (the bottleneck), ``P`` what
each step pays once (fixed costs per step, reports, labels) and ``R`` the slowest
group's sum of gradients (version 2). Every member of every stage lives that whole
step, and this module says what it spends it on, in six parts that add up to it:

- ``compute``: its own units on its share of the rows, ``M * c`` (``c`` its seconds per
  microbatch, without the fixed part);
- ``fixed``: the fixed costs it pays, ``M * f_s + P`` (``f_s`` the stage's fixed cost
  per microbatch: per compute block, per unit call), which do not shrink with the rows;
- ``bubble``: waiting while the pipeline fills and drains, ``sum(T) - T_s``: the time the
  other stages take on the first forward and the last backward. It shrinks only with
  fewer stages or a schedule that fills it (less what the schedule saves over 1F1B,
  [Note: another schedule] in :mod:`coordinator.planner.predict`);
- ``imbalance``: waiting on a slower neighbour in the steady state,
  ``(M - 1) * (T_max - T_s)`` (``T_max`` the slowest stage, or a U's two ends), plus, in a
  group, waiting on its slowest member, ``M * (T_s - f_s - c)``;
- ``link``: transfer not hidden behind compute: the round trips of one microbatch,
  ``sum(C)``, and, where a link is the bottleneck, ``(M - 1) * (tau - T_max)``;
- ``group_sum``: the sum of gradients not hidden behind compute, ``R`` (all of it: a
  group sums after its last backward).

So ``compute + fixed + bubble + imbalance + link + group_sum`` is the step for every
row, to rounding, and the largest part besides ``compute`` over the fleet is what a
faster plan must take back first (:meth:`Anatomy.largest_loss`).

[Note: the measured anatomy]
:func:`measured_anatomy` splits the same step as the agents lived it, from their step
reports (:class:`~edge.wire.messages.StepReport`): each member's period (from its
step's start to its next step's start, so what it does between steps counts) is

- ``compute``: its ``compute_s`` (its units, the loss and the optimizer step, with
  whatever fixed part they carry: a measurement cannot tell it apart);
- ``group_sum``: its ``allreduce_s``;
- ``link``: its blocking sends (encoding and publishing), and the part of each wait
  for a tensor after the neighbour began sending it (the neighbour's ``timeline``
  says when: clocks must agree, as on one host or under NTP; a group's sender is its
  member that began last);
- ``bubble`` and ``imbalance``: the rest of its waits, waiting on a neighbour that was
  still computing. The pipeline's fill and drain cost a member what they cost it in
  the prediction, at the stage times measured: ``sum(T) - T_s``, ``T`` each stage's
  ``compute_s`` per microbatch (its slowest member's); that much of its waiting is
  ``bubble`` (no more than it waited), the rest ``imbalance``. So the two parts mean
  the same in a prediction and in a measurement, and can be compared;
- ``fixed``: what is left of the period: loading data, bookkeeping, the report.

So the parts add up to each member's period exactly, and the test of the measurement
is that the periods agree with the step the pipeline makes (stage 0's) and that the
parts agree with the prediction's. A report without a timeline (an older agent) has
its whole ``wait_s`` split as waiting on a neighbour.

Tested in tests/unit/coordinator/planner/test_anatomy.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from coordinator.planner.score import Plan, PlanScore, member_seconds
from coordinator.planner.terms import ordered_sum
from edge.problem import PlanningProblem
from edge.wire.messages import StepReport
from edge.wire.timeline import Interval, parse_timeline

if TYPE_CHECKING:
    from coordinator.planner.predict import Prediction

__all__ = [
    "LINK_PARTS",
    "PARTS",
    "Anatomy",
    "AnatomyMeter",
    "MemberAnatomy",
    "StepTerms",
    "anatomy",
    "link_share",
    "measured_anatomy",
]

PARTS = ("compute", "fixed", "bubble", "imbalance", "link", "group_sum")
"""The parts of a step, in the order they are shown."""
LINK_PARTS = ("link", "group_sum")
"""The parts of a step that its links take."""


def link_share(fractions: Mapping[str, float]) -> float:
    """The share of a step on its links, from an anatomy's :meth:`Anatomy.fractions`."""
    return sum(fractions[p] for p in LINK_PARTS)


@dataclass(frozen=True)
class StepTerms:
    """A plan's priced terms, whoever priced them (the spec's score or the internal model)."""

    microbatches: int
    member_s: list[list[float]]
    """Per stage, per member: its compute per microbatch at its share of the rows,
    without fixed costs."""
    fixed_s: list[float]
    """Per stage: its fixed cost per microbatch (0 where the devices announced none)."""
    link_s: list[float]
    """Per link: per microbatch, both directions (``C_s``)."""
    per_step_s: float
    """What each step pays once (``P``)."""
    allreduce_s: list[float]
    """Per stage: its group's sum of gradients per step (0 for one device)."""
    sums: bool
    """Whether the step waits for the groups' sums (a version 2 problem)."""
    schedule_saving_s: float = 0.0
    """What the schedule's order takes off 1F1B's step (ZB-H1's weight passes filling the
    drain): out of the bubble ([Note: another schedule] in
    :mod:`coordinator.planner.predict`)."""

    @classmethod
    def of_score(cls, problem: PlanningProblem, score: PlanScore) -> StepTerms:
        """The spec's terms of ``score`` (a score of ``plan`` over ``problem``): no fixed
        costs; a member computes its share of the rows at its own speed."""
        members = member_seconds(problem, score)
        return cls(
            microbatches=problem.microbatches,
            member_s=members,
            fixed_s=[0.0] * len(score.plan.stages),
            link_s=list(score.link_s),
            per_step_s=0.0,
            allreduce_s=list(score.allreduce_s),
            sums=score.version == 2,
        )

    @classmethod
    def of_prediction(cls, problem: PlanningProblem, prediction: Prediction) -> StepTerms:
        """The internal model's terms (:func:`coordinator.planner.predict.predict`)."""
        return cls(
            microbatches=problem.microbatches,
            member_s=[list(m) for m in prediction.member_s],
            fixed_s=list(prediction.fixed_s),
            link_s=list(prediction.link_s),
            per_step_s=prediction.per_step_s,
            allreduce_s=list(prediction.allreduce_s),
            sums=problem.version == 2,
            schedule_saving_s=prediction.schedule_saving_s,
        )


@dataclass(frozen=True)
class MemberAnatomy:
    """One member of one stage: seconds of the step in each part (:data:`PARTS`)."""

    stage: int
    device: str
    compute: float
    fixed: float
    bubble: float
    imbalance: float
    link: float
    group_sum: float

    @property
    def total(self) -> float:
        return ordered_sum(getattr(self, p) for p in PARTS)


@dataclass(frozen=True)
class Anatomy:
    """A step's time, and each member's parts of it."""

    step_time_s: float
    members: list[MemberAnatomy]

    def totals(self) -> dict[str, float]:
        """Each part summed over every member: device-seconds per step."""
        return {p: ordered_sum(getattr(m, p) for m in self.members) for p in PARTS}

    def fractions(self) -> dict[str, float]:
        """Each part's share of the fleet's device-seconds per step."""
        totals = self.totals()
        whole = ordered_sum(totals.values())
        return {p: (t / whole if whole > 0 else 0.0) for p, t in totals.items()}

    def largest_loss(self) -> str:
        """The part besides ``compute`` that costs the fleet most device-seconds."""
        totals = self.totals()
        return max(PARTS[1:], key=lambda p: totals[p])

    def to_json(self) -> dict[str, Any]:
        return {
            "step_time_s": self.step_time_s,
            "parts": list(PARTS),
            "members": [asdict(m) for m in self.members],
            "fractions": self.fractions(),
            "largest_loss": self.largest_loss(),
        }


def anatomy(plan: Plan, terms: StepTerms) -> Anatomy:
    """The anatomy of ``plan``'s step priced by ``terms`` (see the module docstring)."""
    m = terms.microbatches
    stage_s = [
        max(times) + fixed for times, fixed in zip(terms.member_s, terms.fixed_s, strict=True)
    ]
    both = [stage_s[0] + stage_s[-1]] if plan.u_shaped else []
    slowest = max(stage_s + both)
    tau = max([slowest, *terms.link_s])
    sums = terms.allreduce_s + ([terms.allreduce_s[0] + terms.allreduce_s[-1]] if both else [])
    group_sum = max(sums) if terms.sums else 0.0
    filled, crossed = ordered_sum(stage_s), ordered_sum(terms.link_s)
    saving = terms.schedule_saving_s
    step = (m - 1) * tau + filled + crossed + terms.per_step_s + group_sum - saving
    members = []
    for s, (st, times) in enumerate(zip(plan.stages, terms.member_s, strict=True)):
        # The schedule's saving comes out of the bubble; past it (a member with little
        # bubble), out of its imbalance.
        bubble = filled - stage_s[s] - saving
        for device, c in zip(st.devices, times, strict=True):
            members.append(
                MemberAnatomy(
                    stage=s,
                    device=device,
                    compute=m * c,
                    fixed=m * terms.fixed_s[s] + terms.per_step_s,
                    bubble=max(0.0, bubble),
                    imbalance=(m - 1) * (slowest - stage_s[s])
                    + m * (stage_s[s] - terms.fixed_s[s] - c)
                    + min(0.0, bubble),
                    link=crossed + (m - 1) * (tau - slowest),
                    group_sum=group_sum,
                )
            )
    return Anatomy(step_time_s=step, members=members)


_SENDER = {"A": -1, "G": +1}
"""Which neighbour sends what a stage waits for (labels come from stage 0)."""


def measured_anatomy(reports: Sequence[StepReport], step: int) -> Anatomy:
    """The anatomy of step ``step`` as the members lived it ([Note: the measured
    anatomy]): ``reports`` holds every member's report of that step, and of the next
    where there is one (for the periods). Its step time is stage 0's first member's
    period. ``ValueError`` if a member's report of ``step`` is missing a timeline
    that cannot be read."""
    now = {(r.stage, r.member): r for r in reports if r.step == step}
    later = {(r.stage, r.member): r for r in reports if r.step == step + 1}
    if not now:
        raise ValueError(f"no report of step {step}")
    timelines = {key: parse_timeline(r.timeline) for key, r in now.items()}  # once each
    began = _began_sending(now, timelines)
    per_mb: dict[int, float] = {}  # T_s: each stage's slowest member's, per microbatch
    for (stage, _), r in now.items():
        count = max(1, r.actions.count("F"))
        per_mb[stage] = max(per_mb.get(stage, 0.0), r.compute_s / count)
    filled = ordered_sum(per_mb.values())
    members = []
    for (stage, member), r in sorted(now.items()):
        nxt = later.get((stage, member))
        period = nxt.started_at - r.started_at if nxt is not None else r.step_s
        parts = dict.fromkeys(PARTS, 0.0)
        parts["compute"], parts["group_sum"] = r.compute_s, r.allreduce_s
        timeline = timelines[(stage, member)]
        waited = 0.0 if timeline else r.wait_s  # on a neighbour still computing
        for i in timeline:
            if i.op == "s":
                parts["link"] += i.seconds
                continue
            sender = 0 if i.what == "L" else stage + _SENDER[i.what]
            sent = began.get((sender, i.what, i.microbatch))
            start, end = r.started_at + i.start_s, r.started_at + i.end_s
            on_wire = 0.0 if sent is None else min(i.seconds, max(0.0, end - max(start, sent)))
            parts["link"] += on_wire
            waited += i.seconds - on_wire
        parts["bubble"] = min(waited, max(0.0, filled - per_mb[stage]))
        parts["imbalance"] = waited - parts["bubble"]
        parts["fixed"] = period - ordered_sum(v for k, v in parts.items() if k != "fixed")
        members.append(MemberAnatomy(stage=stage, device=r.device, **parts))
    first = min(now)
    nxt = later.get(first)
    ref = now[first]
    step_s = nxt.started_at - ref.started_at if nxt is not None else ref.step_s
    return Anatomy(step_time_s=step_s, members=members)


def _began_sending(
    reports: dict[tuple[int, int], StepReport], timelines: dict[tuple[int, int], list[Interval]]
) -> dict[tuple[int, str, int], float]:
    """For each stage, tensor kind and microbatch its members sent, when the last of them
    began sending it (Unix seconds): the index a wait is looked up in."""
    out: dict[tuple[int, str, int], float] = {}
    for (stage, member), timeline in timelines.items():
        zero = reports[(stage, member)].started_at
        for i in timeline:
            if i.op == "s":
                key = (stage, i.what, i.microbatch)
                out[key] = max(out.get(key, zero + i.start_s), zero + i.start_s)
    return out


class AnatomyMeter:
    """A run's measured anatomy as its step reports arrive: each step whose every member
    reported it and the next step (for the periods) is measured (:func:`measured_anatomy`),
    and :meth:`mean` is the mean over those steps. The first ``warmup`` steps (the
    run's first, or an attempt's after a restore) are left out, and only the reports of
    steps not yet measured are kept: a bounded buffer."""

    def __init__(self, members: int, *, warmup: int = 1) -> None:
        self.members = members
        self.warmup = warmup
        self._reports: dict[int, dict[tuple[int, int], StepReport]] = {}
        self._first: int | None = None
        self._count = 0
        self._sum: Anatomy | None = None  # each part summed over the steps measured

    def add(self, report: StepReport) -> bool:
        """Take one member's report of one step; whether a step was measured."""
        if self._first is None:
            self._first = report.step
        if report.step < self._first + self.warmup:
            return False
        self._reports.setdefault(report.step, {})[(report.stage, report.member)] = report
        measured = False
        for step in sorted(self._reports):
            after = self._reports.get(step + 1, {})
            if len(self._reports[step]) < self.members or len(after) < self.members:
                continue
            both = [*self._reports[step].values(), *after.values()]
            got = measured_anatomy(both, step)
            self._sum = got if self._sum is None else _summed(self._sum, got)
            self._count += 1
            del self._reports[step]
            measured = True
        for step in [k for k in self._reports if k < max(self._reports) - 4]:
            del self._reports[step]  # a step some member never reported: not waited for
        return measured

    def finish(self) -> None:
        """The run ended: measure each step every member reported that no next step
        followed (its period is its own ``step_s``), and drop what stays incomplete."""
        for step in sorted(self._reports):
            if len(self._reports[step]) == self.members:
                got = measured_anatomy(list(self._reports[step].values()), step)
                self._sum = got if self._sum is None else _summed(self._sum, got)
                self._count += 1
        self._reports.clear()

    @property
    def steps(self) -> int:
        """How many steps were measured."""
        return self._count

    def mean(self) -> Anatomy | None:
        """The mean anatomy of the steps measured (``None`` before the first)."""
        if self._sum is None:
            return None
        return _scaled(self._sum, self._count)


def _summed(a: Anatomy, b: Anatomy) -> Anatomy:
    """Two anatomies of one plan, part by part added."""
    return Anatomy(
        step_time_s=a.step_time_s + b.step_time_s,
        members=[
            MemberAnatomy(
                stage=x.stage, device=x.device, **{p: getattr(x, p) + getattr(y, p) for p in PARTS}
            )
            for x, y in zip(a.members, b.members, strict=True)
        ],
    )


def _scaled(total: Anatomy, count: int) -> Anatomy:
    """A sum of ``count`` anatomies as their mean."""
    return Anatomy(
        step_time_s=total.step_time_s / count,
        members=[
            MemberAnatomy(
                stage=m.stage, device=m.device, **{p: getattr(m, p) / count for p in PARTS}
            )
            for m in total.members
        ],
    )
