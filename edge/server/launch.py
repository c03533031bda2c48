"""Start this node's ranks of a server-tier job, with torchrun semantics.

One process per GPU (or per ``nproc_per_node`` on CPUs), rendezvous over c10d
at ``rdzv_endpoint`` (every node runs the same call with the same endpoint;
one node by default, on a free local port), torch.distributed's elastic agent
watching the processes: if one fails, the rest are stopped and :func:`launch`
raises. Each process is :mod:`edge.server.worker`; the job file is
:class:`edge.server.job_file.DistJob`, and the node count times processes per
node must equal its world size (stages times replicas, or its groups' members).

Tested in tests/e2e/test_dist_parity.py and tests/e2e/test_dist_group_parity.py.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from edge.errors import UserError
from edge.server.job_file import DistJob, write_job

__all__ = ["launch"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(
    job: DistJob,
    *,
    nnodes: int = 1,
    nproc_per_node: int | None = None,
    rdzv_endpoint: str | None = None,
    threads: int | None = None,
) -> None:
    """Start this node's processes of ``job`` and wait for them.

    The job, with its id fixed, is written to ``output/job.toml`` first: every
    rank reads that file (a job file without ``job`` would give each its own).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    nproc = nproc_per_node or max(1, job.world_size // nnodes)
    if nnodes * nproc != job.world_size:
        raise UserError(
            f"{nnodes} node(s) x {nproc} processes = {nnodes * nproc}, but the job needs "
            f"{job.layout} = {job.world_size}"
        )
    if rdzv_endpoint is None:
        if nnodes > 1:
            raise UserError("--rdzv-endpoint HOST:PORT is needed with more than one node")
        rdzv_endpoint = f"127.0.0.1:{_free_port()}"
    job_file = Path(job.output) / "job.toml"
    job_file.parent.mkdir(parents=True, exist_ok=True)
    write_job(job, job_file)
    config = LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nproc,
        run_id=job.job,
        rdzv_backend="c10d",
        rdzv_endpoint=rdzv_endpoint,
        max_restarts=0,
        monitor_interval=0.2,
        start_method="spawn",
        rdzv_configs={"join_timeout": 120},
        local_addr="127.0.0.1" if nnodes == 1 else None,
    )
    # The workers inherit this process's environment: torch threads per rank.
    previous = os.environ.get("OMP_NUM_THREADS")
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        elastic_launch(config, sys.executable)("-m", "edge.server.worker", str(job_file))
    except ChildFailedError as exc:
        ranks = sorted(exc.failures)
        detail = f": rank {ranks[0]} exited {exc.failures[ranks[0]].exitcode}" if ranks else ""
        raise UserError(f"job {job.job} failed{detail} (its output is above)") from None
    finally:
        if threads is not None:
            if previous is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = previous
