"""The reference of a compiled graph (``compiled_regions.Region``): the graph dynamo traced (``torch.fx``), rerun node
by node on the host, as the reference of one op reruns the op.

The graph's inputs arrive as the reference's (host copies, cast); what the graph holds itself is mapped node by
node as an op's arguments are (``reference.map_arguments``): devices become the CPU, and, when the inputs are float64
(the reference run, not the same-dtype one), low-precision dtypes become float64 (``x.to(torch.bfloat16)``,
``x.half()``), constants are copied to the host and autocast regions are left out (the float64 reference of an
autocast op is the op in float64).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import os
import re

import torch
import torch.fx

from ..ops.arguments import iter_tensors, map_tensors
from ..ops.naming import is_inplace_op, resolve_op_name
from ..ops.op_facts import op_facts
from ..ops.random_calls import random_reason as _call_random_reason
from ..ops.writes import call_writes
from .comparison import compare_outputs, compare_tensors
from .reference import DEFAULT_CAST, map_arguments

# Tensor methods that cast to a dtype, as the dtype they cast to.
_DTYPE_METHODS = {"half": torch.float16, "bfloat16": torch.bfloat16, "float": torch.float32}
_AUTOCAST = frozenset({"_enter_autocast", "_exit_autocast"})


def random_reason(gm: torch.fx.GraphModule) -> str | None:
    """Why a graph is not rerun (it draws random numbers: dropout in training), or None."""
    for node in gm.graph.nodes:
        name = node_name(node)
        if name and _call_random_reason(name, node.args, node.kwargs):
            return f"random (a compiled graph with {name})"
    return None


def node_name(node: torch.fx.Node) -> str:
    """The op a node calls, named as the tools name calls (``torch.nn.functional.silu``); "" for other nodes."""
    if node.op == "call_function":
        return resolve_op_name(node.target)
    if node.op == "call_method":
        return f"torch.Tensor.{node.target}"
    return ""


# Python's operators as dynamo records them: those that write their first operand (``step += 1`` on a tensor) and
# the one that views it (``x[0]``); the others compute new values.
_WRITING_OPERATORS = frozenset({operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                                operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
                                operator.ilshift, operator.irshift, operator.imatmul, operator.setitem})
_PURE_MODULES = ("_operator", "operator", "math", "builtins")


def written_sources(gm: torch.fx.GraphModule) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """What a graph writes in place, directly or through a view: ``(positions of its inputs, targets of the tensors
    it holds)``. A compiled optimizer step writes the parameters and their state, which dynamo makes attributes of
    the graph (``get_attr``), and returns nothing; ``x.add_(1)`` on an input writes that input."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs: set[int] = set()
    held: set[str] = set()
    for node in gm.graph.nodes:
        for written in _written_nodes(node):
            source = _source(written)
            if source is not None and source.op == "placeholder":
                inputs.add(placeholders.index(source))
            elif source is not None:
                held.add(str(source.target))
    return tuple(sorted(inputs)), tuple(sorted(held))


def _written_nodes(node: torch.fx.Node) -> list:
    """The argument nodes ``node`` writes (every node argument where what it calls is not known)."""
    if node.op not in ("call_function", "call_method"):
        return []
    target = node.target
    if node.op == "call_function" and target in _WRITING_OPERATORS:
        return list(node.args[:1])
    if isinstance(target, torch._ops.OpOverload):  # an aten or prims op (a graph made of them): its schema says
        schema = target._schema.arguments
        written = [a for a, s in zip(node.args, schema) if s.alias_info is not None and s.alias_info.is_write]
        return written + [node.kwargs[s.name] for s in schema if s.alias_info is not None and s.alias_info.is_write
                          and s.name in node.kwargs]
    if node.op == "call_function" and getattr(target, "__module__", None) in _PURE_MODULES:
        return []
    # a torch function or method: its WriteSpec, read on stand-ins for the argument nodes
    stand_ins: dict = {}
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: stand_ins.setdefault(n, torch.empty(0)))
    by_id = {id(t): n for n, t in stand_ins.items()}
    return [by_id[id(t)] for t in call_writes(node_name(node)).written(args, kwargs) if id(t) in by_id]


def _source(node) -> torch.fx.Node | None:
    """The input or held tensor whose memory ``node`` is, through in-place ops and views; None for a new tensor."""
    while isinstance(node, torch.fx.Node) and node.op in ("call_function", "call_method"):
        name = node_name(node)
        aliases = node.target in _WRITING_OPERATORS or node.target is operator.getitem or op_facts(name).view or \
            (isinstance(node.target, torch._ops.OpOverload) and node.target.is_view) or is_inplace_op(name)
        if not aliases or not node.args:
            return None
        node = node.args[0]
    return node if isinstance(node, torch.fx.Node) and node.op in ("placeholder", "get_attr") else None


def reference_of(region) -> GraphReference:
    return GraphReference(region.gm)


class GraphReference:
    """``reference(*inputs)``: the graph run on the host on ``inputs`` (see the module's doc)."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.gm = gm

    def __call__(self, *inputs):
        widening = any(isinstance(t, torch.Tensor) and t.dtype in (torch.float64, torch.complex128) for t in inputs)
        return _HostInterpreter(self.gm, DEFAULT_CAST if widening else {}).run(*inputs)


def node_values(gm: torch.fx.GraphModule, device_inputs: tuple, widen: bool) -> dict:
    """Every node's value (by node name) of ``gm`` run on the host on copies of ``device_inputs``: in float64 where
    ``widen``, else in the device's dtypes (the same-dtype run)."""
    cast = DEFAULT_CAST if widen else {}
    interpreter = _HostInterpreter(gm, cast, keep=True)
    with torch.no_grad():
        interpreter.run(*(_host(t, cast) for t in device_inputs))
    return {node.name: value for node, value in interpreter.env.items()}


def node_where(n: torch.fx.Node) -> tuple[str, str]:
    """The module path and the ``file:line`` of the source line that made a node."""
    return _module_of(n), _line_of(n)


class _HostInterpreter(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, cast: dict, keep: bool = False) -> None:
        super().__init__(gm, garbage_collect_values=not keep)
        self.cast = cast

    def call_function(self, target, args, kwargs):
        return _host_call("call_function", target, args, kwargs, self.cast)

    def call_method(self, target, args, kwargs):
        return _host_call("call_method", target, args, kwargs, self.cast)

    def get_attr(self, target, args, kwargs):
        return _host(super().get_attr(target, args, kwargs), self.cast)


def _host(value, cast: dict):
    """``value`` with its tensors on the host through ``cast``, devices moved to the CPU, dtypes through ``cast``."""
    def tensor(t: torch.Tensor) -> torch.Tensor:
        target = cast.get(t.dtype, t.dtype)
        return t if t.device.type == "cpu" and target == t.dtype else t.to("cpu", target)

    return map_arguments(value, tensor, cast)


def _host_call(op: str, target, args, kwargs, cast: dict):
    """One ``call_function`` or ``call_method`` node on host copies of its arguments (see the module's doc)."""
    if op == "call_function":
        if cast and getattr(target, "__name__", "") in _AUTOCAST:
            return None
        return target(*_host(args, cast), **_host(kwargs, cast))
    self_arg, *rest = _host(args, cast)  # call_method: target is the method's name
    dtype = _DTYPE_METHODS.get(target)
    if dtype is not None and cast:
        return self_arg.to(cast.get(dtype, dtype))
    return getattr(self_arg, target)(*rest, **_host(kwargs, cast))


# --- narrowing a failing graph down to a node ---


@dataclasses.dataclass(frozen=True)
class DivergingNode:
    """The first node of a compiled graph whose output, computed on the device from the device's own inputs to it,
    differs from the same node in float64 on the host beyond its op's bound."""

    node: str  # the graph's name for it (silu_1)
    op: str  # torch.nn.functional.silu
    module: str  # model.layers.0.mlp.act_fn ("" outside any module)
    location: str  # /path/modeling_llama.py:123
    comparisons: tuple  # the failing comparisons of its outputs

    def describe(self) -> str:
        where = " in ".join(filter(None, (self.module, self.location)))
        return f"first diverging node {self.node} ({self.op}{', ' + where if where else ''})"


class _DivergedError(Exception):
    def __init__(self, found: DivergingNode) -> None:
        self.found = found


def eager_run(gm: torch.fx.GraphModule, device_inputs: tuple):
    """``gm`` run eagerly on the device, as the graph's torch calls, on clones of inputs an in-place node would write
    and with gradients off (the user's tensors and graph are untouched): what eager code computes in the device's
    dtypes."""
    with torch.no_grad():
        return gm(*_unwritten(gm, device_inputs))


def _unwritten(gm: torch.fx.GraphModule, device_inputs: tuple) -> tuple:
    if any(_writes(node) for node in gm.graph.nodes):
        return tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in device_inputs)
    return device_inputs


def first_diverging_node(gm: torch.fx.GraphModule, device_inputs: tuple, tolerance) -> DivergingNode | None:
    """Run ``gm`` node by node on the device (eagerly, on clones of inputs an in-place node would write, with
    gradients off: the user's tensors, graph and random streams are untouched) and check each node's output
    against the node rerun in float64 on the host on the same inputs; the first that fails, or None."""
    device_inputs = _unwritten(gm, device_inputs)
    try:
        with torch.no_grad():
            _NodeCheck(gm, tolerance).run(*device_inputs)
    except _DivergedError as found:
        return found.found
    return None


def first_diverging_gradient(gm: torch.fx.GraphModule, device_inputs: tuple, upstream: tuple, tolerance) \
        -> DivergingNode | None:
    """A graph whose backward failed: ``gm`` run on the device (on detached copies of its inputs, so the user's graph
    is untouched), its outputs' ``upstream`` gradients taken back to every node's output, then, from the last node
    back (the backward's order), each node's input gradients for its own upstream gradient computed on the device
    and in float64 on the host from the same inputs; the first node whose gradients fail, or None."""
    inputs = tuple(t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) and
                   t.is_floating_point() else t for t in _unwritten(gm, device_inputs))
    interpreter = torch.fx.Interpreter(gm, garbage_collect_values=False)
    with torch.enable_grad():
        outputs = interpreter.run(*inputs)
    values = interpreter.env
    unique: list[torch.Tensor] = []
    for t in iter_tensors(outputs):
        if all(t is not u for u in unique):
            unique.append(t)
    pairs = [(o, g) for o, g in zip(unique, upstream) if g is not None and o.requires_grad]
    nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method") and
             isinstance(values.get(n), torch.Tensor) and values[n].requires_grad]
    if not pairs or not nodes:
        return None
    grads = torch.autograd.grad([o for o, _ in pairs], [values[n] for n in nodes], [g for _, g in pairs],
                                allow_unused=True)
    for n, g in reversed(list(zip(nodes, grads))):
        if g is None or not node_name(n):
            continue
        args, kwargs = interpreter.fetch_args_kwargs_from_env(n)
        failed = _node_backward_fails(n, args, kwargs, g, tolerance)
        if failed:
            return DivergingNode(n.name, node_name(n), _module_of(n), _line_of(n), failed)
    return None


def _node_backward_fails(n: torch.fx.Node, args, kwargs, upstream: torch.Tensor, tolerance) -> tuple:
    """The failing comparisons of one node's input gradients, on the device against float64 on the host."""
    device = _node_grads(n, args, kwargs, upstream, None)
    if device is None:
        return ()
    reference = _node_grads(n, args, kwargs, upstream, DEFAULT_CAST)
    if reference is None:
        return ()
    same = _node_grads(n, args, kwargs, upstream, {})
    failed = []
    for i, (d, r) in enumerate(zip(device, reference)):
        if d is None or r is None:
            continue
        c = compare_tensors(f"input[{i}].grad", d.detach().to("cpu"), r, functools.partial(_item, same, i),
                            tolerance, node_name(n), backward=True)
        if not c.passed:
            failed.append(c)
    return tuple(failed)


def _node_grads(n: torch.fx.Node, args, kwargs, upstream: torch.Tensor, cast: dict | None):
    """The node's gradients for its floating tensor arguments, rerun from detached copies of them: on the device
    (``cast`` None) or on the host through ``cast``; None where it cannot be rerun."""
    leaves: list[torch.Tensor] = []

    def leaf(t: torch.Tensor) -> torch.Tensor:
        copy = t.detach() if cast is None else _host(t.detach(), cast)
        if not copy.is_floating_point():
            return copy
        copy = copy.clone().requires_grad_() if cast is None else copy.requires_grad_()
        leaves.append(copy)
        return copy.clone() if _writes(n) else copy  # an in-place node writes the clone; the leaf's gradient stays

    try:
        with torch.enable_grad():
            a, k = map_tensors(args, leaf), map_tensors(kwargs, leaf)
            out = _host_call(n.op, n.target, a, k, {}) if cast is not None else _device_call(n, a, k)
            if not isinstance(out, torch.Tensor) or not out.requires_grad or not leaves:
                return None
            g = upstream.detach() if cast is None else _host(upstream.detach(), cast)
            return torch.autograd.grad(out, leaves, g.to(out.dtype), allow_unused=True)
    except (RuntimeError, NotImplementedError, TypeError, ValueError, IndexError):
        return None


def _item(values: tuple | None, i: int):
    return None if values is None else values[i]


def _device_call(n: torch.fx.Node, args, kwargs):
    target = n.target
    if callable(target):  # call_function
        return target(*args, **kwargs)
    return getattr(args[0], target)(*args[1:], **kwargs)  # call_method: the method's name


def _writes(node: torch.fx.Node) -> bool:
    name = node_name(node)
    return bool(name) and (name.endswith("_") and not name.endswith("__") or "out" in node.kwargs)


class _NodeCheck(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, tolerance) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.tolerance = tolerance

    def run_node(self, n: torch.fx.Node):
        result = super().run_node(n)
        name = node_name(n)
        if not name or not any(t.is_floating_point() for t in iter_tensors(result)):
            return result
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        reference = _host_run(n, args, kwargs, DEFAULT_CAST)
        if reference is None:
            return result
        device = map_tensors(result, lambda t: t.detach().cpu())
        comparisons = compare_outputs(device, reference, lambda: _host_run(n, args, kwargs, {}), self.tolerance,
                                      op_name=name, prefix="output")
        failed = tuple(c for c in comparisons if not c.passed)
        if failed:
            raise _DivergedError(DivergingNode(n.name, name, _module_of(n), _line_of(n), failed))
        return result


def _host_run(n: torch.fx.Node, args, kwargs, cast: dict):
    """The node on host copies of its inputs, through ``cast``; None where the host cannot run it."""
    try:
        with torch.no_grad():
            return _host_call(n.op, n.target, args, kwargs, cast)
    except (RuntimeError, NotImplementedError, TypeError, ValueError, IndexError):
        return None


_INDEX = re.compile(r"\[(\d+)\]")
_KEY = re.compile(r"\['([^']*)'\]")


def _module_of(n: torch.fx.Node) -> str:
    """The module path of the module a node ran in (``model.layers.0.mlp.act_fn``), from dynamo's record of it; one
    inside the compiled frame's own module (``L['self']``) starts with ``self`` (``self.mlp.act_fn``): one graph runs
    for each of a model's alike layers, and the tool puts it under the module running the call."""
    stack = n.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]  # L['self'].model.layers[0].mlp.act_fn, L['args'][0].model.layers[0]…
    path = re.sub(r"^L\['self'\]", "self", path)
    path = re.sub(r"^L\['[^']*'\](\[\d+\])*\.?", "", path)
    path = _KEY.sub(lambda m: "." + m.group(1), _INDEX.sub(lambda m: "." + m.group(1), path))
    return path.replace("._modules.", ".").replace("_orig_mod.", "").strip(".")


def user_frames(n: torch.fx.Node, torch_frames: bool = False) -> list[tuple[str, int, str]]:
    """``(file, line, function)`` of the frames that made a node, outermost first, past the tools' own (dynamo traces
    through the tools' mode) and, unless ``torch_frames``, torch's."""
    skipped = SKIPPED_FRAMES[:1] if torch_frames else SKIPPED_FRAMES
    frames = []
    for line in (n.meta.get("stack_trace") or "").splitlines():
        found = _FRAME.match(line)
        if found and not found.group(1).startswith(skipped):
            frames.append((found.group(1), int(found.group(2)), found.group(3)))
    return frames


def _line_of(n: torch.fx.Node) -> str:
    """``file:line`` of the source line that made the node."""
    frames = user_frames(n)
    return f"{frames[-1][0]}:{frames[-1][1]}" if frames else ""


_FRAME = re.compile(r'\s*File "([^"]+)", line (\d+), in (\S+)')


# Frames that are not where a node was written: the tools' mode (dynamo traces through it) and torch's own code.
SKIPPED_FRAMES = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # op_tools/
                  os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)
