"""The backward of one call as a unit, on the user's own graph: the gradients flowing into its outputs (upstream)
and out of it into each input, from hooks on the autograd nodes the call created.

A call may create one autograd node (``torch.mm``) or many (``cross_entropy`` is ``log_softmax`` then
``nll_loss``; attention on a device is a dozen). Before the op runs, each input's gradient edge is taken (for an
in-place op, the edge the input had before the op moved it). After it runs, the nodes it created are those
reachable from its outputs with an autograd sequence number from the one taken before the call; the edges from
those nodes to the inputs' edges carry the call's input gradients. A pre-hook on each output's node records the
upstream gradients, a post-hook on each node with such an edge records what it sends; when the last of them
ran, ``callback(upstream, input_grads)`` is called once.

Nothing is added to the graph, nothing is saved: the values, the graph, ``torch.utils.checkpoint``'s
recomputation and double backward are exactly as without a tool.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch
from torch._C._autograd import _get_sequence_nr as sequence_nr

from ..ops.arguments import iter_tensors

_get_gradient_edge: Callable | None
try:
    _get_gradient_edge = torch.autograd.graph.get_gradient_edge  # PyTorch >= 2.4
except AttributeError:
    _get_gradient_edge = None


def gradient_edge(t: torch.Tensor) -> tuple:
    """``(node, output_nr)`` through which gradients reach ``t``: its grad_fn, or a leaf's AccumulateGrad node."""
    if _get_gradient_edge is not None:
        edge = _get_gradient_edge(t)
        return edge.node, edge.output_nr
    if t.grad_fn is not None:
        return t.grad_fn, t.output_nr
    view_node = t.expand_as(t).grad_fn
    assert view_node is not None  # t takes gradients, so a view of it has a node
    return view_node.next_functions[0][0], 0  # a leaf: the accumulator behind a fresh view's node


# One lock for every call's hooks: each holds it for a few assignments, and a lock per call would be one more object
# for the garbage collector to promote, for every call followed from its forward to its backward.
_LOCK = threading.Lock()


def summed(pieces: torch.Tensor, piece: torch.Tensor) -> torch.Tensor:
    """An input's gradient pieces, summed as they arrive: the engine's own kernel, in a function of its own so that
    the blind-spot sweep (``benchmarks/blind_spots.py``), whose faults are in the op's kernels, runs it unfaulted."""
    return pieces + piece


class CallBackward:
    """Built just before the op runs, attached to its result just after (see the module docstring).

    A call is followed from its forward to its backward, so whatever it holds lives long enough for the garbage
    collector to promote it into its oldest generation, whose full collections visit the program's whole heap: its
    hooks are small objects (``_UpstreamHook``, ``_GradientHook``), not closures."""

    __slots__ = ("edges", "first", "upstream", "grads", "waiting", "handles", "callback", "started", "finished",
                 "_on_start", "_on_upstream")

    def __init__(self, inputs: list[torch.Tensor]) -> None:
        self.edges = [gradient_edge(t) for t in inputs]
        self.first = sequence_nr()
        self.upstream: list = []  # replaced when attached, as handles: these die young
        self.grads: list = [None] * len(inputs)
        self.waiting = 0
        self.handles: list = []
        self.callback: Callable | None = None
        self.started = False
        self.finished = False
        self._on_start = None
        self._on_upstream: Callable[[int, torch.Tensor], None] | None = None

    def attach(self, result, callback: Callable[[tuple, tuple, bool], None], on_start=None,
               on_again: Callable[[], None] | None = None,
               on_upstream: Callable[[int, torch.Tensor], None] | None = None) -> str | None:
        """Hook the nodes the call created; ``callback(upstream, input_grads, complete)`` runs once they all ran.

        Returns None when hooked, else why the call's backward cannot be followed (nothing hooked).
        ``on_start(self)`` runs at the first hook, so that a caller can finish an incomplete backward later.
        ``on_again()`` runs each time the call's backward runs again over a graph kept for it (``retain_graph``),
        which ``callback`` does not see: its hooks are gone after the first.
        ``on_upstream(index, gradient)`` runs as each output's upstream gradient arrives, before the node that reads
        it runs: what it reads then is what the call's backward was given.
        """
        outputs, seen = [], set()
        for t in iter_tensors(result):
            if id(t) not in seen:
                seen.add(id(t))
                outputs.append(t)
        nodes: dict[int, torch.autograd.graph.Node] = {}  # the call's nodes, by id
        roots: dict[int, list[tuple[int, int]]] = {}  # node id -> [(output index, output_nr)]
        for index, t in enumerate(outputs):
            node = t.grad_fn
            if node is None:
                continue
            if node._sequence_nr() < self.first:
                return "output aliases an input"  # an input handed back with its own history
            nodes[id(node)] = node
            roots.setdefault(id(node), []).append((index, t.output_nr))
        if not roots:
            return ""  # no output carries gradients
        stack = list(nodes.values())
        while stack:
            for next_node, _ in stack.pop().next_functions:
                if next_node is None or id(next_node) in nodes:
                    continue
                if next_node._sequence_nr() >= self.first and type(next_node).__name__ != "AccumulateGrad":
                    nodes[id(next_node)] = next_node
                    stack.append(next_node)
        edge_to_input: dict[tuple[int, int], list[int]] = {}
        for k, (node, output_nr) in enumerate(self.edges):
            edge_to_input.setdefault((id(node), output_nr), []).append(k)
        frontier: dict[int, list[tuple[int, int]]] = {}  # node id -> [(its grad_input index, input k)]
        for node_id, node in nodes.items():
            for i, (next_node, output_nr) in enumerate(node.next_functions):
                if next_node is None or id(next_node) in nodes:
                    continue
                for k in edge_to_input.get((id(next_node), output_nr), ()):
                    frontier.setdefault(node_id, []).append((i, k))
        if not frontier:
            return "no gradient reaches an input"
        self.upstream = [None] * len(outputs)
        self.waiting = len(frontier)
        self.callback = callback
        self._on_start = on_start
        self._on_upstream = on_upstream
        handles = self.handles = []
        for node_id, outs in roots.items():
            handles.append(nodes[node_id].register_prehook(_UpstreamHook(self, tuple(outs))))
        for node_id, pairs in frontier.items():
            handles.append(nodes[node_id].register_hook(_GradientHook(self, tuple(pairs))))
        if on_again is not None:  # kept on the node as long as the graph lives (nothing of the call held)
            nodes[next(iter(roots))].register_prehook(_AgainHook(on_again))
        return None

    def upstream_arrived(self, outs: tuple, grad_outputs) -> None:
        with _LOCK:
            self._start()
            if self.finished:  # a hook run after its removal, on another thread
                return
            for index, output_nr in outs:
                self.upstream[index] = grad_outputs[output_nr]
            on_upstream = self._on_upstream
        if on_upstream is not None:
            for index, output_nr in outs:
                if grad_outputs[output_nr] is not None:
                    on_upstream(index, grad_outputs[output_nr])

    def gradients_sent(self, pairs: tuple, grad_inputs) -> None:
        with _LOCK:
            self._start()
            if self.finished:  # a hook run after its removal, on another thread
                return
            grads = self.grads
            for i, k in pairs:
                g = grad_inputs[i]
                if g is not None:
                    grads[k] = g if grads[k] is None else summed(grads[k], g)
            self.waiting -= 1
            done = self.waiting == 0
            if done:
                self.finished = True
        if done:
            self._finish(True)

    def _start(self) -> None:
        if not self.started:
            self.started = True
            if self._on_start is not None:
                self._on_start(self)

    def finish_incomplete(self) -> None:
        """At the end of a backward pass that ran only part of the call's nodes: report what arrived."""
        with _LOCK:
            if self.finished or not self.started:
                return
            self.finished = True
        self._finish(False)

    def _finish(self, complete: bool) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        callback, self.callback = self.callback, None
        self._on_upstream = None
        upstream, grads = tuple(self.upstream), tuple(self.grads)
        self.upstream, self.grads, self.edges = [], [], []
        if callback is not None:
            callback(upstream, grads, complete)


class _UpstreamHook:
    """A pre-hook on an output's node: the gradients flowing into the call's outputs ``outs`` (index, output_nr)."""

    __slots__ = ("owner", "outs")

    def __init__(self, owner: CallBackward, outs: tuple) -> None:
        self.owner, self.outs = owner, outs

    def __call__(self, grad_outputs) -> None:
        self.owner.upstream_arrived(self.outs, grad_outputs)


class _GradientHook:
    """A post-hook on a node with edges to the call's inputs: ``pairs`` (its grad_input index, input k)."""

    __slots__ = ("owner", "pairs")

    def __init__(self, owner: CallBackward, pairs: tuple) -> None:
        self.owner, self.pairs = owner, pairs

    def __call__(self, grad_inputs, grad_outputs) -> None:
        self.owner.gradients_sent(self.pairs, grad_inputs)


class _AgainHook:
    """A pre-hook on the node of a call's first output, left there: each run after its first is the call's backward
    run again over a retained graph (``on_again``)."""

    __slots__ = ("on_again", "runs")

    def __init__(self, on_again: Callable[[], None]) -> None:
        self.on_again, self.runs = on_again, 0

    def __call__(self, grad_outputs) -> None:
        self.runs += 1
        if self.runs > 1:
            self.on_again()
