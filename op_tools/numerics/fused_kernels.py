"""Which kernel of an Inductor-compiled graph computes wrong: the graph compiled again with its kernels watched, each
kernel's results compared with the float64 value of the graph node they hold.

When a compiled region fails and its nodes, run one by one on the device, all agree with the reference
(``graph_reference.first_diverging_node`` finds none), the fault is in what the compiler made of them: a lowering or a
fused kernel. Inductor names each kernel after what it fuses (``cpp_fused_add_mul_silu_0``,
``triton_poi_fused_mul_silu_0``) and writes above each call the graph nodes it computes (``# Topologically Sorted
Source Nodes: [silu, mul]``). ``first_diverging_kernel`` compiles the region's graph again with the user's backend
(gradients off: the forward graph alone; Inductor's caches off, so that the code is generated and read), then runs
it with every kernel and library call (``extern_kernels.mm``) wrapped. After each call, each tensor the call changed
is compared with the float64 value of the call's source nodes of the same size; the first call one of whose results
matches none of its nodes is named, with the node closest to it.

A kernel writes only its fused group's results (the buffers a later kernel or the graph's output reads): a fault in
an intermediate value it keeps in registers shows in those results. Calls are matched to their lines in the code by
order, which holds because the generated ``call`` is straight-line code.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from typing import Any

import torch
import torch.fx

from ..ops.arguments import iter_tensors
from .comparison import Comparison, compare_tensors
from .graph_reference import node_name, node_values, node_where

_SOURCES = re.compile(r"#\s*Topologically Sorted Source Nodes:\s*\[([^\]]*)\]")
_CALL = re.compile(r"^\s*(?:[\w, ]+=\s*)?(extern_kernels\.\w+|(?:cpp|triton)_\w+)(?:\.run)?\(")
_KERNEL_PREFIXES = ("cpp_", "triton_")
_SUFFIX = re.compile(r"_\d+$")  # a node name's count (mul_1)
_CODE_MODULES = "torch._inductor.runtime.compile_tasks."  # what Inductor loads its generated code as


@dataclasses.dataclass(frozen=True)
class DivergingKernel:
    """The first kernel of a compiled graph whose result differs from the float64 value of the node it holds."""

    kernel: str  # cpp_fused_add_mul_silu_0, extern_kernels.mm
    sources: tuple[str, ...]  # the graph nodes it computes, as Inductor lists them
    node: str  # the source node its diverging result holds
    op: str  # the node's op (torch.nn.functional.silu)
    module: str
    location: str
    comparisons: tuple

    def describe(self) -> str:
        where = " in ".join(filter(None, (self.module, self.location)))
        return (f"first diverging kernel {self.kernel} (computes {', '.join(self.sources)}): its result for node "
                f"{self.node} ({self.op}{', ' + where if where else ''}) diverges")


def is_inductor(backend) -> bool:
    """Whether a dynamo backend is Inductor (``torch.compile``'s default, or ``backend="inductor"``)."""
    return getattr(backend, "compiler_name", None) == "inductor" or \
        getattr(backend, "__name__", None) in ("inductor", "compile_fx")


def first_diverging_kernel(backend, gm: torch.fx.GraphModule, device_inputs: tuple, tolerance) \
        -> DivergingKernel | None:
    """``gm`` compiled again by ``backend`` (Inductor) and run on detached ``device_inputs`` with its calls watched;
    the first call whose result diverges from its node's float64 value, or None (every call agreed, or the code
    could not be read)."""
    inputs = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in device_inputs)
    compiled, code = _compile(backend, gm, inputs)
    if compiled is None or code is None:
        return None
    calls = _calls(code)
    modules = _modules(code, calls)
    if not modules:
        return None
    nodes = {n.name: n for n in gm.graph.nodes}
    references = node_values(gm, inputs, widen=True)
    same = node_values(gm, inputs, widen=False)
    watch = _Watch(calls, nodes, references, same, tolerance)
    originals = [(module, name, value) for module in modules for name, value in vars(module).items()
                 if name.startswith(_KERNEL_PREFIXES) or name == "extern_kernels"]
    try:
        for module, name, value in originals:
            setattr(module, name, _Watched(name, value, watch))
        with torch.no_grad():
            compiled(*inputs)
    except _DivergedError as found:
        return found.found
    finally:
        for module, name, value in originals:
            setattr(module, name, value)
    return None


def _compile(backend, gm: torch.fx.GraphModule, inputs: tuple) -> tuple[Any, str | None]:
    from torch._inductor import config
    from torch._inductor.graph import GraphLowering

    codes: list[str] = []
    previous = GraphLowering.save_output_code
    GraphLowering.save_output_code = codes.append  # Inductor's own hook for the code it writes
    try:
        with config.patch(fx_graph_cache=False, fx_graph_remote_cache=False), torch.no_grad():
            compiled = backend(gm, list(inputs))
    finally:
        GraphLowering.save_output_code = previous
    return compiled, (codes[-1] if codes else None)


def _modules(code: str, calls: dict) -> list:
    """The loaded modules of Inductor's code that hold this code's kernels: the same source is loaded under more
    than one key (and module) at times, and the compiled callable's ``call`` reads its kernels from one of them."""
    kernels = [name for name in calls if not name.startswith("extern_kernels.")]
    found = []
    for name, module in list(sys.modules.items()):
        if name.startswith(_CODE_MODULES) and callable(getattr(module, "call", None)) and \
                all(k in vars(module) for k in kernels):
            found.append(module)
    return found


def _calls(code: str) -> dict[str, list[tuple[str, ...]]]:
    """Per kernel (or ``extern_kernels.<name>``), the source nodes of each of its calls, in the code's order."""
    calls: dict[str, list[tuple[str, ...]]] = {}
    sources: tuple[str, ...] = ()
    for line in code.splitlines():
        found = _SOURCES.search(line)
        if found:
            sources = tuple(s.strip() for s in found.group(1).split(",") if s.strip())
            continue
        call = _CALL.match(line)
        if call:
            calls.setdefault(call.group(1), []).append(sources)
            sources = ()
    return calls


class _DivergedError(Exception):
    def __init__(self, found: DivergingKernel) -> None:
        self.found = found


class _Watch:
    """Compares each watched call's results with its source nodes' values, in the order the calls run."""

    def __init__(self, calls: dict, nodes: dict, references: dict, same: dict, tolerance) -> None:
        self.calls, self.nodes, self.references, self.same, self.tolerance = calls, nodes, references, same, tolerance
        self.seen: dict[str, int] = {}

    def check(self, kernel: str, results: list[torch.Tensor]) -> None:
        index = self.seen.get(kernel, 0)
        self.seen[kernel] = index + 1
        lines = self.calls.get(kernel, [])
        sources = (lines[index] if index < len(lines) else ()) or self._named_in(kernel)
        for result in results:
            candidates = [s for s in sources if self._fits(s, result)]
            if not candidates:
                continue
            compared = [(s, self._compare(s, result)) for s in candidates]
            if any(c.passed for _, c in compared):
                continue
            node, comparison = min(compared, key=lambda p: p[1].device_error)
            module, location = node_where(self.nodes[node])
            raise _DivergedError(DivergingKernel(kernel, sources, node, node_name(self.nodes[node]), module,
                                                 location, (comparison,)))

    def _named_in(self, kernel: str) -> tuple[str, ...]:
        """The nodes a kernel's name lists (``cpp_fused_mul_silu_0``: the nodes named ``mul``, ``silu``, ``mul_1``...),
        for a call the code gives no source line for (Inductor's C++ code at times)."""
        words = set(kernel.split("_"))
        return tuple(name for name in self.nodes if _SUFFIX.sub("", name) in words)

    def _fits(self, source: str, result: torch.Tensor) -> bool:
        reference = self.references.get(source)
        return isinstance(reference, torch.Tensor) and reference.is_floating_point() and \
            reference.numel() == result.numel() and source in self.nodes

    def _compare(self, source: str, result: torch.Tensor) -> Comparison:
        reference = self.references[source]
        device = result.detach().to("cpu").reshape(reference.shape)
        same = self.same.get(source)
        return compare_tensors(f"node {source}", device, reference, lambda: same, self.tolerance,
                               node_name(self.nodes[source]))


class _Watched:
    """A kernel (called, or launched by ``.run`` for Triton) or the ``extern_kernels`` namespace, watched."""

    def __init__(self, name: str, target, watch: _Watch) -> None:
        self._name, self._target, self._watch = name, target, watch

    def __call__(self, *args, **kwargs):
        return _watched_call(self._name, self._target, self._watch, args, kwargs)

    def run(self, *args, **kwargs):
        return _watched_call(self._name, self._target.run, self._watch, args, kwargs)

    def __getattr__(self, name: str):
        target = getattr(self._target, name)
        if self._name != "extern_kernels" or not callable(target):
            return target
        return _Watched(f"extern_kernels.{name}", target, self._watch)


def _watched_call(name: str, target, watch: _Watch, args: tuple, kwargs: dict):
    tensors = [t for t in iter_tensors((args, kwargs)) if t.is_floating_point()]
    before = [_bits(t) for t in tensors]
    result = target(*args, **kwargs)
    changed = [t for t, b in zip(tensors, before) if not torch.equal(_bits(t), b)]
    returned = [t for t in iter_tensors(result) if t.is_floating_point()]
    watch.check(name, changed + [t for t in returned if all(t is not c for c in changed)])
    return result


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, compared bit for bit (nan equals itself; garbage in a fresh buffer counts as a value)."""
    return t.detach().contiguous().view(-1).view(torch.uint8).clone()
