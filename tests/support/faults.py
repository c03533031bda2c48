"""Shared by the fault-tolerance and migration tests: the runs without faults to compare
with, even plans, and reading a resilient run's events."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from coordinator.engine.runners import run_inprocess
from coordinator.engine.spec import JobSpec
from coordinator.planner.score import Plan, Stage
from edge.models.unit_costs import profile_model
from edge.models.zoo import get_model
from support.reference import ReferenceRun, assert_matches, train_reference

STEPS = 12
"""Steps of every run here but those that migrate (they need steps left for a move to pay)."""
EVERY = 2
"""``replicate_every`` of every run here but the slow-fault one (which lets the CLI choose)."""
HEARTBEAT_S = 3.0
"""Heartbeat timeout of the runs that migrate and where nothing dies: the CLI's default. The
coordinator weighs a migration after every step (0.2-2.7 s of planning here); that must
not hold up its MQTT thread, or heartbeats queue and live devices are declared dead (it
did, inside ``JobMonitor._wait``, until ``abort`` ran outside the monitor's lock)."""
RTOL, ATOL = 1e-5, 1e-7
"""As the parity tests: a restored stage gets its units' exact fp32 state, so a run that
survived faults rounds like one that did not."""


def job_spec(model: str, steps: int = STEPS, seed: int = 5, batch_size: int = 16) -> JobSpec:
    return JobSpec(model=model, steps=steps, batch_size=batch_size, microbatches=4, seed=seed)


@functools.cache
def references(
    model: str, steps: int = STEPS, seed: int = 5, batch_size: int = 16
) -> tuple[ReferenceRun, ...]:
    """The run without faults, twice: the plain PyTorch loop, and edgetrain's one stage."""
    spec = job_spec(model, steps, seed, batch_size)
    plain = train_reference(
        model,
        steps=steps,
        batch_size=spec.batch_size,
        seed=seed,
        optimizer=spec.optimizer.model_dump(),
        model_options=spec.model_options,
    )
    one = run_inprocess(spec, Plan.of(("ref", 0, get_model(model).num_units)))
    return plain, ReferenceRun(one.losses, one.weights)


def assert_same_training(
    losses: list[float],
    weights: Mapping[str, torch.Tensor],
    model: str,
    steps: int = STEPS,
    seed: int = 5,
    rtol: float = RTOL,
    atol: float = ATOL,
    batch_size: int = 16,
) -> None:
    for reference in references(model, steps, seed, batch_size):
        assert_matches(losses, weights, reference, rtol=rtol, atol=atol)


def even_plan(devices: list[str], n_units: int) -> Plan:
    k = min(len(devices), n_units)
    cuts = [round(i * n_units / k) for i in range(k + 1)]
    return Plan.of(*((devices[i], cuts[i], cuts[i + 1]) for i in range(k)))


def even_groups(devices: list[str], sizes: list[int], n_units: int) -> Plan:
    """Units split evenly over ``len(sizes)`` stages, stage ``s`` on the next ``sizes[s]``."""
    cuts = [round(i * n_units / len(sizes)) for i in range(len(sizes) + 1)]
    stages, at = [], 0
    for s, size in enumerate(sizes):
        stages.append(Stage.group(devices[at : at + size], cuts[s], cuts[s + 1]))
        at += size
    return Plan(tuple(stages))


def events_of(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == kind]


def flops_of(plan: list[dict[str, Any]], device: str, model: str) -> float:
    """The training FLOPs per sample of the units ``device`` runs in ``plan`` (as events
    record it), counted (:func:`profile_model` without timing). What a rebalancer moves
    off a slow device is work, not units: it may keep as many units, cheaper ones
    (gpt-mini's last two, a block and the head: 88 M against two blocks' 164 M)."""
    units = profile_model(get_model(model), 1, timing=False).units
    return sum(
        u.fwd_flops + u.bwd_flops
        for st in plan
        if st["device"] == device
        for u in units[st["layers"][0] : st["layers"][1]]
    )


def derived_rollback(events: list[dict[str, Any]]) -> int:
    """Steps redone, from the attempts alone: each one's last step against the next one's first."""
    ends = events_of(events, "attempt_end")
    starts = [e["first_step"] for e in events_of(events, "attempt")[1:]]
    return sum(e["first_step"] + e["steps"] - s for e, s in zip(ends[:-1], starts, strict=True))
