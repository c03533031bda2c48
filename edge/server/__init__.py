"""The server tier: the same plan run by torch.distributed ranks on GPU servers.

- :mod:`edge.server.job_file`: the job file (``job.toml``), rank layout and results;
- :mod:`edge.server.launch`: start one node's ranks (torchrun semantics);
- :mod:`edge.server.worker`: one rank (``python -m edge.server.worker JOB.toml``);
- :mod:`edge.server.groups`: an agent joining or leaving a job's process group;
- :mod:`edge.server.data_parallel`: averaging gradients and losses across replicas.
"""

__all__: list[str] = []
