"""The spec's cost terms as arrays, for the search.

:class:`CostTables` precomputes, for every device and every unit range
``[h, i)``, the compute time per microbatch, the parameter and activation bytes
of the range, and for every cut and device pair the link time. Range sums are
running sums from ``h`` taken left to right, the same additions in the same
order as :func:`coordinator.planner.score.score_plan` makes, and the terms are
the score's own functions (:mod:`coordinator.planner.terms`) on arrays, so a plan
the search calls feasible is feasible when scored, and its times are the
score's, to the last bit ([Note: one formula, two kinds of number]).

Tested in tests/unit/coordinator/planner/test_terms.py (the score's bits),
tests/unit/coordinator/planner/test_planner_exact.py and
tests/unit/coordinator/planner/test_baselines.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from coordinator.planner.score import Plan
from coordinator.planner.terms import compute_s, link_s, need_bytes
from edge.problem import PlanningProblem

__all__ = ["CostTables", "range_sums"]


def range_sums(values: list[float]) -> np.ndarray:
    """``out[h, i] = sum(values[h:i])`` summed left to right (``inf`` where ``i <= h``)."""
    n = len(values)
    out = np.full((n + 1, n + 1), np.inf)
    x = np.asarray(values, dtype=np.float64)
    for h in range(n):
        # np.add.accumulate adds sequentially, like Python's sum(); 0 + x[h] is exact.
        out[h, h + 1 :] = np.add.accumulate(x[h:])
    return out


@dataclass
class CostTables:
    """Cost arrays of one problem. ``L`` layers, ``D`` devices, ranges ``[h, i)``."""

    problem: PlanningProblem
    ids: list[str]
    b: float
    m: int
    compute: np.ndarray
    """``[D, L+1, L+1]``: ``T`` of range ``[h, i)`` on device ``d`` (``inf`` if ``i <= h``)."""
    params: np.ndarray
    """``[L+1, L+1]``: parameter bytes of a range."""
    acts: np.ndarray
    """``[L+1, L+1]``: saved activation bytes per sample of a range."""
    link: np.ndarray
    """``[D, D, L+1]``: ``C`` of a cut before unit ``i`` from device ``d`` to ``e``."""
    memory: np.ndarray
    """``[D]``: memory of each device."""
    _need: dict[int, np.ndarray] = field(default_factory=dict)

    @classmethod
    def build(cls, problem: PlanningProblem) -> CostTables:
        layers, devices = problem.layers, problem.devices
        b = problem.batch_size / problem.microbatches
        flops = range_sums([unit.train_flops for unit in layers])
        gflops = np.array([d.gflops for d in devices])
        with np.errstate(invalid="ignore"):
            compute = compute_s(b, flops[None, :, :], gflops[:, None, None])
        lat = np.array([d.latency_ms for d in devices])
        bw = np.array([d.bandwidth_mbps for d in devices])
        out = np.array([0.0] + [unit.out_bytes for unit in layers])  # out[i]: after unit i-1
        # [d, e, i]: from device d to device e, across the cut before unit i
        sender, receiver = (slice(None), None, None), (None, slice(None), None)
        link = link_s(b, out[None, None, :], lat[sender], lat[receiver], bw[sender], bw[receiver])
        return cls(
            problem=problem,
            ids=[d.id for d in devices],
            b=b,
            m=problem.microbatches,
            compute=compute,
            params=range_sums([unit.param_bytes for unit in layers]),
            acts=range_sums([unit.saved_bytes for unit in layers]),
            link=link,
            memory=np.array([d.memory_bytes for d in devices]),
        )

    @property
    def num_units(self) -> int:
        return len(self.problem.layers)

    @property
    def num_devices(self) -> int:
        return len(self.ids)

    def need(self, position_from_end: int) -> np.ndarray:
        """``[L+1, L+1]``: 1F1B memory of range ``[h, i)`` as the stage that many
        stages from the end (1 = the last stage)."""
        factor = min(position_from_end, self.m)
        if factor not in self._need:
            k = self.problem.optimizer_state_factor
            self._need[factor] = need_bytes(k, self.params, factor, 1.0, self.b, self.acts)
        return self._need[factor]

    def fits_matrix(self, position_from_end: int, device: int) -> np.ndarray:
        """``[L+1, L+1]`` booleans: range ``[h, i)`` fits ``device`` at that position."""
        return self.need(position_from_end) <= self.memory[device]

    def fits_row(self, position_from_end: int, device: int, end: int) -> np.ndarray:
        """``[L+1]`` booleans: range ``[h, end)`` fits ``device`` at that position."""
        return self.need(position_from_end)[:, end] <= self.memory[device]

    def fits_all(self, max_position: int) -> np.ndarray:
        """``[max_position+1, D, L+1, L+1]`` booleans for positions ``1..max_position``
        (index 0 is unused)."""
        n = self.num_units + 1
        out = np.zeros((max_position + 1, self.num_devices, n, n), dtype=bool)
        for r in range(1, max_position + 1):
            out[r] = self.need(r)[None, :, :] <= self.memory[:, None, None]
        return out

    def bottleneck(self, plan: Plan) -> float:
        """The plan's ``tau``: its largest stage or link time per microbatch."""
        index = {d: i for i, d in enumerate(self.ids)}
        times = [float(self.compute[index[s.device], s.start, s.end]) for s in plan.stages]
        for s, nxt in zip(plan.stages, plan.stages[1:], strict=False):
            times.append(float(self.link[index[s.device], index[nxt.device], s.end]))
        return max(times)

    def candidate_bottlenecks(self) -> np.ndarray:
        """Every value a plan's bottleneck can take, sorted: all ``T`` and all ``C``."""
        t = self.compute[np.isfinite(self.compute)]
        c = self.link[:, :, 1 : self.num_units]
        off_diagonal = ~np.eye(self.num_devices, dtype=bool)
        return np.unique(np.concatenate([t.ravel(), c[off_diagonal].ravel()]))
