"""Everything a worker runs, on an edge box or a GPU server.

- :mod:`edge.config`: :class:`TrainConfig`, every setting a job trains with, validated once;
- :mod:`edge.agent`: the daemon (connect, register, heartbeat, obey assignments);
- :mod:`edge.problem`: the planning problem's types, shared with the coordinator;
- :mod:`edge.errors`, :mod:`edge.logs`: one-line user errors; logging set-up;
- :mod:`edge.wire`: the wire contract (topics, control messages, tensor frames);
- :mod:`edge.transport`: moving frames (MQTT, in-process, torch.distributed);
- :mod:`edge.runtime`: one pipeline stage, its schedules, checkpoints and data;
- :mod:`edge.server`: the server tier (job files, launch, ranks, process groups);
- :mod:`edge.models`: the model zoo as units, datasets, per-unit costs;
- :mod:`edge.profiling`: measuring this device, and the device catalogue.

Nothing here imports :mod:`coordinator` or :mod:`edgetrain`; ``__version__`` is the
installed distribution's, read from its package metadata.
"""

from importlib.metadata import PackageNotFoundError, version

__all__ = ["__version__"]

try:
    __version__ = version("edgetrain")
except PackageNotFoundError:  # sources on the path that were never installed
    __version__ = "0+unknown"
