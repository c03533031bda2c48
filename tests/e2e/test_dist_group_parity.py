"""Stage groups over torch.distributed train the same model as one device.

For every combination of equal and unequal shares, 1F1B and GPipe, and the
groups ``2,1`` and ``1,2,1``, a short mlp server-tier job (real ranks launched
with torchrun semantics, gloo on CPU; every member of every stage a rank) gives
per-step losses and final parameters equal, within 1e-5, to those of the plain
PyTorch loop (:mod:`support.reference`), the job of
``tests/e2e/test_group_parity.py`` (MQTT and in-process). Every member reports
every step with the samples of its share, the group sums its gradients and loss
with one bucketed all-reduce of exactly their size, started while the last backward
still ran, and the members end with the same weights
(:func:`edge.server.job_file.read_results` checks that).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.reference import ReferenceRun, assert_matches, train_reference

from edge.models.zoo import get_model
from edge.runtime.schedules import SCHEDULES
from edge.server.job_file import DistJob, read_results
from edge.server.launch import launch

STEPS, BATCH, MICROBATCHES = 3, 16, 2
N = BATCH // MICROBATCHES  # samples per microbatch
SHARES = {"equal": (1.0, 1.0), "unequal": (0.75, 0.25)}
"""The group's shares; 0.75/0.25 of 8 samples is 6 and 2."""
SIZES = {"2,1": (2, 1), "1,2,1": (1, 2, 1)}
_REFERENCE: list[ReferenceRun] = []


def _reference() -> ReferenceRun:
    if not _REFERENCE:
        _REFERENCE.append(
            train_reference("mlp", steps=STEPS, batch_size=BATCH, seed=3, microbatches=2)
        )
    return _REFERENCE[0]


def _job(tmp_path: Path, schedule: str, sizes: tuple[int, ...], shares: str) -> DistJob:
    """The mlp's three units, one a stage (two on the first stage of ``2,1``)."""
    return DistJob.model_validate(
        {
            "model": "mlp",
            "steps": STEPS,
            "batch_size": BATCH,
            "microbatches": MICROBATCHES,
            "schedule": schedule,
            "seed": 3,
            "boundaries": [2] if len(sizes) == 2 else [1, 2],
            "groups": [list(SHARES[shares]) if size == 2 else [1.0] for size in sizes],
            "output": str(tmp_path / "out"),
        }
    )


def _reduced_bytes(job: DistJob, stage: int) -> int:
    """fp32 bytes of the group's gradients, and of its loss on the last stage."""
    start, end = job.segments()[stage]
    segment = get_model("mlp", seed=3).build_segment(start, end)
    return 4 * (sum(p.numel() for p in segment.parameters()) + (stage == job.num_stages - 1))


@pytest.mark.slow
@pytest.mark.parametrize("shares", list(SHARES))
@pytest.mark.parametrize("sizes", list(SIZES))
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_groups_over_gloo_equal_one_device(
    tmp_path: Path, schedule: str, sizes: str, shares: str
) -> None:
    job = _job(tmp_path, schedule, SIZES[sizes], shares)
    group = [s for s, size in enumerate(job.group_sizes) if size == 2]
    assert len(group) == 1 and job.world_size == sum(SIZES[sizes])
    launch(job, threads=1)
    got = read_results(Path(job.output), job)
    assert_matches(got.losses, got.weights, _reference())
    # Every member of every stage reported every step, with the samples of its share.
    want = (6, 2) if shares == "unequal" else (4, 4)
    seen = {(r.stage, r.member, r.step): r for r in got.reports}
    assert set(seen) == {
        (s, m, t)
        for s, size in enumerate(job.group_sizes)
        for m in range(size)
        for t in range(STEPS)
    }
    for (s, m, _), report in seen.items():
        assert report.device == f"rank{job.rank(s, 0, m)}"
        if s == group[0]:  # one bucketed all-reduce of the gradients (and the loss)
            assert report.samples == want[m] * MICROBATCHES
            assert report.allreduce_bytes == _reduced_bytes(job, s)
            # Its one bucket started from the hooks, before the last backward returned.
            assert report.allreduce_early_bytes == report.allreduce_bytes
            assert report.bytes_sent > 0 and report.bytes_received > 0
        else:
            assert report.samples == N * MICROBATCHES
            assert report.allreduce_bytes == report.allreduce_early_bytes == 0
