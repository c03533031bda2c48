"""The fixed choices of a job trained on this machine, as ``Literal`` types.

Torch-free, so that ``edgetrain train`` offers them (typer lists a ``Literal``'s
values, and refuses any other) without importing the engine ([Note: commands without
torch] in :mod:`edgetrain.cli`). The first three are the local run's own
(:class:`~coordinator.local.options.LocalTraining`); the rest are the job's, as
:class:`~coordinator.engine.spec.JobSpec` and :class:`~edge.config.OptimizerSpec`
declare them, repeated here because those modules import torch or are another
layer's; a test keeps them equal.

Tested in tests/unit/coordinator/local/test_local_choices.py.
"""

from __future__ import annotations

from typing import Literal

__all__ = [
    "Labels",
    "Objective",
    "OptimizerName",
    "Partition",
    "TorchDevice",
    "Transport",
    "UnitTimes",
]

Transport = Literal["mqtt", "inprocess", "dist"]
"""Where the stages run: agent processes driven over a broker, threads of this process,
or the server tier (one torch.distributed rank per stage and replica)."""
TorchDevice = Literal["cpu", "cuda"]
"""What the server tier's ranks compute on (``cuda``: one GPU each)."""
Labels = Literal["central", "local"]
"""Where local data's labels go: to the last stage, or nowhere (the holders run the loss)."""
Partition = Literal["plan", "even"]
Objective = Literal["time", "energy"]
UnitTimes = Literal["host", "devices"]
OptimizerName = Literal["sgd", "adamw"]
