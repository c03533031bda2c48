"""One rank of a server-tier job: ``python -m edge.server.worker JOB.toml``.

``edgetrain launch`` starts one of these per process with torchrun's
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``). The rank joins the job's process group (gloo on CPUs; on GPUs
gloo for host frames and NCCL for CUDA tensors, see [Note: host frames] in
:mod:`edge.transport.dist`), builds its stage (:mod:`edge.server.job_file`
says which), runs it over :class:`~edge.transport.dist.DistTransport` with
gradients averaged across replicas (or, on a stage group, summed over its
members: one bucketed all-reduce over their process group), and writes its
results to the job's output directory. A rank that fails exits non-zero, and
the launcher stops the rest.

Tested in tests/e2e/test_dist_parity.py (every rank of a launched job) and
tests/e2e/test_train_dist_cli.py::test_launch_runs_a_job_file_into_the_output_it_is_given.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from edge.errors import UserError
from edge.files import write_atomic
from edge.models.zoo import get_model
from edge.runtime.allocator import tune_malloc
from edge.runtime.checkpoint import load_state, select
from edge.runtime.stage import StageDevice, StageRuntime
from edge.server.data_parallel import DataParallel
from edge.server.job_file import DistJob, load_job, resume_states
from edge.transport.dist import DistTransport, Route
from edge.wire.messages import StepReport

__all__ = ["main", "run_rank"]


def _backend(job: DistJob, local_rank: int) -> tuple[str, str]:
    """The process group backend and this rank's torch device."""
    if job.device == "cuda":
        if not torch.cuda.is_available():
            raise UserError("device = 'cuda' but torch sees no GPU on this node")
        torch.cuda.set_device(local_rank)
        return "cpu:gloo,cuda:nccl", f"cuda:{local_rank}"
    return "gloo", "cpu"


def run_rank(job: DistJob, rank: int, local_rank: int = 0) -> list[StepReport]:
    """Run this rank's stage of ``job`` to the end (the process group must not exist yet)."""
    backend, device = _backend(job, local_rank)
    dist.init_process_group(backend, timeout=timedelta(seconds=job.recv_timeout_s))
    try:
        if dist.get_world_size() != job.world_size:
            raise UserError(
                f"the job has {job.layout} = {job.world_size} processes, "
                f"but the world has {dist.get_world_size()}"
            )
        return _run(job, rank, device)
    finally:
        dist.destroy_process_group()


def _data_parallel(job: DistJob, stage: int) -> DataParallel | None:
    """The process group ``stage`` reduces its gradients over: its replicas' copies, or
    its group's members; ``None`` for neither. Every rank creates every process group,
    in the same order (a collective requirement)."""
    sizes, replicas = job.group_sizes, job.replicas
    if job.groups is not None:
        members = [
            dist.new_group([job.rank(s, 0, m) for m in range(size)]) if size > 1 else None
            for s, size in enumerate(sizes)
        ]
        return DataParallel(members[stage], sizes[stage]) if sizes[stage] > 1 else None
    copies = [dist.new_group([job.rank(s, r) for r in range(replicas)]) for s in range(len(sizes))]
    return DataParallel(copies[stage], replicas) if replicas > 1 else None


def _run(job: DistJob, rank: int, device: str) -> list[StepReport]:
    stages = job.num_stages
    stage, replica, member = job.place(rank)
    dp = _data_parallel(job, stage)
    first_step, states = 0, None
    if job.resume_from:
        units = get_model(job.model, seed=job.seed, **job.model_options).num_units
        first_step, states = resume_states(Path(job.resume_from), units)
        if first_step >= job.steps:
            raise UserError(f"resume_from holds step {first_step}; the job has {job.steps} steps")
    a = job.assignment(stage, replica, first_step, member)
    sizes = job.group_sizes
    route = Route(
        stages, {s: tuple(job.rank(s, replica, m) for m in range(sizes[s])) for s in range(stages)}
    )
    transport = DistTransport(route)
    reports: list[StepReport] = []
    rt = StageRuntime(
        a,
        transport,
        on=StageDevice(device_id=f"rank{rank}", torch_device=device),
        report=reports.append,
        data_parallel=dp,
    )
    if states is not None:
        load_state(rt.segment, rt.optimizer, select(states, a.start, a.end, rt.unit_names))
    dist.barrier()  # every stage is built and receiving before any frame is sent
    rt.run()
    out = Path(job.output)
    out.mkdir(parents=True, exist_ok=True)
    lines = "".join(r.model_dump_json() + "\n" for r in reports)
    write_atomic(out / f"reports-rank{rank}.jsonl", lines.encode())
    if replica == 0 and member > 0:  # read_results checks that they equal member 0's
        write_atomic(out / f"weights-stage{stage}-member{member}.safetensors", rt.weights())
    elif replica == 0:
        write_atomic(out / f"weights-stage{stage}.safetensors", rt.weights())
        write_atomic(out / f"state-stage{stage}.safetensors", rt.state(job.steps))
        if a.is_last:
            losses = [r.loss for r in reports]
            data = {"job": job.job, "first_step": first_step, "losses": losses}
            write_atomic(out / "losses.json", json.dumps(data).encode())
    dist.barrier()  # results are on disk before any rank reports success
    return reports


def main(argv: list[str] | None = None) -> int:
    """Entry point of one rank; returns the exit status."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m edge.server.worker JOB.toml", file=sys.stderr)
        return 2
    tune_malloc()
    try:
        job = load_job(Path(args[0]))
        run_rank(job, int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")))
    except UserError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    except KeyError as exc:
        print(
            f"error: {exc.args[0]} is not set: ranks start with edgetrain launch", file=sys.stderr
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
