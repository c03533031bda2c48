"""A job's partition options made into a plan: the one place the service and ``train`` plan.

A job says how its units are split (``partition``) and, optionally, into how
many stages (``stages``), with what ``codec`` and ``group_sizes`` (together its
:class:`PartitionOptions`); :func:`plan_job` turns that and a planning problem
into a scored plan:

- ``partition="plan"`` (the default): the planner's best plan
  (:func:`~coordinator.planner.solve.plan_problem`; for a version 2 problem
  :func:`~coordinator.planner.group_search.plan_groups`, which places device
  groups unless the problem says ``"groups": false``, keeps them within the
  runtime's ``limits`` and is never worse than version 1's plan under the spec's
  score); with
  ``stages=N``, its best plan of exactly ``N`` stages, under the same score
  (provably so on small fleets).
- ``partition="even"``: the units shared out as evenly as counts allow
  (:func:`~coordinator.planner.baselines.even_split`) over every device, in the
  order given with ``pin_first`` first; with ``stages=N`` (or when there are
  more devices than units, ``N`` = the units), over the ``N`` fastest devices
  (``pin_first`` always among them; ties go to the device given first), kept in
  that order. An even split that breaks a device's memory is refused, not run.
  With ``group_sizes`` (one entry per stage, adding up to the devices) the
  units are split evenly over ``len(group_sizes)`` stages, and stage ``s`` runs on
  the next ``group_sizes[s]`` devices in that order, as a group (scored as a
  version 2 plan, which gives each member its share of a microbatch).
- A re-plan that passes the ``previous`` plan, on a fleet too large for the exact
  search, warm-starts from it (:func:`~coordinator.planner.group_search.replan`,
  with groups where a version 2 problem allows them, else one-device stages: under
  a second at 64 devices x 200 units, where the full search spends its whole
  budget), unless ``stages`` or ``codec="auto"`` ask for the full search.
- Where the devices announced fixed costs (or ``units`` are given), every plan is
  also predicted by the internal model (:func:`~coordinator.planner.predict.predict`,
  :attr:`FoundPlan.prediction`), and, under the time objective, a ``plan`` job runs the
  plan it predicts fastest among the searches' plans: the search on the problem
  timed by ``units`` (:func:`~coordinator.planner.predict.timed_problem`: cut where
  the measured seconds balance, not the FLOPs), for a version 2 problem also the
  spec's own plan and the plan a version 1 job would get (so never predicted slower
  than version 1's), and their plans of fewer stages (exact searches only; on such
  a fleet the fastest is then refined by a local search under the model), a plan with
  groups only where it is predicted 10% ahead of the fastest without. See
  [Note: a job's plan by prediction]. Its score stays the spec's score of that plan.
  Under the energy objective the spec's plan stands (the model predicts no energy).
- ``codec="auto"``: each link's codec is chosen as in
  :mod:`coordinator.planner.codecs` (for ``plan``, plans are searched per codec,
  with the same stage count), and kept only when it makes the step faster.

A job on data that stays home is planned by :func:`plan_holders_job`: stage 0 on
the devices that hold the data, the rest by :func:`plan_job` over the others
(:mod:`coordinator.planner.holders`).

What cannot be done is a :class:`~edge.errors.UserError` with a one-line
reason: more stages than units or devices, or nothing of that shape that fits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal, get_args

from coordinator.planner.baselines import even_split
from coordinator.planner.codecs import choose_codecs, plan_with_codecs
from coordinator.planner.group_search import plan_groups, replan
from coordinator.planner.group_tables import GroupLimits
from coordinator.planner.holders import HolderPlans, holder_ends, plan_with_holders
from coordinator.planner.microbatches import plan_microbatches
from coordinator.planner.predict import (
    Prediction,
    UnitSeconds,
    balanced_shares,
    calibrated,
    predict,
    timed_problem,
)
from coordinator.planner.refine import refine
from coordinator.planner.score import Plan, PlanScore, Stage, for_plan, score_plan
from coordinator.planner.solve import EXACT_DEVICES, exact_capacity, plan_problem
from edge.errors import UserError
from edge.problem import DeviceSpec, PlanningProblem
from edge.profiling.fixed_costs import fixed_costs_of
from edge.wire.groups import split_samples

__all__ = [
    "PARTITIONS",
    "FoundPlan",
    "Partition",
    "PartitionOptions",
    "even_devices",
    "plan_holders_job",
    "plan_job",
    "plan_job_microbatches",
    "scored",
]

Partition = Literal["plan", "even"]
PARTITIONS: tuple[str, ...] = get_args(Partition)

_BUDGET_S = 8.0
"""The full search's time budget, shared by a job's searches beyond the exact ones."""

GROUP_MARGIN = 0.10
"""How far a plan with groups must be predicted ahead of the fastest plan without them
(as a fraction of that plan's throughput) for a job to run it; see [Note: a job's plan
by prediction]."""


@dataclass(frozen=True)
class PartitionOptions:
    """How a job asks for its units to be split (see the module docstring)."""

    partition: str = "plan"
    """``plan`` (the planner's best) or ``even``."""
    stages: int | None = None
    """Exactly this many stages; ``None``: as many as the partition gives."""
    codec: str = "fp32"
    """The links' codec, or ``auto`` to choose each link's."""
    group_sizes: tuple[int, ...] | None = None
    """With ``even``: how many devices each stage runs on, in stage order."""


@dataclass(frozen=True)
class FoundPlan:
    """A plan the planner found for a job (with its link codecs when chosen): its score,
    how it was found, and its predicted step."""

    score: PlanScore
    method: str
    exact: bool
    prediction: Prediction | None = None
    """The internal model's step (:mod:`coordinator.planner.predict`): what jobs show."""

    @property
    def plan(self) -> Plan:
        return self.score.plan


def even_devices(problem: PlanningProblem, stages: int) -> list[str]:
    """The devices of an even split into ``stages`` stages (see the module docstring)."""
    ids = [d.id for d in problem.devices]
    speed = {d.id: d.gflops for d in problem.devices}
    pin = problem.pin_first
    rest = sorted((d for d in ids if d != pin), key=lambda d: -speed[d])  # stable: ties keep order
    chosen = set(([pin] if pin is not None else []) + rest[: stages - (pin is not None)])
    return [d for d in ids if d in chosen]


def plan_job(
    problem: PlanningProblem,
    options: PartitionOptions = PartitionOptions(),
    *,
    where: str = "the devices",
    previous: Plan | None = None,
    limits: GroupLimits | None = None,
    units: UnitSeconds | None = None,
) -> FoundPlan:
    """The plan for a job split as ``options`` say over ``problem`` (see the module
    docstring).

    ``where`` names the devices in error messages ("the online devices"); ``previous``
    is the plan a re-plan replaces; ``limits`` what the runtime cannot train on a group
    (for the planner's groups; ``group_sizes`` are the caller's own); ``units`` the
    model's measured unit seconds.
    """
    searched = options.partition == "plan" and options.group_sizes is None
    simple = searched and options.codec.lower() != "auto"
    fixed = units is not None or calibrated(problem)
    # The internal model predicts time, not energy: an energy objective keeps the spec's plan.
    if simple and fixed and problem.goal.minimize == "time":
        return _fastest_predicted(problem, options.stages, where, previous, limits, units)
    found = _plan_job(problem, options, where=where, previous=previous, limits=limits)
    return replace(found, prediction=predict(problem, found.plan, units))


def _fastest_predicted(
    problem: PlanningProblem,
    stages: int | None,
    where: str,
    previous: Plan | None,
    limits: GroupLimits | None,
    units: UnitSeconds | None,
) -> FoundPlan:
    """The plan the internal model predicts fastest among the searches' plans (see
    [Note: a job's plan by prediction]), scored by the spec's score of ``problem``.

    [Note: a job's plan by prediction]
    The spec's score sees FLOPs and bytes; the internal model (:func:`predict`) sees
    measured seconds and fixed costs too, so a job is planned by searching under the
    spec's score and choosing by prediction among what the searches return:

    - the search on the timed problem (:func:`timed_problem`, with ``units``): stages
      cut where the measured seconds balance, a group's members at their shares;
    - for a version 2 problem, also the search on ``problem`` itself (the spec's own
      plan), the search on the timed problem with each link slowed by the CPU its
      bytes cost (:func:`_bytes_priced`: a group's sum then costs a slow device what
      the model says), and the plan a version 1 job gets (the same searches on
      ``problem.as_version(1)``), so that a version 2 job's plan is never predicted
      slower than version 1's;
    - for each of those found exactly, its best plans of fewer stages: each stage adds
      a link's frames and fixed costs the spec's score does not see.

    Where groups are allowed and the searches were exact (a small fleet), the fastest
    of those is then improved by a local search under the model
    (:func:`~coordinator.planner.refine.refine`): its best plan can be a neighbour of
    the score's best that no search returns.

    A plan with groups is run only where it is predicted at least :data:`GROUP_MARGIN`
    (10%) ahead of the fastest candidate without groups; otherwise that one runs. On
    the testbed (``bench/hybrid.py``, 15 fleet and model pairs) grouped plans measured
    0.69-1.10 of their prediction and pipelines 0.77-1.13: a group's sum and its
    members' small rows are the model's least certain terms, and the two grouped plans
    that measured below 0.95x version 1's had been predicted 1.01x and 1.07x ahead.

    A warm-started re-plan (``previous``, a fleet beyond the exact search) searches the
    timed problem alone: one warm start fits the re-plan's second; two do not. Every
    candidate must be feasible under the spec's score of ``problem`` (memory, deadline).
    """
    timed = timed_problem(problem, units) if units is not None else None
    searched = [timed or problem]
    warm = previous is not None and stages is None and not _exact_fleet(problem)
    if problem.version == 2 and not warm:
        searched += [problem] if timed is not None else []
        if problem.allows_groups and any(_byte_s(d) > 0 for d in problem.devices):
            searched.append(_bytes_priced(timed or problem))
        searched.append((timed or problem).as_version(1))
    budget = _BUDGET_S / len(searched)
    best: FoundPlan | None = None
    best_s = float("inf")
    flat: FoundPlan | None = None  # the fastest candidate without groups
    flat_s = float("inf")
    refused: UserError | None = None
    for q in searched:
        try:
            found = _plan_job(
                q,
                PartitionOptions(stages=stages),
                where=where,
                previous=previous,
                limits=limits,
                budget_s=budget,
            )
        except UserError as exc:
            refused = refused or exc
            continue
        fewer: list[FoundPlan] = []
        if stages is None and found.exact:
            for count in range(1, len(found.plan.stages)):
                try:
                    fewer.append(
                        _plan_job(q, PartitionOptions(stages=count), limits=limits, budget_s=budget)
                    )
                except UserError:
                    continue
        for other in (found, *fewer):
            score, guess = scored(problem, other.plan, units)
            if not score.feasible:
                continue
            if best is None or guess.step_time_s < best_s:
                best = replace(other, score=score, prediction=guess)
                best_s = guess.step_time_s
            if not other.plan.grouped and guess.step_time_s < flat_s:
                flat = replace(other, score=score, prediction=guess)
                flat_s = guess.step_time_s
    if best is None:
        raise refused or UserError(f"no plan fits {where}")
    if problem.allows_groups and stages is None and best.exact:
        plan, guess = refine(problem, best.plan, units, limits)
        if plan != best.plan:
            score, guess = scored(problem, plan, units)
            if score.feasible and guess.step_time_s < best_s:
                method = f"{best.method}, refined by the cost model"
                best = replace(best, score=score, method=method, prediction=guess)
                best_s = guess.step_time_s
    if best.plan.grouped and flat is not None and flat_s < best_s * (1 + GROUP_MARGIN):
        return flat
    return best


def plan_job_microbatches(
    problem: PlanningProblem,
    choices: Sequence[int],
    options: PartitionOptions = PartitionOptions(),
    *,
    where: str = "the devices",
    previous: Plan | None = None,
    limits: GroupLimits | None = None,
    units: UnitSeconds | None = None,
) -> tuple[PlanningProblem, FoundPlan]:
    """:func:`plan_job` with the number of microbatches chosen with the plan, among
    ``choices`` ([Note: choosing the microbatches] in
    :mod:`coordinator.planner.microbatches`): ``problem`` at the chosen number, and its
    plan scored and predicted there, its method saying so. ``units`` were timed at
    ``problem``'s microbatches."""
    found_at: dict[int, FoundPlan] = {}

    def search(q: PlanningProblem, moved: UnitSeconds | None) -> Plan:
        found_at[q.microbatches] = plan_job(
            q, options, where=where, previous=previous, limits=limits, units=moved
        )
        return found_at[q.microbatches].plan

    problem, chose = plan_microbatches(problem, units, choices, search, scored)
    found = found_at[chose.found_at]
    method = f"{found.method}, at {chose.microbatches} microbatches of {list(choices)}"
    return problem, replace(found, score=chose.score, prediction=chose.prediction, method=method)


def scored(
    problem: PlanningProblem, plan: Plan, units: UnitSeconds | None
) -> tuple[PlanScore, Prediction]:
    """``plan``'s score on ``problem`` and its prediction, its groups split by their
    members' own seconds where they timed the units ([Note: shares by a device's own
    seconds] in :mod:`coordinator.planner.predict`): the score's shares are what the job
    runs, and its memory check is at them."""
    shares = balanced_shares(problem, plan, units) if units is not None else {}
    score = score_plan(for_plan(problem, plan), plan, fixed_shares=shares or None)
    return score, predict(problem, plan, units, fixed_shares=shares or None)


def _bytes_priced(problem: PlanningProblem) -> PlanningProblem:
    """``problem`` with each device's bandwidth lowered by the CPU seconds its bytes cost
    (its announced ``byte_s`` added to each byte's time on the link), so that the spec's
    search prices a link's and a group's sum's bytes near as :func:`predict` does (a
    sum of two members exactly; of more, a little above). A search heuristic: the
    candidates it yields are judged by :func:`predict` like the others."""
    devices = []
    for d in problem.devices:
        per_byte = 8 / (d.bandwidth_mbps * 1e6) + _byte_s(d)
        devices.append(d.model_copy(update={"bandwidth_mbps": 8 / per_byte / 1e6}))
    return problem.model_copy(update={"devices": devices})


def _byte_s(device: DeviceSpec) -> float:
    """The CPU seconds a byte costs ``device`` (its announced ``byte_s``; 0 unmeasured)."""
    costs = fixed_costs_of(device)
    return 0.0 if costs is None else costs.byte_s


def _exact_fleet(problem: PlanningProblem) -> bool:
    """Whether ``problem``'s fleet is small enough for the exact search (no warm start)."""
    n_units, n_devices = len(problem.layers), len(problem.devices)
    return n_devices <= max(EXACT_DEVICES, exact_capacity(n_units))


def _plan_job(
    problem: PlanningProblem,
    options: PartitionOptions,
    *,
    where: str = "the devices",
    previous: Plan | None = None,
    limits: GroupLimits | None = None,
    budget_s: float = _BUDGET_S,
) -> FoundPlan:
    """:func:`plan_job` under the spec's score alone; a search beyond the exact ones
    spends at most ``budget_s``."""
    partition, stages = options.partition, options.stages
    if partition not in PARTITIONS:
        raise UserError(f"partition {partition!r} is not one of {', '.join(PARTITIONS)}")
    if options.group_sizes is not None:
        if partition != "even":
            raise UserError("group sizes need partition even")
        return _even_groups(problem, list(options.group_sizes), where)
    n_units, n_devices = len(problem.layers), len(problem.devices)
    if stages is not None:
        if stages < 1:
            raise UserError(f"stages={stages}: a plan has at least 1 stage")
        if stages > n_units:
            raise UserError(f"stages={stages} is more than the model's {n_units} units")
        if stages > n_devices:
            raise UserError(f"stages={stages} is more than {where} ({n_devices})")
    auto = options.codec.lower() == "auto"
    if partition == "even":
        count = min(n_devices, n_units) if stages is None else stages
        ids = even_devices(problem, count)
        subset = problem.model_copy(update={"devices": [d for d in problem.devices if d.id in ids]})
        plan = even_split(subset)
        score = score_plan(problem, plan)
        if not score.feasible:
            raise UserError(
                f"the even split over {count} devices does not fit {where}: {score.reasons[0]}"
            )
        if auto and len(plan.stages) > 1:
            coded = replace(plan, codecs=tuple(choose_codecs(problem, plan)))
            scored = score_plan(for_plan(problem, coded), coded)
            if scored.feasible and scored.step_time_s < score.step_time_s:
                score = scored
        return FoundPlan(score, f"even split over {count} devices", False)
    exact = _exact_fleet(problem)
    if previous is not None and stages is None and not auto and not exact:
        # A version 1 problem's stages are one device each: so are its re-plan's.
        warm_problem = problem
        if problem.version == 1:
            warm_problem = problem.as_version(2).model_copy(update={"groups": False})
        warm = replan(warm_problem, previous, limits=limits)
        if warm.score is not None:
            return FoundPlan(score_plan(problem, warm.score.plan), warm.method, False)
    if problem.version == 2:  # device groups, or the job's objective (a deadline, energy)
        if auto:
            raise UserError('codec "auto" cannot be combined with an objective or deadline yet')
        found = plan_groups(problem, stages=stages, limits=limits, time_budget_s=budget_s)
        if found.score is None:
            raise UserError(f"no plan fits {where}: {found.reason}")
        return FoundPlan(found.score, found.method, found.exact)
    found = plan_problem(problem, stages=stages, time_budget_s=budget_s)
    if found.score is None:
        raise UserError(f"no plan fits {where}: {found.reason}")
    score = found.score
    if auto:  # compress the links where it pays, keeping the stage count
        choice = plan_with_codecs(problem, lambda p: plan_problem(p, stages=stages).plan)
        if choice is not None and choice.score.step_time_s < score.step_time_s:
            score = choice.score  # else fp32 everywhere (make_assignments' default)
    return FoundPlan(score, found.method, found.exact)


def plan_holders_job(
    problem: PlanningProblem,
    holders: Sequence[str],
    shares: Sequence[float],
    *,
    min_local_units: int = 1,
    limits: GroupLimits | None = None,
    where: str = "the devices",
    labels_local: bool = False,
    codec: str = "fp32",
) -> tuple[FoundPlan, HolderPlans]:
    """The plan of a job on local data: stage 0 on ``holders`` at ``shares`` (their data),
    the rest planned by :func:`plan_job` over the other devices
    (:mod:`coordinator.planner.holders`); also the alternatives, for the report. With
    ``labels_local`` the holders run the last units too (a U-shaped plan). With ``codec``
    ``"auto"``, the plans are searched for every codec and each link gets its own
    (:func:`~coordinator.planner.codecs.plan_with_codecs`): where the links bind, a
    compressed link can keep the helpers worth their bytes. A one-line
    :class:`UserError` when nothing fits."""
    n = int(problem.batch_size) // problem.microbatches
    try:
        split_samples(n, list(shares))
    except ValueError as exc:
        raise UserError(f"the holders' shares of a microbatch of {n}: {exc}") from None

    def rest(sub: PlanningProblem) -> PlanScore | None:
        try:
            return plan_job(sub, where=where, limits=limits).score
        except UserError:
            return None

    solo = limits.solo_units if limits is not None else frozenset()
    if len(holders) > 1 and solo & set(range(min_local_units)):
        unit = min(solo & set(range(min_local_units)))
        raise UserError(
            f"unit {unit} has BatchNorm, which a group of {len(holders)} holders cannot "
            "train (use norm=group)"
        )

    def search(q: PlanningProblem) -> HolderPlans:
        return plan_with_holders(
            q,
            holders,
            shares,
            rest,
            min_local_units=min_local_units,
            solo_units=solo,
            labels_local=labels_local,
        )

    found = search(problem)
    if found.best is None:
        why = found.holders_alone.reasons[0] if found.holders_alone.reasons else "no helper fits"
        raise UserError(f"no plan on the holders of the data fits {where}: {why}")
    best = found.best
    if codec.lower() == "auto":

        def best_plan(q: PlanningProblem) -> Plan | None:
            got = found.best if q is problem else search(q).best  # fp32's: searched above
            return None if got is None else got.plan

        coded = plan_with_codecs(
            problem, best_plan, fixed_shares=lambda plan: holder_ends(plan, shares)
        )
        if coded is not None and coded.score.step_time_s < best.step_time_s * (1 - 1e-9):
            best = coded.score
    plan, n = best.plan, len(problem.layers)
    k = plan.stages[0].end
    method = f"holders keep {k} of {n} units, helpers plan the rest"
    if plan.u_shaped:
        tail = n - plan.stages[-1].start
        method = f"holders keep the first {k} and the last {tail} of {n} units, helpers the middle"
    if plan.codecs and set(plan.codecs) != {"fp32"}:
        method += f"; links {', '.join(plan.codecs)}"
    return FoundPlan(best, method, False), found


def _even_groups(problem: PlanningProblem, sizes: list[int], where: str) -> FoundPlan:
    """The units split evenly over ``len(sizes)`` stages, stage ``s`` on the next
    ``sizes[s]`` devices (``pin_first`` first, then the order given)."""
    n_units, ids = len(problem.layers), [d.id for d in problem.devices]
    if problem.pin_first is not None:
        ids.remove(problem.pin_first)
        ids.insert(0, problem.pin_first)
    if min(sizes) < 1 or sum(sizes) != len(ids):
        raise UserError(f"group sizes {sizes} do not add up to the {len(ids)} devices of {where}")
    if len(sizes) > n_units:
        raise UserError(f"group sizes give {len(sizes)} stages, more than {n_units} units")
    bounds = [round(i * n_units / len(sizes)) for i in range(len(sizes) + 1)]
    stages, at = [], 0
    for s, size in enumerate(sizes):
        stages.append(Stage.group(ids[at : at + size], bounds[s], bounds[s + 1]))
        at += size
    plan = Plan(tuple(stages))
    score = score_plan(for_plan(problem, plan), plan)
    if not score.feasible:
        raise UserError(f"the groups {sizes} do not fit {where}: {score.reasons[0]}")
    n = int(problem.batch_size) // problem.microbatches
    for s, shares in enumerate(score.shares):
        try:
            split_samples(n, shares)
        except ValueError as exc:
            raise UserError(f"group sizes {sizes}, stage {s}: {exc}") from None
    return FoundPlan(score, f"even split over groups of {','.join(map(str, sizes))}", False)
