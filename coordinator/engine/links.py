"""A job on local data on slower links: what its plan would be, and where splitting it
stops paying.

A job on local data has a plan that hands units to helpers (its holders keep the
first and, with its labels local, the last) and an alternative: its holders training
alone together, data-parallel (:mod:`coordinator.planner.holders`). The helpers cost
bytes: each microbatch's activations and their gradients cross to them and back,
while the holders alone move only their gradient sums, and the holders alone as
federated averaging (:func:`averaged`: not exact) move them once in
:data:`AVERAGE_EVERY` steps. Where links are fast, the
helpers' speed wins; where they bind, the bytes do, and below some rate the planner
keeps the job on its holders. :func:`link_ladder` shows the user where that rate is.

At each rate of a ladder every device's link runs at that rate and the job is
planned as the engine plans it (:func:`plan_over`, the same unit seconds): over every
device, over its holders alone (the job the demo runs to compare, ``devices`` its
holders), and over its holders alone averaging (where the job may: its labels leave
the holders). A row gives the predictions and the
plan's shape: its stages, its links' codecs (a job with ``codec: auto`` compresses
the links that bind), and the share of its predicted step on links and group sums.
:func:`split_stops_paying` then bisects, between the ladder's rates where the plan
splits and where it does not, to the rate below which the planner no longer splits
(within :data:`BISECT_RATIO`).

Tested in tests/unit/coordinator/engine/test_link_ladder.py and, through
``POST /api/v1/jobs/{id}/links``, tests/e2e/test_demo_links.py; the demo prints it
(``edgetrain demo --link-mbps``), and ``bench/demo_links.py`` measures it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from coordinator.engine.engine import PlannedJob, plan_over
from coordinator.engine.spec import JobSpec
from coordinator.planner.anatomy import link_share
from coordinator.planner.predict import UnitSeconds
from edge.config import DiLoCo
from edge.errors import UserError
from edge.models.local_data import announced
from edge.problem import DeviceSpec

__all__ = [
    "AVERAGE_EVERY",
    "BISECT_RATIO",
    "LADDER_MBPS",
    "AtLinks",
    "at_links",
    "at_rate",
    "averaged",
    "holders_of",
    "link_ladder",
    "split_stops_paying",
]

LADDER_MBPS = (1000.0, 300.0, 100.0, 30.0, 10.0, 3.0, 1.0)
"""The rates a ladder tries by default, Mbit/s each way."""

AVERAGE_EVERY = 4
"""Steps between the holders' averages in the federated-averaging alternative."""

BISECT_RATIO = 1.05
""":func:`split_stops_paying` narrows its bracket to this ratio of rates."""


@dataclass(frozen=True)
class AtLinks:
    """The job planned with every link at ``mbps``."""

    mbps: float
    split: bool
    """Whether the plan hands units to helpers (more than the holders' one stage)."""
    stages: int
    codecs: list[str]
    """Each link's codec (empty for one stage)."""
    predicted_sps: float
    """The plan's predicted samples/s."""
    holders_alone_sps: float
    """The same job on its holders alone, predicted."""
    holders_averaged_sps: float | None
    """The same job on its holders alone as federated averaging (:func:`averaged`, not
    exact), predicted; ``None`` where the job cannot average (its labels stay home)."""
    link_share: float
    """The share of the plan's predicted step (summed over its members) on links and
    group sums."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def at_rate(devices: Sequence[DeviceSpec], mbps: float) -> list[DeviceSpec]:
    """``devices`` with every link at ``mbps``, each way."""
    return [d.model_copy(update={"bandwidth_mbps": mbps}) for d in devices]


def holders_of(spec: JobSpec, devices: Sequence[DeviceSpec]) -> list[DeviceSpec]:
    """Those of ``devices`` that hold ``spec``'s local data; a one-line
    :class:`UserError` for a job on no local data."""
    if spec.data is None:
        raise UserError("the job trains on no local data: it has no holders to compare with")
    name = spec.data.name
    return [d for d in devices if announced(d.model_dump()).get(name) is not None]


def averaged(spec: JobSpec, every: int = AVERAGE_EVERY) -> JobSpec | None:
    """``spec`` as federated averaging: DiLoCo at outer lr 1 without momentum every
    ``every`` steps ([Note: DiLoCo in a group] in :mod:`edge.runtime.outer_sync`): each
    holder steps on its own samples, and the holders average their weights by share at
    each sync. Not exact. A job that already sets ``diloco`` as it is; ``None`` where
    the job cannot (``diloco`` refuses labels that stay home)."""
    if spec.diloco is not None:
        return spec
    if spec.data is not None and spec.data.labels_local:
        return None
    fed = DiLoCo(every=every, outer_lr=1.0, outer_momentum=0.0)
    return JobSpec.model_validate({**spec.model_dump(), "diloco": fed.model_dump()})


def _sps(planned: PlannedJob) -> float:
    prediction = planned.found.prediction
    return prediction.throughput_sps if prediction is not None else planned.score.throughput_sps


def at_links(
    spec: JobSpec,
    devices: Sequence[DeviceSpec],
    mbps: float,
    device_units: Mapping[str, UnitSeconds] | None = None,
) -> AtLinks:
    """``spec`` planned over ``devices`` and over its holders alone, every link at
    ``mbps`` (see the module docstring)."""
    fleet = at_rate(devices, mbps)
    planned = plan_over(spec, fleet, device_units=device_units)
    holders = holders_of(spec, fleet)
    alone = plan_over(spec, holders, device_units=device_units)
    fed = averaged(spec)
    together = None if fed is None else plan_over(fed, holders, device_units=device_units)
    plan = planned.plan
    links = len(plan.stages) - 1
    return AtLinks(
        mbps=mbps,
        split=links > 0,
        stages=len(plan.stages),
        codecs=list(plan.codecs) if plan.codecs else [spec.link_codec] * links,
        predicted_sps=_sps(planned),
        holders_alone_sps=_sps(alone),
        holders_averaged_sps=None if together is None else _sps(together),
        link_share=link_share(planned.anatomy().fractions()),
    )


def link_ladder(
    spec: JobSpec,
    devices: Sequence[DeviceSpec],
    rates: Sequence[float] | None = None,
    device_units: Mapping[str, UnitSeconds] | None = None,
) -> list[AtLinks]:
    """``spec`` planned at each of ``rates`` (default :data:`LADDER_MBPS`), fastest
    first."""
    rates = LADDER_MBPS if rates is None else rates
    return [at_links(spec, devices, r, device_units) for r in sorted(set(rates), reverse=True)]


def split_stops_paying(
    ladder: Sequence[AtLinks], plan_at: Callable[[float], AtLinks]
) -> float | None:
    """The rate below which the planner keeps the job on its holders: bisected (in log
    rate, to :data:`BISECT_RATIO`) between the slowest rung of ``ladder`` where the plan
    splits and the fastest below it where it does not, planning with ``plan_at``. ``0``
    where it splits at every rung, ``None`` where at none (not even the fastest)."""
    rungs = sorted(ladder, key=lambda r: -r.mbps)
    if not rungs or not rungs[0].split:
        return None
    for fast, slow in itertools.pairwise(rungs):
        if fast.split and not slow.split:
            high, low = fast.mbps, slow.mbps
            while high / low > BISECT_RATIO:
                mid = math.sqrt(high * low)
                if plan_at(mid).split:
                    high = mid
                else:
                    low = mid
            return high
    return 0.0
