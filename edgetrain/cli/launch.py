"""``edgetrain launch job.toml``: run a server-tier job with torchrun semantics.

Every node runs the same command with the same ``--rdzv-endpoint``; the work is
:func:`edge.server.launch.launch`. The command prints one summary line (or
``--json``) once this node's ranks are done.

Tested in tests/e2e/test_train_dist_cli.py::test_launch_of_a_missing_file_names_it,
::test_launch_of_an_invalid_file_names_the_problem and
::test_launch_runs_a_job_file_into_the_output_it_is_given.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from edge.server.job_file import DistJob, DistResults

__all__ = ["launch_command"]


def launch_command(
    job_file: Path = typer.Argument(..., help="The job (TOML): model, steps, split, replicas."),
    nnodes: int = typer.Option(1, "--nnodes", min=1, help="Nodes taking part."),
    nproc_per_node: int | None = typer.Option(
        None, "--nproc-per-node", min=1, help="Processes (GPUs) on this node (default: all)."
    ),
    rdzv_endpoint: str | None = typer.Option(
        None, "--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous (needed for > 1 node)."
    ),
    output: Path | None = typer.Option(None, "--output", help="Results directory (overrides)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON summary at the end."),
) -> None:
    """Run a server-tier job over torch.distributed (torchrun semantics)."""
    from edge.server.job_file import load_job, read_results  # [Note: commands without torch]
    from edge.server.launch import launch

    job = load_job(job_file, output=str(output) if output else None)
    launch(job, nnodes=nnodes, nproc_per_node=nproc_per_node, rdzv_endpoint=rdzv_endpoint)
    done = (Path(job.output) / "losses.json").exists()  # on the node of the last stage
    results = read_results(Path(job.output), job) if done else None
    summary = {
        "job": job.job,
        "output": job.output,
        "stages": job.num_stages,
        "replicas": job.replicas,
    }
    if results is not None:
        summary.update(
            losses=results.losses, wall_s=results.wall_s, samples_per_s=_rate(job, results)
        )
    if json_out:
        typer.echo(json.dumps(summary))
    elif results is not None and results.losses:
        typer.echo(
            f"job {job.job}: {len(results.losses)} steps, final loss "
            f"{results.losses[-1]:.4f}, {summary['samples_per_s']:.1f} samples/s "
            f"({job.num_stages} stages x {job.replicas} replicas); "
            f"results in {job.output}"
        )
    else:
        typer.echo(f"job {job.job}: done; results in {job.output}")


def _rate(job: DistJob, results: DistResults) -> float:
    wall = results.wall_s
    return len(results.losses) * job.batch_size / wall if wall > 0 else 0.0
