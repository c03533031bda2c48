"""A stage's units under ``torch.compile``, and the seconds compiling takes.

[Note: compiled stages]
A job with ``compile: true`` runs every stage's forward through
``torch.compile(segment)`` (inductor, torch's default compiler), on an agent's CPU and a
server's GPU alike; its backward is the compiled graph's, as autograd runs it. The
segment keeps its parameters, so the optimizer, the weights a stage reports and the
state it hands over are the same objects as without compiling. Compiling happens
inside the first forward and the first backward of each input shape the stage sees
(the first step; a group member's rows and a step's microbatches keep their shape
after it), and on this 2-core host took about 10 s for two MLP stages and 50 s for
two gpt-mini blocks (less once inductor's cache on disk holds the graphs), so it is
counted apart. Each stage compiles through its own :class:`CompileWatch`, a backend
that is inductor's own (``compile_fx``) counting the graphs it compiles: the
forward's and, when autograd first runs the graph backward (on whatever thread), the
backward's. A compute block of the stage in which the count grew (a forward whose
call traced and compiled, or a backward that compiled) is counted whole as
compiling: dynamo traces the Python code before the backend is called, in the same
call, and the graph's one run after it is a small part of the block. Those blocks
are the step's ``compile_s`` and not in its compute; a device that emulates a slower
one (``slowdown``) is not made to wait for them again.

A zero-bubble schedule is refused with ``compile`` (:class:`~edge.config.TrainConfigBase`
checks it, and ``schedule: auto`` does not choose it). It splits each backward in two
passes through the autograd graph ([Note: where the graph is cut] in
:mod:`edge.runtime.split_backward`), and a compiled segment's backward is one node,
which would run whole in both. AOT autograd also refuses to run it twice unless a
setting (``donated_buffer``) is off in every thread that compiles or runs it; that
setting is a context variable, and autograd runs a GPU's backward on threads of its own.

Tested in tests/integration/test_compiled_stages.py (a compiled 2-stage pipeline
equals the eager reference; the compile seconds are reported on the first step and
not in its compute).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["CompileWatch", "compiled"]


class CompileWatch:
    """A ``torch.compile`` backend: inductor, counting the graphs it compiles."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._compiles = 0
        self._outer = threading.local()

    @property
    def compiles(self) -> int:
        """Graphs compiled so far: each forward, and each backward when it first ran."""
        with self._lock:
            return self._compiles

    def _count(self) -> None:
        with self._lock:
            self._compiles += 1

    def __call__(self, graph: torch.fx.GraphModule, inputs: Sequence[Any]) -> Any:
        from torch._inductor.compile_fx import compile_fx

        self._count()
        self._outer.active = True
        try:
            return compile_fx(graph, inputs, inner_compile=self._inner)
        finally:
            self._outer.active = False

    def _inner(self, *args: Any, **kwargs: Any) -> Any:
        """Inductor's code generation of one graph; a lazy backward's counts here."""
        from torch._inductor.compile_fx import compile_fx_inner

        if not getattr(self._outer, "active", False):
            self._count()
        return compile_fx_inner(*args, **kwargs)


def compiled(segment: nn.Module) -> tuple[Callable[[torch.Tensor], torch.Tensor], CompileWatch]:
    """``segment``'s forward under ``torch.compile`` (sharing its parameters), and the
    watch on its compiling."""
    watch = CompileWatch()
    return torch.compile(segment, backend=watch), watch
