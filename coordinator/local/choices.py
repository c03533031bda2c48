"""The fixed choices of a job trained on this machine, as ``Literal`` types.

``edgetrain train`` offers them (typer lists a ``Literal``'s values, and refuses any
other). ``Transport`` and ``TorchDevice`` are the local run's own, declared here
(:class:`~coordinator.local.options.LocalTraining`); the rest are the job's, declared
once where the job is (:mod:`coordinator.engine.spec`, :mod:`edge.config`: both
torch-free, [Note: commands without torch] in :mod:`edgetrain.cli`) and only gathered
here for the command. ``--schedule`` and ``--unit-times`` stay text that the job's own
types check, so ``train`` refuses a bad one with the message the REST API gives.

Tested in tests/unit/coordinator/local/test_local_choices.py.
"""

from __future__ import annotations

from typing import Literal

from coordinator.engine.spec import Labels, Objective, Partition
from edge.config import OptimizerName

__all__ = [
    "Labels",
    "Objective",
    "OptimizerName",
    "Partition",
    "TorchDevice",
    "Transport",
]

Transport = Literal["mqtt", "inprocess", "dist"]
"""Where the stages run: agent processes driven over a broker, threads of this process,
or the server tier (one torch.distributed rank per stage and replica)."""
TorchDevice = Literal["cpu", "cuda"]
"""What the server tier's ranks compute on (``cuda``: one GPU each)."""
