"""Compiled stages train as eager ones, and their compiling is reported apart.

[Note: compiled stages] in :mod:`edge.runtime.compiling`. A 2-stage MLP pipeline with
``compile: true`` runs in process (threads over the in-process transport; inductor
compiles in worker processes, hence an integration test) and its losses and weights
equal the independent reference loop's within 1e-5. Each stage's first step reports
the seconds it compiled (``compile_s``) and later steps none, and the first step's
compute is not that: compiling took longer than all of a stage's compute. A
zero-bubble schedule is refused with ``compile``, and ``schedule: auto`` does not
choose one for it.
"""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from support.reference import assert_matches, train_reference

from coordinator.engine.runners import run_inprocess
from coordinator.engine.spec import JobSpec
from coordinator.planner.score import Plan
from edge.runtime.compiling import CompileWatch, compiled


def test_a_compiled_pipeline_equals_the_reference_and_reports_its_compiling() -> None:
    spec = JobSpec(model="mlp", steps=3, batch_size=16, microbatches=2, seed=3, compile=True)
    result = run_inprocess(spec, Plan.of(("d0", 0, 1), ("d1", 1, 3)), timeout_s=600)
    reference = train_reference(
        spec.model,
        steps=spec.steps,
        batch_size=spec.batch_size,
        seed=spec.seed,
        optimizer=spec.optimizer.model_dump(),
    )
    assert_matches(result.losses, result.weights, reference)
    by_stage = {s: sorted((r.step, r) for r in result.reports if r.stage == s) for s in (0, 1)}
    for stage, reports in by_stage.items():
        first, *later = (r for _, r in reports)
        assert first.step == 0 and first.compile_s > 0, stage
        assert [r.compile_s for r in later] == [0.0, 0.0], stage
        assert first.compile_s > sum(r.compute_s for _, r in reports), stage
    assert result.compile_s == max(r.compile_s for r in result.reports)
    assert result.stage_summary()[0]["compile_s"] == by_stage[0][0][1].compile_s


def test_the_watch_counts_what_compiles_and_nothing_after() -> None:
    """A first forward compiles (its backward then, or when autograd first runs it, unless
    a cache already holds it); the same shape again compiles nothing."""
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    forward, watch = compiled(net)
    assert isinstance(watch, CompileWatch) and watch.compiles == 0
    out = forward(torch.randn(3, 4, requires_grad=True))
    assert watch.compiles == 1
    out.sum().backward()
    after = watch.compiles
    assert after in (1, 2)
    forward(torch.randn(3, 4, requires_grad=True)).sum().backward()
    assert watch.compiles == after


def test_compile_refuses_a_zero_bubble_schedule() -> None:
    with pytest.raises(ValidationError, match="compile cannot be combined with schedule zb-h1"):
        JobSpec(model="mlp", steps=1, batch_size=4, schedule="zb-h1", compile=True)
