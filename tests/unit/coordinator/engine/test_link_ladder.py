"""A job on local data on slower links: the plan the engine makes at each rate, and the
rate below which it stops handing units to helpers.

The fleet is the demo's, from the catalogue: three Raspberry Pi 4s holding a third of
``digits`` each and a laptop; the job is the demo's (labels local). Planning only:
nothing runs.
"""

from __future__ import annotations

import pytest

from coordinator.engine.engine import plan_over
from coordinator.engine.links import (
    AVERAGE_EVERY,
    BISECT_RATIO,
    AtLinks,
    at_links,
    at_rate,
    averaged,
    holders_of,
    link_ladder,
    split_stops_paying,
)
from coordinator.engine.spec import JobSpec
from coordinator.local.demo import job_body
from coordinator.local.train import emulated
from coordinator.planner.partition import plan_holders_job
from edge.errors import UserError
from edge.models.local_data import announce, register
from edge.models.user_code import CodeAllowance
from edge.problem import DeviceSpec


def _fleet() -> list[DeviceSpec]:
    """The demo's devices as the catalogue has them, each of the first three announcing
    its third of digits as its agent would."""
    specs, _ = emulated(["rpi4-4gb"] * 3 + ["laptop"])
    shards = [register([f"digits=digits:shard={i + 1}/3"], CodeAllowance(())) for i in range(3)]
    return [announce(d, shards[i]) if i < 3 else d for i, d in enumerate(specs)]


def _job(codec: str = "fp32", microbatches: int | str = 4) -> JobSpec:
    return JobSpec.model_validate(job_body(200, 48, microbatches, 0.05, codec))


def test_on_fast_links_the_job_splits_and_on_slow_ones_its_holders_train_alone() -> None:
    fleet = _fleet()
    ladder = link_ladder(_job(), fleet, [1000, 10])
    fast, slow = ladder
    assert (fast.mbps, slow.mbps) == (1000, 10)
    # 1000 Mbit/s: the U (holders, laptop, holders), ahead of the holders alone.
    assert fast.split and fast.stages == 3 and fast.codecs == ["fp32", "fp32"]
    assert fast.predicted_sps > fast.holders_alone_sps
    # 10 Mbit/s: the activations cost more than the laptop saves.
    assert not slow.split and slow.stages == 1 and slow.codecs == []
    assert slow.predicted_sps == pytest.approx(slow.holders_alone_sps)
    assert slow.link_share > fast.link_share > 0
    # The rate between, bisected: the plan splits just above it and not just below.
    below = split_stops_paying(ladder, lambda mbps: at_links(_job(), fleet, mbps))
    assert below is not None and 10 < below < 1000
    assert at_links(_job(), fleet, below).split
    assert not at_links(_job(), fleet, below / BISECT_RATIO).split


def test_the_auto_codec_compresses_the_links_and_keeps_the_split_paying() -> None:
    fleet = _fleet()
    exact = at_links(_job(), fleet, 10)
    auto = at_links(_job("auto"), fleet, 10)
    assert not exact.split
    assert auto.split and auto.stages == 3
    assert set(auto.codecs) <= {"bf16", "int8"} and "int8" in auto.codecs
    assert auto.predicted_sps > 1.5 * auto.holders_alone_sps
    # The holders alone move no activations: the same with either codec.
    assert auto.holders_alone_sps == pytest.approx(exact.holders_alone_sps)
    planned = plan_over(_job("auto"), at_rate(fleet, 10))
    assert planned.plan.u_shaped and planned.plan.codecs == tuple(auto.codecs)
    assert "links int8" in planned.found.method or "links bf16" in planned.found.method


def test_the_engine_runs_the_split_only_where_its_model_predicts_it_faster() -> None:
    """[Note: the split that does not pay]: at 100 Mbit/s the spec's score puts the U
    ahead of the holders alone, and the internal model, which also prices each frame
    and the CPU that moves its bytes, behind: the engine keeps the job home."""
    job, fleet = _job(microbatches="auto"), at_rate(_fleet(), 100)
    planned = plan_over(job, fleet)
    assert planned.holders is not None
    searched = planned.holders.best
    assert searched is not None and len(searched.plan.stages) == 3  # the score's choice
    assert searched.throughput_sps > planned.holders.holders_alone.throughput_sps
    assert len(planned.plan.stages) == 1
    assert planned.found.method.startswith("the holders alone, predicted faster than the split")
    # The search itself, asked directly, still splits: the choice is the engine's.
    found, _ = plan_holders_job(
        planned.problem, [d.id for d in fleet[:3]], [1 / 3] * 3, labels_local=True
    )
    assert len(found.plan.stages) == 3


def _rung(mbps: float, split: bool) -> AtLinks:
    return AtLinks(mbps, split, 3 if split else 1, [], 1.0, 1.0, None, 0.5)


def test_the_bisection_narrows_to_the_rate_where_the_plan_stops_splitting() -> None:
    asked: list[float] = []

    def plan_at(mbps: float) -> AtLinks:
        asked.append(mbps)
        return _rung(mbps, mbps >= 42.0)

    below = split_stops_paying([_rung(100, True), _rung(10, False)], plan_at)
    assert below is not None and 42.0 <= below <= 42.0 * BISECT_RATIO
    assert all(10 < m < 100 for m in asked) and len(asked) <= 10
    # Splitting at every rung: 0; at none, not even the fastest: None.
    assert split_stops_paying([_rung(100, True), _rung(1, True)], plan_at) == 0.0
    assert split_stops_paying([_rung(100, False), _rung(1, False)], plan_at) is None


def test_beside_the_exact_holders_the_ladder_offers_them_averaging() -> None:
    """At 10 Mbit/s the holders' exact sum binds: averaged every AVERAGE_EVERY steps (not
    exact) they are predicted faster. A job whose labels stay home cannot average, and
    its rung says so with ``None``."""
    fleet = _fleet()
    sent = JobSpec.model_validate(
        {**_job().model_dump(), "data": {"name": "digits", "placement": "local"}}
    )
    fed = averaged(sent)
    assert fed is not None and fed.diloco is not None and fed.training.startswith("non-exact")
    assert (fed.diloco.every, fed.diloco.outer_lr, fed.diloco.outer_momentum) == (
        AVERAGE_EVERY,
        1.0,
        0.0,
    )
    rung = at_links(sent, fleet, 10)
    assert rung.holders_averaged_sps is not None
    assert rung.holders_averaged_sps > 1.2 * rung.holders_alone_sps
    assert averaged(_job()) is None and at_links(_job(), fleet, 10).holders_averaged_sps is None


def test_a_job_on_no_local_data_has_no_holders_to_compare_with() -> None:
    spec = JobSpec.model_validate({"model": "mlp", "steps": 1, "batch_size": 8})
    with pytest.raises(UserError, match="no local data"):
        holders_of(spec, _fleet())
    assert [d.id for d in holders_of(_job(), _fleet())] == [f"local-{i}" for i in range(3)]
