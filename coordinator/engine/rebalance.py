"""When to move layers: re-planning from measured stage times (drift, slow devices, joins).

A device's speed drifts (thermal throttling, another process, a phone picked
up). :class:`Rebalancer` turns the stages' measured compute seconds per step
(each device's own: the time other processes of a busy host took is not counted,
[Note: a device's own compute seconds] in :mod:`edge.runtime.stage`, so a host
busy with other work does not hide a slow device among the ones it slows)
into a speed factor per device (measured / predicted by the plan's score), plans
again over the living devices with their announced GFLOP/s divided by those
factors (devices without a measurement get the median factor, the model error
they share), and says to migrate only when

- the predicted step time falls by more than ``threshold`` (default 10%), and
- the time saved over the steps left exceeds what moving costs: the steps redone
  from the newest replica (as many as the caller says would be redone now, else
  the most there can be, ``replicate_every``), a restart of the
  stages (``restart_s``, measured about 0.7 s on this machine), and sending the
  moved state (weights and optimizer state) over the slowest link of the new plan.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable

from coordinator.planner.score import Plan, for_plan, score_plan
from coordinator.planner.solve import plan_problem
from edge.problem import PlanningProblem

__all__ = ["REPLICATION_BUDGET", "Rebalancer", "replication_interval"]

log = logging.getLogger(__name__)

REPLICATION_BUDGET = 0.05
"""Replication may cost each stage at most this share of the step time, on average."""


def replication_interval(
    problem: PlanningProblem,
    plan: Plan,
    budget: float = REPLICATION_BUDGET,
    most: int | None = None,
) -> int:
    """The default R: replicate every R steps so that doing so costs at most ``budget``.

    One replica of stage ``s`` is its units' weights and optimizer state
    (``optimizer_state_factor / 2`` times the parameter bytes: weights, and the
    moments the factor counts beside weights and gradients), serialised (about 1
    GB/s: vgg11's 74 MB state with SGD momentum took 0.066 s here) and sent over
    the stage device's link. The stage with the dearest replica sets R:
    ``ceil(cost / (budget x step time))``, at least 1. Fewer replicas mean more
    steps redone after a failure (at most R - 1 beyond the one in flight), so
    ``most`` caps R (the CLI passes a tenth of the job: a failure never costs
    more than a tenth of it, whatever the budget says).
    """
    score = score_plan(for_plan(problem, plan), plan)
    links = {d.id: d.bandwidth_mbps for d in problem.devices}
    factor = problem.optimizer_state_factor / 2
    worst = 0.0
    for st in plan.stages:
        size = factor * sum(unit.param_bytes for unit in problem.layers[st.start : st.end])
        worst = max(worst, size / 1e9 + size * 8 / (links[st.device] * 1e6))
    every = 1
    if worst > 0 and score.step_time_s > 0:
        every = max(1, math.ceil(worst / (budget * score.step_time_s)))
    return every if most is None else max(1, min(every, most))


class Rebalancer:
    """The ``rebalance`` callback of :func:`~coordinator.engine.resilient.run_resilient`."""

    def __init__(
        self,
        problem_for: Callable[[list[str]], PlanningProblem],
        *,
        replicate_every: int,
        threshold: float = 0.10,
        restart_s: float = 1.0,
        stages: int | None = None,
    ) -> None:
        self.problem_for = problem_for
        self.stages = stages
        """A job's ``stages``: plans proposed keep that many (or one per living device)."""
        self.replicate_every = replicate_every
        self.threshold = threshold
        self.restart_s = restart_s
        self.decisions: list[dict[str, float]] = []
        """Every evaluation: current and proposed step times, gain, move cost."""

    def factors(
        self, problem: PlanningProblem, plan: Plan, compute_s: dict[str, float]
    ) -> dict[str, float]:
        """Per device of ``problem``: measured over predicted compute time."""
        score = score_plan(problem, plan)
        m = problem.microbatches
        measured = {
            st.device: compute_s[st.device] / (score.compute_s[s] * m)
            for s, st in enumerate(plan.stages)
            if st.device in compute_s and score.compute_s[s] > 0
        }
        typical = statistics.median(measured.values()) if measured else 1.0
        return {d.id: measured.get(d.id, typical) for d in problem.devices}

    def __call__(
        self,
        plan: Plan,
        alive: list[str],
        compute_s: dict[str, float],
        steps_left: int,
        redo_steps: int | None = None,
    ) -> Plan | None:
        """A better plan to move to now, or ``None``. ``redo_steps``: the steps a move
        would run again, from the newest complete replica (``None``: the most there can
        be, ``replicate_every``)."""
        redo = self.replicate_every if redo_steps is None else redo_steps
        problem = self.problem_for(alive)
        factors = self.factors(problem, plan, compute_s)
        devices = [
            d.model_copy(update={"gflops": d.gflops / factors[d.id]}) for d in problem.devices
        ]
        measured = problem.model_copy(update={"devices": devices})
        now = score_plan(measured, plan)
        stages = None if self.stages is None else min(self.stages, len(measured.devices))
        found = plan_problem(measured, stages=stages)
        if found.score is None or not now.feasible:
            return None
        new = found.score
        gain = 1.0 - new.step_time_s / now.step_time_s
        moved = sum(
            unit.param_bytes * measured.optimizer_state_factor / 2  # weights + optimizer state
            for unit in measured.layers
        )
        slowest = min(
            d.bandwidth_mbps
            for d in measured.devices
            if d.id in {s.device for s in new.plan.stages}
        )
        cost = redo * now.step_time_s + self.restart_s + moved * 8 / (slowest * 1e6)
        saved = steps_left * (now.step_time_s - new.step_time_s)
        self.decisions.append(
            {
                "now_s": now.step_time_s,
                "new_s": new.step_time_s,
                "gain": gain,
                "cost_s": cost,
                "saved_s": saved,
            }
        )
        move = gain > self.threshold and saved > cost
        log.info(
            "rebalance: speed factors %s; %.3f s/step now, %.3f s proposed (%.0f%% faster), "
            "moving costs %.1f s and saves %.1f s over %d steps: %s",
            ", ".join(f"{d} {f:.2f}" for d, f in factors.items()),
            now.step_time_s,
            new.step_time_s,
            100 * gain,
            cost,
            saved,
            steps_left,
            "move" if move else "stay",
        )
        return new.plan if move else None
