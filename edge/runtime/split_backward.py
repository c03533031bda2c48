"""A backward split in two, for the zero-bubble schedule: the input's gradient now, the
weights' later.

A zero-bubble stage ([Note: zero bubble] in :mod:`edge.runtime.schedules`) runs a
microbatch's backward as two actions. ``B`` computes only the gradient of the stage's
input, which the stage before is waiting for; ``W`` computes the weights' gradients,
whenever the schedule finds the time. :func:`input_backward` runs ``B`` and returns a
:class:`WeightBackward`, whose :meth:`~WeightBackward.run` is ``W``.

[Note: where the graph is cut]
Walk the autograd graph from the output. The nodes on some path from the output to
the input are the *input closure*: ``B`` runs them, and autograd skips every output
of theirs that no path to the input needs (a matmul's weight gradient among them).
Every path from the output to a weight leaves the closure at some node of it, a
*frontier* node. Hooks on the frontier keep the gradient each node receives in ``B``.
``W`` then starts autograd at each frontier node, with the gradient it kept, and runs
it to the weights that node's exits reach without re-entering the closure. No closure
node runs again, and each weight's gradient is the one a whole backward gives, bit for
bit. ``W`` accumulates into ``.grad`` the way a whole backward does, through the
weights' accumulators. So post-accumulate-grad hooks fire (the group sum's overlap),
and the microbatches' gradients add up in the same order.

A weight reached from two frontier nodes (tied weights) would take two passes' worth
from one node's pass. Then ``W`` is one pass from every frontier node, each node's
incoming gradient replaced by the one it kept, as in ``torch.distributed.pipelining``'s
``stage_backward_weight``. It is exact, but recomputes the closure between them.

The cut is that module's ``stage_backward_input``, written here for three reasons:

- that module is private;
- importing it takes seconds on a small device;
- its weight pass assigns ``.grad`` directly, so no hook sees it, and it runs the
  closure again.

When the input takes no gradient (stage 0 reads data, a stage fed token ids), there
is no closure. ``B`` does nothing and ``W`` is the whole backward.

Tested in tests/unit/edge/runtime/test_split_backward.py.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node

__all__ = ["WeightBackward", "input_backward"]


@dataclass
class WeightBackward:
    """What ``W`` needs of one microbatch's ``B``: where to start and the gradients there."""

    params: list[torch.Tensor]
    """The weights ``W`` accumulates into."""
    whole: tuple[torch.Tensor, torch.Tensor | None] | None = None
    """With no input closure: the output and its gradient, for a whole backward."""
    exits: list[tuple[Node, list[torch.Tensor]]] = field(default_factory=list)
    """Per frontier node, the weights its exits reach without entering the closure."""
    shared: bool = False
    """Whether two frontier nodes reach one weight (tied weights): one pass, clamped."""
    kept: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)
    """Per frontier node, the gradient it received in ``B``."""

    def run(self) -> None:
        """Accumulate the weights' gradients into ``.grad`` (a whole backward's, exactly)."""
        if self.whole is not None:
            out, grad = self.whole
            self.whole = None
            if self.params:
                torch.autograd.backward(out, grad, inputs=self.params)
            return
        exits, kept = self.exits, self.kept
        self.exits, self.kept = [], {}
        if self.shared:
            _clamped(exits, kept, self.params)
            return
        for node, params in exits:
            got = kept.get(node)
            roots = [(GradientEdge(node, i), g) for i, g in enumerate(got or ()) if g is not None]
            if roots and params:
                edges, grads = zip(*roots, strict=True)
                torch.autograd.backward(list(edges), list(grads), inputs=params)


def input_backward(
    out: torch.Tensor,
    grad: torch.Tensor | None,
    inp: torch.Tensor,
    params: Sequence[torch.Tensor],
) -> WeightBackward:
    """``B``: set ``inp.grad`` to the gradient of ``out`` (``grad`` for a non-scalar
    output) with respect to ``inp``, and return the ``W`` that finishes the backward."""
    weights = [p for p in params if p.requires_grad]
    if not inp.requires_grad or out.grad_fn is None:
        return WeightBackward(weights, whole=(out, grad))
    closure = _closure(out.grad_fn, _node_of(inp))
    if not closure:  # the output does not depend on the input
        return WeightBackward(weights, whole=(out, grad))
    by_node = {_node_of(p): p for p in weights}
    exits = []
    for node in closure:
        children = [c for c, _ in node.next_functions if c is not None and c not in closure]
        reached = _leaves(children, closure, by_node)
        if reached:
            exits.append((node, [by_node[leaf] for leaf in reached]))
    counted = [id(p) for _, ps in exits for p in ps]
    w = WeightBackward(weights, exits=exits, shared=len(counted) != len(set(counted)))
    handles = [node.register_prehook(_keep(w, node)) for node, _ in exits]
    try:
        (inp.grad,) = torch.autograd.grad(out, inp, grad, retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    return w


def _clamped(
    exits: list[tuple[Node, list[torch.Tensor]]],
    kept: dict[Node, tuple[torch.Tensor | None, ...]],
    params: list[torch.Tensor],
) -> None:
    """One pass from every frontier node, each node's incoming gradient replaced by the
    one it kept: a frontier node below another gets it once, not twice."""
    edges: list[GradientEdge] = []
    grads: list[torch.Tensor] = []
    handles = []
    for node, _ in exits:
        got = kept.get(node)
        if got is None:
            continue
        handles.append(node.register_prehook(lambda _grads, g=got: g))
        for i, g in enumerate(got):
            if g is not None:
                edges.append(GradientEdge(node, i))
                grads.append(g)
    try:
        if edges:
            torch.autograd.backward(edges, grads, inputs=params)
    finally:
        for handle in handles:
            handle.remove()


def _keep(w: WeightBackward, node: Node) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
    """A pre-hook that keeps the gradient ``node`` receives in ``w``."""

    def hook(grads: tuple[torch.Tensor | None, ...]) -> None:
        w.kept[node] = grads

    return hook


def _node_of(t: torch.Tensor) -> Node:
    """The node that takes ``t``'s gradient: its grad_fn, or a leaf's accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn
    view = t.view_as(t).grad_fn
    assert view is not None, "a tensor that requires grad has a node"
    node = view.next_functions[0][0]
    assert node is not None, "a leaf that requires grad has an accumulator"
    return node


def _closure(start: Node, target: Node) -> set[Node]:
    """The nodes on some path from ``start`` to ``target`` (both included if it is)."""
    parents: dict[Node, list[Node]] = {}
    seen, queue = {start}, deque([start])
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents.setdefault(child, []).append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    if target not in seen:
        return set()
    on_path, queue = {target}, deque([target])
    while queue:
        for parent in parents.get(queue.popleft(), []):
            if parent not in on_path:
                on_path.add(parent)
                queue.append(parent)
    return on_path


def _leaves(
    starts: list[Node], closure: set[Node], by_node: dict[Node, torch.Tensor]
) -> list[Node]:
    """The weights' accumulators reached from ``starts`` without entering ``closure``."""
    seen, queue, found = set(starts), deque(starts), []
    while queue:
        current = queue.popleft()
        if current in by_node:
            found.append(current)
        for child, _ in current.next_functions:
            if child is not None and child not in seen and child not in closure:
                seen.add(child)
                queue.append(child)
    return found
