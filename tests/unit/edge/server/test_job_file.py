"""A server-tier job: FLOP-balanced cuts, its file, its rank layout and resuming from states."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import safetensors.torch
import torch
from pydantic import ValidationError
from support.paths import ROOT

from edge.errors import UserError
from edge.models.zoo import get_model
from edge.runtime.checkpoint import stage_state
from edge.server.job_file import (
    DistJob,
    balanced_boundaries,
    load_job,
    resume_states,
    write_job,
)
from edge.wire.messages import OptimizerSpec

BASE = {"model": "gpt-mini", "steps": 2, "batch_size": 12, "microbatches": 2}


def _job(**extra: object) -> DistJob:
    return DistJob.model_validate({**BASE, **extra})


def _largest_run(costs: list[float], cuts: list[int]) -> float:
    edges = [0, *cuts, len(costs)]
    return max(sum(costs[a:b]) for a, b in itertools.pairwise(edges))


# -- balanced_boundaries ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("costs", "stages", "cuts"),
    [
        ([1, 1, 1, 1], 2, [2]),
        ([5, 1, 1, 1, 1, 1], 2, [1]),
        ([1, 1, 1, 1, 1, 5], 2, [5]),
        ([1, 2, 3, 4], 4, [1, 2, 3]),
        ([3, 1, 4, 1, 5], 5, [1, 2, 3, 4]),
        ([3, 1, 4, 1, 5], 1, []),
        ([0, 4, 4, 4, 4, 1], 3, [2, 4]),  # gpt-mini's shape: a free embedding, a cheap head
        ([2, 2, 2, 9], 2, [3]),
    ],
)
def test_balanced_boundaries_on_hand_computed_cases(
    costs: list[float], stages: int, cuts: list[int]
) -> None:
    assert balanced_boundaries(costs, stages) == cuts


def test_balanced_boundaries_ties_go_to_the_earliest_cut() -> None:
    # [1 | 2 1] and [1 2 | 1] both have a largest run of 3.
    assert balanced_boundaries([1, 2, 1], 2) == [1]


@pytest.mark.parametrize("seed", range(6))
def test_balanced_boundaries_is_optimal_against_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(2, 8)
    costs = [float(rng.choice([0, rng.randint(1, 20)])) for _ in range(n)]
    for stages in range(1, n + 1):
        cuts = balanced_boundaries(costs, stages)
        assert len(cuts) == stages - 1
        assert cuts == sorted(set(cuts)) and all(0 < c < n for c in cuts)  # non-empty stages
        best = min(
            _largest_run(costs, list(combo))
            for combo in itertools.combinations(range(1, n), stages - 1)
        )
        assert _largest_run(costs, cuts) == best, (costs, stages, cuts)


@pytest.mark.parametrize("stages", [0, 5])
def test_balanced_boundaries_refuses_impossible_splits(stages: int) -> None:
    with pytest.raises(UserError, match=f"cannot split 4 units into {stages} stages"):
        balanced_boundaries([1, 1, 1, 1], stages)


# -- DistJob validation and layout -----------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"boundaries": [4, 2]}, r"boundaries \[4, 2\] must be ascending"),
        ({"boundaries": [2, 2]}, r"boundaries \[2, 2\] must be ascending"),
        ({"boundaries": [2], "stages": 2}, "give boundaries or stages, not both"),
        ({"batch_size": 9}, "batch_size 9 is not a multiple of microbatches 2 x replicas 1"),
        ({"replicas": 4}, "batch_size 12 is not a multiple of microbatches 2 x replicas 4"),
        ({"wrong": 1}, "wrong"),
        ({"boundaries": [3], "groups": [[1, 1]]}, "groups has 1 stages, not 2"),
        (
            {"boundaries": [3], "groups": [[1, 1], [1]], "replicas": 2},
            "groups cannot be combined with replicas",
        ),
        (
            {"boundaries": [3], "groups": [[0.9, 0.01], [1]]},
            r"groups: stage 0: a microbatch of 6 samples split by shares .* leaves a member",
        ),
        ({"boundaries": [3], "groups": [[1, -1], [1]]}, "shares must be positive numbers"),
    ],
)
def test_invalid_jobs_are_refused_with_a_clear_message(
    extra: dict[str, object], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        _job(**extra)


def test_stages_world_size_and_rank_layout() -> None:
    job = _job(boundaries=[2, 4], replicas=2)
    assert (job.num_stages, job.world_size) == (3, 6)
    assert [job.rank(s, r) for r in range(2) for s in range(3)] == list(range(6))
    assert job.rank(1, 1) == 4 and job.place(4) == (1, 1, 0)
    for rank in range(job.world_size):
        assert job.rank(*job.place(rank)) == rank
    assert {job.place(r) for r in range(6)} == {(s, r, 0) for s in range(3) for r in range(2)}
    assert _job().num_stages == 1 and _job(stages=4).num_stages == 4


def test_a_group_layout_gives_each_member_a_rank_in_stage_order() -> None:
    job = _job(boundaries=[2, 4], groups=[[1.0], [3.0, 1.0], [1.0]])
    assert (job.group_sizes, job.world_size, job.layout) == (
        [1, 2, 1],
        4,
        "stages of 1+2+1 devices",
    )
    assert [job.place(r) for r in range(4)] == [(0, 0, 0), (1, 0, 0), (1, 0, 1), (2, 0, 0)]
    for rank in range(job.world_size):
        assert job.rank(*job.place(rank)) == rank
    # 6 samples a microbatch, split 3:1 by the one rounding (largest remainder).
    assert job.group_samples() == ((6,), (5, 1), (6,))
    a = job.assignment(1, 0, member=1)
    assert (a.stage, a.member, a.group_size, a.group_samples) == (1, 1, 2, ((6,), (5, 1), (6,)))
    assert _job(boundaries=[2]).group_samples() is None


def test_segments_follow_explicit_boundaries() -> None:
    assert _job(boundaries=[2, 4]).segments() == [(0, 2), (2, 4), (4, 6)]
    assert _job().segments() == [(0, 6)]


def test_segments_balance_flops_when_only_stages_is_given() -> None:
    segments = _job(stages=3).segments()
    assert len(segments) == 3
    assert segments[0][0] == 0 and segments[-1][1] == 6
    assert all(a < b for a, b in segments)
    assert all(prev[1] == nxt[0] for prev, nxt in itertools.pairwise(segments))
    # The four equal transformer blocks go two and two; the free embedding and the
    # cheap head ride along with them.
    assert segments == [(0, 2), (2, 4), (4, 6)]


@pytest.mark.parametrize("boundaries", [[0, 3], [3, 6], [7]])
def test_boundaries_outside_the_model_are_a_user_error(boundaries: list[int]) -> None:
    with pytest.raises(UserError, match="must lie inside the 6 units"):
        _job(boundaries=boundaries).segments()


def test_more_stages_than_units_is_a_user_error() -> None:
    with pytest.raises(UserError, match="cannot split 6 units into 7 stages"):
        _job(stages=7).segments()


def test_assignment_carries_the_stage_and_replica() -> None:
    job = _job(boundaries=[2, 4], replicas=2, precision="bf16", codec="fp16", seed=3)
    a = job.assignment(1, 1, first_step=1)
    assert (a.job, a.stage, a.num_stages, a.start, a.end) == (job.job, 1, 3, 2, 4)
    assert (a.replica, a.replicas, a.precision) == (1, 2, "bf16")
    assert (a.batch_size, a.microbatches, a.steps, a.first_step) == (12, 2, 2, 1)
    assert (a.codec_in, a.codec_out, a.seed, a.model) == ("fp16", "fp16", 3, "gpt-mini")
    assert a.dataset == get_model("gpt-mini").dataset
    last = job.assignment(2, 0)
    assert (last.start, last.end, last.replica, last.is_last) == (4, 6, 0, True)


# -- the job file ----------------------------------------------------------------------


def test_write_then_load_gives_an_equal_job(tmp_path: Path) -> None:
    job = _job(
        job="abc-123",
        boundaries=[1, 3],
        replicas=2,
        schedule="gpipe",
        codec="bf16",
        model_options={"block_size": 32},
        dataset_options={"block_size": 32},
        resume_from="runs/x",
        optimizer=OptimizerSpec(name="adamw", lr=3e-4, weight_decay=0.01, betas=(0.8, 0.95)),
        output=str(tmp_path / "out"),
        recv_timeout_s=12.5,
    )
    path = tmp_path / "job.toml"
    write_job(job, path)
    back = load_job(path)
    assert back == job
    assert back.job == "abc-123" and back.optimizer.betas == (0.8, 0.95)
    assert "[optimizer]" in path.read_text()


def test_a_written_job_without_an_explicit_id_keeps_its_generated_one(tmp_path: Path) -> None:
    job = _job()
    write_job(job, tmp_path / "job.toml")
    assert load_job(tmp_path / "job.toml").job == job.job
    assert _job().job != job.job  # each new job gets its own


def test_overrides_apply_and_none_leaves_the_file_value(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    write_job(_job(output="from-file", steps=5), path)
    job = load_job(path, output="from-flag", steps=None)
    assert (job.output, job.steps) == ("from-flag", 5)


def test_overrides_are_validated(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    write_job(_job(), path)
    with pytest.raises(UserError, match="steps"):
        load_job(path, steps=0)


def _one_line_error(path: Path) -> str:
    with pytest.raises(UserError) as info:
        load_job(path)
    message = info.value.message
    assert "\n" not in message and str(path) in message
    return message


def test_invalid_toml_is_a_one_line_user_error(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text('model = "mlp"\nsteps = = 3\n')
    assert "not valid TOML" in _one_line_error(path)


def test_an_unknown_key_is_a_one_line_user_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text('model = "mlp"\nsteps = 3\nbatch_size = 8\nbatchsize = 8\n')
    assert "batchsize" in _one_line_error(path)


def test_a_cross_field_error_in_a_file_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text('model = "mlp"\nsteps = 3\nbatch_size = 8\nboundaries = [1]\nstages = 2\n')
    assert "give boundaries or stages, not both" in _one_line_error(path)


def test_a_missing_file_is_a_user_error_naming_it(tmp_path: Path) -> None:
    assert "No such file" in _one_line_error(tmp_path / "nope.toml")


# -- resuming from state blobs ---------------------------------------------------------


def _write_states(directory: Path, step: int, segments: list[tuple[int, int]]) -> None:
    spec = get_model("mlp", seed=1)
    for stage, (start, end) in enumerate(segments):
        segment = spec.build_segment(start, end)
        optimizer = torch.optim.SGD(segment.parameters(), lr=0.1, momentum=0.9)
        blob = stage_state(
            segment, optimizer, step=step, job="j1", stage=stage, start=start, end=end
        )
        (directory / f"step{step}-stage{stage}.safetensors").write_bytes(blob)


def test_resume_states_takes_the_newest_step_covering_every_unit(tmp_path: Path) -> None:
    _write_states(tmp_path, 2, [(0, 2), (2, 3)])
    nested = tmp_path / "replicas"
    nested.mkdir()
    _write_states(nested, 4, [(0, 2)])  # newer, but unit 2 is missing
    # A weights-only file, as the dist worker writes next to its states, is skipped.
    safetensors.torch.save_file({"fc1.1.weight": torch.zeros(2)}, tmp_path / "weights.safetensors")
    step, states = resume_states(tmp_path, 3)
    assert step == 2
    assert sorted((s.start, s.end) for s in states) == [(0, 2), (2, 3)]
    assert all(s.step == 2 and s.job == "j1" for s in states)
    unit_names = get_model("mlp").unit_names
    assert [u for s in sorted(states, key=lambda s: s.start) for u in s.units] == unit_names


def test_resume_states_prefers_the_newer_complete_step(tmp_path: Path) -> None:
    _write_states(tmp_path, 2, [(0, 2), (2, 3)])
    _write_states(tmp_path, 6, [(0, 1), (1, 3)])
    step, states = resume_states(tmp_path, 3)
    assert step == 6 and sorted((s.start, s.end) for s in states) == [(0, 1), (1, 3)]


def test_resume_states_without_a_covering_step_is_a_user_error(tmp_path: Path) -> None:
    _write_states(tmp_path, 4, [(0, 2)])
    with pytest.raises(UserError, match="no step has states covering all 3 units"):
        resume_states(tmp_path, 3)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="no step has states"):
        resume_states(empty, 3)


def test_a_job_with_a_non_bmp_character_round_trips(tmp_path: Path) -> None:
    job = _job(output=str(tmp_path / "runs-\U0001f600"))
    write_job(job, tmp_path / "job.toml")
    assert load_job(tmp_path / "job.toml") == job


def test_a_job_that_is_not_toml_is_refused_in_one_line(tmp_path: Path) -> None:
    # A zoo model's options are checked by type, so only a user model's can hold a null.
    job = _job(model="mypkg.models:build", model_options={"depth": None})
    with pytest.raises(UserError, match="cannot be written as TOML"):
        write_job(job, tmp_path / "job.toml")


def test_the_shipped_server_job_example_is_valid() -> None:
    job = load_job(ROOT / "examples" / "server-job.toml")
    assert (job.num_stages, job.replicas, job.world_size) == (4, 2, 8)
    assert (job.device, job.precision) == ("cuda", "bf16")
