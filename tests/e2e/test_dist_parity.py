"""The server tier trains the same model as one device.

Each case launches real processes with torchrun semantics (``edgetrain launch``'s
code: c10d rendezvous, torch's elastic agent, gloo on CPU) and compares the
per-step losses and every final parameter within 1e-5 relative with the
independent reference (:mod:`support.reference`, a plain PyTorch loop) and with
the single-device run (one stage in this process, the same runtime): 2 and 4
processes, gpt-mini and cnn-digits, 1F1B and GPipe (every pair of those: each model
at both sizes and both schedules, each schedule at both sizes), and 2 pipeline replicas x
2 stages (gradients all-reduced across the replicas; that each replica trains
on its own slice is checked by content in ``tests/integration/test_replica_shares.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.reference import ReferenceRun, assert_matches, train_reference

from coordinator.engine.runners import run_inprocess
from coordinator.engine.spec import JobSpec
from coordinator.planner.score import Plan
from edge.errors import UserError
from edge.server.job_file import DistJob, read_results
from edge.server.launch import launch
from edge.wire.messages import StepReport

UNITS = {"gpt-mini": 6, "cnn-digits": 4}
STEPS, BATCH, MICRO, SEED = 4, 16, 4, 5
_REFERENCES: dict[str, tuple[list[float], dict[str, torch.Tensor]]] = {}
_INDEPENDENT: dict[str, ReferenceRun] = {}


def _independent(model: str) -> ReferenceRun:
    if model not in _INDEPENDENT:
        _INDEPENDENT[model] = train_reference(model, steps=STEPS, batch_size=BATCH, seed=SEED)
    return _INDEPENDENT[model]


def _reference(model: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    if model not in _REFERENCES:
        spec = JobSpec(model=model, steps=STEPS, batch_size=BATCH, microbatches=MICRO, seed=SEED)
        result = run_inprocess(spec, Plan.of(("local", 0, UNITS[model])))
        _REFERENCES[model] = (result.losses, result.weights)
    return _REFERENCES[model]


def _job(tmp_path: Path, model: str, stages: int, **extra: object) -> DistJob:
    n = UNITS[model]
    cuts = [round(i * n / stages) for i in range(1, stages)]
    return DistJob.model_validate(
        {
            "model": model,
            "steps": STEPS,
            "batch_size": BATCH,
            "microbatches": MICRO,
            "seed": SEED,
            "boundaries": cuts,
            "output": str(tmp_path / "out"),
            **extra,
        }
    )


def _assert_matches_reference(job: DistJob, model: str) -> None:
    got = read_results(Path(job.output), job)
    assert job.num_stages >= 2
    assert_matches(got.losses, got.weights, _independent(model))
    ref_losses, ref_weights = _reference(model)
    assert len(got.losses) == STEPS
    torch.testing.assert_close(
        torch.tensor(got.losses), torch.tensor(ref_losses), rtol=1e-5, atol=0
    )
    assert got.weights.keys() == ref_weights.keys()
    for key, ref in ref_weights.items():
        torch.testing.assert_close(got.weights[key], ref, rtol=1e-5, atol=1e-7, msg=key)
    # Every stage of replica 0 reported every step, and frames crossed every link.
    assert {(r.stage, r.step) for r in got.reports} == {
        (s, t) for s in range(job.num_stages) for t in range(STEPS)
    }
    assert all(r.bytes_sent > 0 and r.bytes_received > 0 for r in got.reports)


@pytest.mark.parametrize(
    ("model", "processes", "schedule"),
    [
        ("cnn-digits", 2, "1f1b"),
        pytest.param("cnn-digits", 4, "gpipe", marks=pytest.mark.slow),
        ("gpt-mini", 2, "gpipe"),
        pytest.param("gpt-mini", 4, "1f1b", marks=pytest.mark.slow),
    ],
)
def test_pipeline_over_gloo_equals_one_device(
    tmp_path: Path, model: str, processes: int, schedule: str
) -> None:
    job = _job(tmp_path, model, processes, schedule=schedule)
    launch(job, threads=1)
    _assert_matches_reference(job, model)


@pytest.mark.parametrize("model", list(UNITS))
@pytest.mark.slow
def test_two_replicas_of_two_stages_equal_one_device(tmp_path: Path, model: str) -> None:
    job = _job(tmp_path, model, 2, replicas=2)
    launch(job, threads=1)
    _assert_matches_reference(job, model)
    got = read_results(Path(job.output), job)
    assert all(r.allreduce_s > 0 for r in got.reports)  # the replicas did average
    # Replica 1's last stage reported the same (averaged) losses as replica 0's.
    lines = (Path(job.output) / f"reports-rank{job.rank(1, 1)}.jsonl").read_text().splitlines()
    assert [StepReport.model_validate_json(line).loss for line in lines] == got.losses


@pytest.mark.slow
def test_resume_from_a_state_directory_continues_the_same_run(tmp_path: Path) -> None:
    """Stopping after 2 steps and resuming from the written states ends where 4 steps do."""
    first = _job(tmp_path / "a", "gpt-mini", 2, steps=2)
    launch(first, threads=1)
    second = _job(tmp_path / "b", "gpt-mini", 2, resume_from=first.output)
    launch(second, threads=1)
    got = read_results(Path(second.output), second)
    assert second.num_stages == 2
    independent = _independent("gpt-mini")
    assert_matches(
        got.losses, got.weights, ReferenceRun(independent.losses[2:], independent.weights)
    )
    ref_losses, ref_weights = _reference("gpt-mini")
    assert len(got.losses) == STEPS - 2
    torch.testing.assert_close(
        torch.tensor(got.losses), torch.tensor(ref_losses[2:]), rtol=1e-5, atol=0
    )
    for key, ref in ref_weights.items():
        torch.testing.assert_close(got.weights[key], ref, rtol=1e-5, atol=1e-7, msg=key)


def test_a_world_that_does_not_fit_the_job_is_refused(tmp_path: Path) -> None:
    job = _job(tmp_path, "cnn-digits", 2)
    with pytest.raises(UserError, match="2 stages x 1 replicas = 2"):
        launch(job, nproc_per_node=3)
