"""``edgetrain train --transport dist`` and ``edgetrain launch`` end to end, through the CLI.

Each run is a real ``edgetrain`` process that launches real ranks (gloo on CPU);
losses and weights are compared with the independent reference
(:mod:`support.reference`, a plain PyTorch loop) and with the single-device
in-process run.
Every pipeline here has two stages (asserted); the reference and the replicas
test have one on purpose (see their docstrings).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from support.cli import edgetrain as edgetrain_here
from support.reference import ReferenceRun, assert_matches, train_reference

from edge.server.job_file import DistJob, write_job

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
ARGS = ["--model", "mlp", "--steps", str(STEPS), "-b", "8", "-m", "2", "--threads", "1"]
TIMEOUT_S = 240


def edgetrain(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``edgetrain ARGS`` in its own session; on timeout kill it and every rank it started."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgetrain.cli", *args],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def ok_json(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


def assert_close_losses(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) == STEPS
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)


@pytest.fixture(scope="module")
def independent() -> ReferenceRun:
    """The plain PyTorch loop on the job of ``ARGS`` (seed 0, SGD lr 0.05, momentum 0.9)."""
    return train_reference("mlp", steps=STEPS, batch_size=8, seed=0)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """One device, in process: the JSON and the saved weights (one stage: the reference)."""
    weights = tmp_path_factory.mktemp("reference") / "one.safetensors"
    out = ok_json(
        edgetrain(
            "train",
            *ARGS,
            "--transport",
            "inprocess",
            "--devices",
            "1",
            "--json",
            "--save-weights",
            str(weights),
        )
    )
    assert len(out["plan"]["stages"]) == 1
    return out, weights


@pytest.mark.slow
def test_two_ranks_print_the_same_json_and_train_like_one_device(
    tmp_path: Path, reference: tuple[dict[str, Any], Path], independent: ReferenceRun
) -> None:
    ref, ref_weights = reference
    weights = tmp_path / "two.safetensors"
    out = ok_json(
        edgetrain(
            "train",
            *ARGS,
            "--transport",
            "dist",
            "--devices",
            "2",
            "--partition",
            "even",
            "--json",
            "--save-weights",
            str(weights),
        )
    )
    assert set(ref) <= set(out)  # every key of the in-process (and MQTT) path
    for key in (
        "losses",
        "samples_per_s",
        "plan",
        "transport",
        "job",
        "steps",
        "wall_s",
        "stages",
        "replicas",
        "processes",
    ):
        assert key in out, key
    assert out["transport"] == "dist" and out["steps"] == STEPS
    assert (out["replicas"], out["processes"]) == (1, 2)
    assert len(out["plan"]["stages"]) == 2 and [s["stage"] for s in out["stages"]] == [0, 1]
    assert out["samples_per_s"] > 0 and out["wall_s"] > 0
    assert all(s["bytes_sent"] > 0 and s["bytes_received"] > 0 for s in out["stages"])
    assert_close_losses(out["losses"], ref["losses"])
    got, want = safetensors.torch.load_file(weights), safetensors.torch.load_file(ref_weights)
    assert_matches(out["losses"], got, independent)
    assert got.keys() == want.keys() and got
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-7, msg=key)


@pytest.mark.slow
def test_two_replicas_of_one_stage_train_like_one_device(
    tmp_path: Path, reference: tuple[dict[str, Any], Path], independent: ReferenceRun
) -> None:
    """One stage is the point: two data-parallel replicas of the whole model, alone."""
    weights = tmp_path / "replicas.safetensors"
    out = ok_json(
        edgetrain(
            "train",
            *ARGS,
            "--transport",
            "dist",
            "--devices",
            "2",
            "--replicas",
            "2",
            "--json",
            "--save-weights",
            str(weights),
        )
    )
    assert_matches(out["losses"], safetensors.torch.load_file(weights), independent)
    assert (out["replicas"], out["processes"]) == (2, 2)
    assert len(out["plan"]["stages"]) == 1
    assert_close_losses(out["losses"], reference[0]["losses"])


@pytest.mark.slow
@pytest.mark.parametrize("sizes", ["2,1", "1,2,1"])
def test_group_sizes_over_dist_train_like_one_device(
    tmp_path: Path, sizes: str, independent: ReferenceRun
) -> None:
    """``--transport dist --partition even --group-sizes``: a stage on a group of two ranks,
    each on half of every microbatch, its gradients summed by one all-reduce; the run
    equals the plain PyTorch loop."""
    weights = tmp_path / "groups.safetensors"
    devices = sum(int(n) for n in sizes.split(","))
    out = ok_json(
        edgetrain(
            "train",
            *ARGS,
            "--transport",
            "dist",
            "--devices",
            str(devices),
            "--partition",
            "even",
            "--group-sizes",
            sizes,
            "--json",
            "--save-weights",
            str(weights),
        )
    )
    stages = out["plan"]["stages"]
    want = [int(n) for n in sizes.split(",")]
    assert [len(s["devices"]) for s in stages] == want
    assert stages[want.index(2)]["shares"] == [0.5, 0.5]  # copies of this machine
    assert (out["replicas"], out["processes"]) == (1, devices)
    assert all(s["bytes_sent"] > 0 and s["bytes_received"] > 0 for s in out["stages"])
    assert_matches(out["losses"], safetensors.torch.load_file(weights), independent)


@pytest.mark.parametrize(
    ("extra", "names"),
    [
        (
            ["--transport", "dist", "--replicas", "2", "--devices", "3"],
            "--devices 3 is not a multiple of --replicas 2",
        ),
        (
            ["--transport", "mqtt", "--replicas", "2", "--devices", "2"],
            "--replicas is for --transport dist",
        ),
        (
            ["--transport", "mqtt", "--device", "cuda", "--devices", "2"],
            "--device is for --transport dist, or --servers' agents",
        ),
        (
            ["--transport", "dist", "--devices", "2", "--replicas", "2", "-b", "6"],
            "--batch-size 6 is not a multiple of --microbatches x --replicas",
        ),
        (
            [
                "--transport=dist",
                "--devices=4",
                "--replicas=2",
                "--partition=even",
                "--group-sizes=2,2",
            ],
            "--group-sizes runs without --replicas",
        ),
    ],
)
def test_bad_dist_input_exits_2_with_one_line(extra: list[str], names: str) -> None:
    """Refused before anything runs: no plan, no stages to count. In this process through
    the command's entry point (support.cli); test_train_cli runs a refusal as a process."""
    assert names in one_line_error(edgetrain_here("train", *ARGS, *extra))


def test_launch_of_a_missing_file_names_it(tmp_path: Path) -> None:
    """Refused before anything runs: no plan, no stages to count."""
    missing = tmp_path / "nope.toml"
    line = one_line_error(edgetrain("launch", str(missing)))
    assert str(missing) in line


def test_launch_of_an_invalid_file_names_the_problem(tmp_path: Path) -> None:
    """Refused before anything runs: no plan, no stages to count. In this process (the
    missing file above runs as a real process)."""
    path = tmp_path / "job.toml"
    path.write_text('model = "mlp"\nsteps = 2\nbatch_size = 8\nreplica = 2\n')
    line = one_line_error(edgetrain_here("launch", str(path)))
    assert str(path) in line and "replica" in line


def test_launch_runs_a_job_file_into_the_output_it_is_given(
    tmp_path: Path, reference: tuple[dict[str, Any], Path]
) -> None:
    job = DistJob(
        model="mlp",
        steps=STEPS,
        batch_size=8,
        microbatches=2,
        stages=2,
        output=str(tmp_path / "not-used"),
    )
    path = tmp_path / "job.toml"
    write_job(job, path)
    output = tmp_path / "results"
    out = ok_json(edgetrain("launch", str(path), "--json", "--output", str(output)))
    assert (out["job"], out["output"], out["stages"], out["replicas"]) == (
        job.job,
        str(output),
        2,
        1,
    )
    assert all(math.isfinite(x) for x in out["losses"])
    assert_close_losses(out["losses"], reference[0]["losses"])
    assert json.loads((output / "losses.json").read_text())["losses"] == out["losses"]
    for name in (
        "job.toml",
        "weights-stage0.safetensors",
        "weights-stage1.safetensors",
        "state-stage0.safetensors",
        "state-stage1.safetensors",
        "reports-rank0.jsonl",
        "reports-rank1.jsonl",
    ):
        assert (output / name).is_file(), name
    assert not (tmp_path / "not-used").exists()  # --output overrides the file's
