"""When to move layers: re-planning from measured stage times (drift, slow devices, joins).

A device's speed drifts (thermal throttling, another process, a phone picked
up). :class:`Rebalancer` turns the stages' measured compute seconds per step
into a speed factor per device (measured / predicted by the plan's score), plans
again over the living devices with their announced GFLOP/s divided by those
factors (devices without a measurement get the median factor, the model error
they share), and says to migrate only when

- the predicted step time falls by more than ``threshold`` (default 10%), and
- the time saved over the steps left exceeds what moving costs: the steps redone
  from the newest replica (at most ``replicate_every``), a restart of the
  stages (``restart_s``, measured about 0.7 s on this machine), and sending the
  moved state (weights and optimizer state) over the slowest link of the new plan.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from coordinator.planner.fleet import plan_problem
from coordinator.planner.score import Plan, score_plan
from edge.problem import PlanningProblem

__all__ = ["Rebalancer"]


class Rebalancer:
    """The ``rebalance`` callback of :func:`~coordinator.resilient.run_resilient`."""

    def __init__(
        self,
        problem_for: Callable[[list[str]], PlanningProblem],
        *,
        replicate_every: int,
        threshold: float = 0.10,
        restart_s: float = 1.0,
    ) -> None:
        self.problem_for = problem_for
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
        self, plan: Plan, alive: list[str], compute_s: dict[str, float], steps_left: int
    ) -> Plan | None:
        problem = self.problem_for(alive)
        factors = self.factors(problem, plan, compute_s)
        devices = [
            d.model_copy(update={"gflops": d.gflops / factors[d.id]}) for d in problem.devices
        ]
        measured = problem.model_copy(update={"devices": devices})
        now = score_plan(measured, plan)
        found = plan_problem(measured)
        if found.score is None or not now.feasible:
            return None
        new = found.score
        gain = 1.0 - new.step_time_s / now.step_time_s
        moved = sum(
            layer.param_bytes * measured.optimizer_state_factor / 2  # weights + optimizer state
            for layer in measured.layers
        )
        slowest = min(
            d.bandwidth_mbps
            for d in measured.devices
            if d.id in {s.device for s in new.plan.stages}
        )
        cost = self.replicate_every * now.step_time_s + self.restart_s + moved * 8 / (slowest * 1e6)
        saved = steps_left * (now.step_time_s - new.step_time_s)
        self.decisions.append({"now_s": now.step_time_s, "new_s": new.step_time_s, "gain": gain,
                               "cost_s": cost, "saved_s": saved})  # fmt: skip
        if gain > self.threshold and saved > cost:
            return new.plan
        return None
