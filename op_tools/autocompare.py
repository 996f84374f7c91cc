"""OpAutoCompare: run every handled op on the CPU as well and say which one computes wrong, forward and backward.

Per handled call (``OP_AUTOCOMPARE_LIST`` / ``OP_AUTOCOMPARE_DISABLE_LIST``):

1. the inputs are copied to the CPU before the op runs (so in-place ops and ``out=`` compare correctly);
2. the op runs on the device. When its inputs require grad it runs inside ``_Boundary``, an autograd
   Function whose backward calls ``torch.autograd.grad`` on the op's own graph: the same kernels and
   the same values as without the tool, but the gradients of *this op's* inputs are in hand;
3. the CPU reference runs on the inputs upcast to float64 (``<OPNAME>_OP_DTYPE_CAST_DICT`` overrides;
   float32, then the device's dtype, where the CPU has no float64 kernel), and once more in the
   device's own dtype; ``comparison.compare_outputs`` gives the verdict for every output;
4. when the op's backward runs, the CPU reference backward runs with the same upstream gradients and
   the input gradients are compared the same way. A call's CPU tensors are freed once its backward
   is compared (or at ``stop()``).

Failing calls are printed (every call with ``OP_TOOLS_VERBOSE=1``) and saved, in OpCapture's file
format, under ``op_capture_results/<op>/<pid>/autocompare/<forward_id>/<time>/{device,cpu}/``. At
``stop()``: a summary, the failing ops in execution order, and a CSV in ``op_autocompare_result/``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import os
import re
import threading
import time
import weakref

import torch
from torch.torch_version import TorchVersion

from . import reporting
from .arguments import iter_items, iter_tensors, map_tensors
from .capture import TensorStore
from .comparison import COLUMNS, Comparison, ToleranceSpec, compare_outputs, op_key
from .config import AUTOCOMPARE_BACKWARD, AUTOCOMPARE_CAST, parse_dtype_map
from .engine import OpCall, OpTool, feature, tool_work
from .naming import CONVERSIONS, VIEW_OPS, is_inplace_op

_CPU = torch.device("cpu")
_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
DEFAULT_REFERENCE_CAST = {torch.float16: torch.float64, torch.bfloat16: torch.float64,
                          torch.float32: torch.float64, torch.complex64: torch.complex128}
_FALLBACK_CAST = {torch.float16: torch.float32, torch.bfloat16: torch.float32}
_CAST_VAR = re.compile(r"^(\w+)_OP_DTYPE_CAST_DICT$")

# Ops whose results are random draws or uninitialised memory: nothing to compare.
_RANDOM = re.compile(r"^(rand|randn|randint|rand_like|randn_like|randint_like|randperm|bernoulli_?|normal_?|"
                     r"uniform_?|random_?|exponential_|geometric_|cauchy_|log_normal_|multinomial|poisson|"
                     r"rrelu_?|.*dropout.*)$")
_UNINITIALISED = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_",
                            "resize_as_", "set_"})
CSV_COLUMNS = ("op", "forward_id", "phase", *COLUMNS, "location")
# torch.autograd.grad takes gradient edges as outputs from PyTorch 2.4 on; before, every boundary output is detached.
_gradient_edge = torch.autograd.graph.get_gradient_edge if TorchVersion(torch.__version__) >= (2, 4) else None


@functools.lru_cache(maxsize=4096)  # asked on every handled call, and a name's answer never changes
def skip_reason(name: str) -> str | None:
    """Why ``name`` is never compared: ``'random'``, ``'uninitialised'`` or ``None``."""
    short = name.rsplit(".", 1)[-1]
    if name.startswith("torch.nn.init.") or _RANDOM.match(short):
        return "random"
    if short in _UNINITIALISED:
        return "uninitialised"
    return None


@dataclasses.dataclass(frozen=True)
class AutoCompareConfig:
    backward: bool
    tolerance: ToleranceSpec
    casts: dict[str, dict[torch.dtype, torch.dtype]]  # OPNAME -> reference cast

    @classmethod
    def from_env(cls) -> AutoCompareConfig:
        casts = {}
        for name in os.environ:
            match = _CAST_VAR.match(name)
            if match:
                var = dataclasses.replace(AUTOCOMPARE_CAST, name=name, default=None, parse=parse_dtype_map)
                casts[match.group(1)] = var.read()
        return cls(AUTOCOMPARE_BACKWARD.read(), ToleranceSpec.from_env(), casts)


class _OutputAliasesInputError(Exception):
    """Raised inside the boundary: the op returned (a view of) an input, which an autograd Function cannot."""


# --- moving arguments to the CPU ---

@functools.lru_cache(maxsize=1024)
def _is_device_text(value: str) -> bool:
    try:
        return torch.device(value).type != "cpu"
    except (RuntimeError, TypeError, ValueError):
        return False


def _cpu_value(value, cast: dict | None = None):
    """A non-tensor argument for the CPU run: devices moved to the CPU, dtypes through ``cast``."""
    if isinstance(value, torch.device):
        return _CPU if value.type != "cpu" else value
    if isinstance(value, str) and value and _is_device_text(value):
        return "cpu"
    if cast and isinstance(value, torch.dtype):
        return cast.get(value, value)
    return value


_PLAIN = frozenset({int, float, bool, type(None)})  # argument types that _cpu_value never changes


def _map_arguments(obj, tensor_fn, cast: dict | None = None):
    """``obj`` (args tuple or kwargs dict) with tensors through ``tensor_fn``, devices moved to the CPU and
    dtypes through ``cast``."""
    if isinstance(obj, torch.Tensor):
        return tensor_fn(obj)
    kind = type(obj)
    if kind in _PLAIN:
        return obj
    if kind is tuple or kind is list:  # most arguments: tensors and plain values, mapped without a call each
        return kind([tensor_fn(v) if isinstance(v, torch.Tensor) else v if type(v) in _PLAIN
                     else _map_arguments(v, tensor_fn, cast) for v in obj])
    if kind is dict and not obj:
        return {}
    if isinstance(obj, dict):
        return {k: (_CPU if k == "device" and v is not None and not isinstance(v, torch.Tensor)
                    else _map_arguments(v, tensor_fn, cast)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        items = [_map_arguments(v, tensor_fn, cast) for v in obj]
        if type(obj).__module__ == "torch.return_types":
            return type(obj)(items)
        return type(obj)(items) if not hasattr(obj, "_fields") else type(obj)(*items)
    return _cpu_value(obj, cast)


def _recast(obj, cast: dict, copy: bool, leaves: dict[int, torch.Tensor] | None = None):
    """CPU tensors of ``obj`` cast by ``cast``; tensors whose id is in ``leaves`` become the mapped leaf."""
    def tensor_fn(t: torch.Tensor) -> torch.Tensor:
        if leaves is not None and id(t) in leaves:
            return leaves[id(t)]
        dtype = t.dtype
        target = cast.get(dtype, dtype)
        if target == dtype and not copy:
            return t
        return t.to(dtype=target, copy=True)

    return _map_arguments(obj, tensor_fn, cast)


def _first_low_precision(*objs) -> torch.dtype | None:
    for obj in objs:
        for t in iter_tensors(obj):
            if t.dtype in (torch.float16, torch.bfloat16):
                return t.dtype
    return None


def _first_floating_dtype(result) -> torch.dtype | None:
    for t in iter_tensors(result):
        if t.is_floating_point():
            return t.dtype
    return None


class _Pending:
    """What a compared call keeps for its backward comparison: CPU tensors only, dropped once compared."""

    __slots__ = ("__weakref__", "forward_id", "grad_labels", "inner", "leaves", "location", "name", "state")

    def __init__(self, call: OpCall, state: dict) -> None:
        self.name = call.name
        self.forward_id = call.forward_id
        self.location = ""
        self.state = state
        self.grad_labels = state["grad_labels"]
        self.leaves: list[torch.Tensor] = []
        self.inner: list[tuple] = []  # (the op's output or its gradient edge, whether it is differentiable)


class _Boundary(torch.autograd.Function):
    """Runs the op on detached leaves of its inputs; backward = ``autograd.grad`` of the op's own graph."""

    @staticmethod
    def forward(ctx, runner, *inputs):
        return runner.forward(ctx, inputs)

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():  # create_graph=True: the gradients must stay differentiable
            return (None, *ctx.runner.differentiable_backward(ctx, grads))
        return (None, *ctx.runner.backward(grads))


class _Runner:
    def __init__(self, tool: OpAutoCompare, call: OpCall, pending: _Pending) -> None:
        self.tool = tool
        self.call = call
        self.pending = pending
        self.result = None
        self.output_ids: list[int] = []

    def forward(self, ctx, inputs):
        call, pending = self.call, self.pending
        # For a double backward: the op, its arguments (the inputs saved, so that a later in-place change
        # is an error, not a silently different gradient) and the autocast state to run it again with.
        device_type = call.device.type if call.device is not None else "cpu"
        self.rerun = (call.func, call.args, call.kwargs, device_type, torch.is_autocast_enabled(device_type),
                      torch.get_autocast_dtype(device_type))
        ctx.save_for_backward(*inputs)
        with tool_work():
            leaves = [t.detach().requires_grad_() for t in inputs]
            by_id = {id(t): leaf for t, leaf in zip(inputs, leaves)}
            args = map_tensors(call.args, lambda t: by_id.get(id(t), t))
            kwargs = map_tensors(call.kwargs, lambda t: by_id.get(id(t), t))
        with torch.enable_grad():
            result = call.func(*args, **kwargs)
        with tool_work():
            flat = _unique_tensors(result)
            if any(_aliases(o, leaves) for o in flat):
                raise _OutputAliasesInputError
            # An output the op created is returned as it is (a detach would be one more device op): autograd
            # gives it this node's history, and the op's own graph stays reachable through its gradient edge.
            # A view is returned detached (a view from a custom Function refuses later in-place changes), and
            # so is an output without history.
            roots, outs = [], []
            for o in flat:
                own = _gradient_edge is not None and o.grad_fn is not None and not o._is_view()
                roots.append(_gradient_edge(o) if own else o)
                outs.append(o if own else o.detach())
            ctx.mark_non_differentiable(*[d for o, d in zip(flat, outs) if not o.requires_grad])
            ctx.set_materialize_grads(False)
            ctx.runner = self
            pending.leaves, pending.inner = leaves, [(r, o.requires_grad) for r, o in zip(roots, flat)]
            self.result, self.output_ids = result, [id(o) for o in flat]
            # The call will hold this node's outputs, and the node holds this runner (ctx.runner): a cycle
            # through the C++ graph that gc cannot see. Backward needs only the pending record, which holds
            # no output (an edge holds the op's node, not this one).
            self.call = None
            return tuple(outs)

    def backward(self, grads):
        pending = self.pending
        leaves, inner = pending.leaves, pending.inner
        pairs = [(root, g) for (root, differentiable), g in zip(inner, grads) if g is not None and differentiable]
        if pairs:
            device_grads = torch.autograd.grad([r for r, _ in pairs], leaves, [g for _, g in pairs],
                                               retain_graph=True, allow_unused=True)
        else:
            device_grads = (None,) * len(leaves)
        if pending.state:
            with tool_work():
                self.tool._guarded(lambda _: self.tool.compare_backward(pending, grads, device_grads),
                                   _NamedCall(pending.name))
        return device_grads

    def differentiable_backward(self, ctx, grads):
        """The op's input gradients as a graph over its real inputs (not over the detached leaves): the op
        runs again, as it ran in forward, and ``autograd.grad`` builds its backward with ``create_graph``.
        Not compared: the tool's comparison is first-order."""
        inputs = ctx.saved_tensors
        func, args, kwargs, device_type, autocast, dtype = self.rerun
        by_id = {id(t): t for t in inputs}
        with tool_work(), torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=autocast):
            result = func(*args, **kwargs)
        flat = _unique_tensors(result)
        pairs = [(o, g) for o, g in zip(flat, grads) if g is not None and o.requires_grad]
        with tool_work():
            self.tool.backward_not_compared["double backward (create_graph=True)"] += 1
            self.pending.state.clear()
        if not pairs:
            return (None,) * len(inputs)
        return torch.autograd.grad([o for o, _ in pairs], [by_id[id(t)] for t in inputs], [g for _, g in pairs],
                                   create_graph=True, allow_unused=True)


class _NamedCall:
    """Enough of an OpCall for ``OpTool._guarded`` to name the op in a failure report."""

    def __init__(self, name: str) -> None:
        self.name = name


def _unique_tensors(result) -> list[torch.Tensor]:
    """The tensors of ``result``, each once, in order."""
    if isinstance(result, torch.Tensor):  # most ops: no walk
        return [result]
    seen, out = set(), []
    for t in iter_tensors(result):
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _aliases(output: torch.Tensor, leaves: list[torch.Tensor]) -> bool:
    """Whether ``output`` is one of ``leaves`` or a view of one (autograd tracks views' bases)."""
    base = output._base if output._is_view() else None
    return any(output is leaf or base is leaf for leaf in leaves)


@feature("autocompare")
class OpAutoCompare(OpTool):
    """Compare every handled op, forward and backward, with a float64 CPU reference.

    >>> with op_tools.OpAutoCompare() as compare:       # OP_TOOLS_VERBOSE=0: only failures are printed
    ...     loss = model(x).sum(); loss.backward()
    >>> compare.failures[:1]   # the first op, in execution order, that computes wrong (forward or backward)
    """

    hook_name = "OpAutoCompareHook"
    env_prefix = "OP_AUTOCOMPARE"
    results_folder = "op_autocompare_result"

    def configure(self) -> None:
        self.settings = AutoCompareConfig.from_env()
        self._tolerance = self.settings.tolerance or None  # None: no variable set, nothing to look up per call
        self.store = TensorStore(dedup=False)
        self.counts: collections.Counter = collections.Counter()
        self.skipped: collections.Counter = collections.Counter()
        self.backward_not_compared: collections.Counter = collections.Counter()
        self.failures: list[dict] = []
        self.rows: list[dict] = []
        self._pending: weakref.WeakValueDictionary[int, _Pending] = weakref.WeakValueDictionary()
        self._order_lock = threading.Lock()
        self._copies = CpuCopyCache()
        # Output dtypes a correct run gives, per (op, input dtypes, autocast): the same-dtype CPU run is
        # lazy, so without this a device returning a narrower dtype with small errors would pass.
        self._expected_dtypes: dict[tuple, tuple] = {}
        self._attempts: dict[str, list] = {}  # op name -> the reference casts to try, in order

    # --- forward ---

    def before(self, call: OpCall) -> None:
        state = call.state
        reason = skip_reason(call.name)
        if reason is not None:
            state["skip"] = reason
            return
        get, tensors = self._copies.get, []

        def snapshot(t: torch.Tensor) -> torch.Tensor:
            copy = get(t)
            tensors.append((t, copy))
            return copy

        # (device tensor, its CPU copy) in argument order: the arguments are walked once; after() drops the
        # list (it holds device memory)
        state["tensors"] = tensors
        state["cpu_args"] = _map_arguments(call.args, snapshot)
        state["cpu_kwargs"] = _map_arguments(call.kwargs, snapshot)
        state["inplace"] = is_inplace_op(call.name)
        state["writes"] = state["inplace"] or "out" in call.kwargs
        reason = self._backward_reason(call)
        if reason is None:
            inputs, labels = [], []
            for label, t in _labelled_tensors(call.args, call.kwargs):
                if t.requires_grad and all(t is not u for u in inputs):
                    inputs.append(t)
                    labels.append(label)
            if inputs:
                state["grad_inputs"], state["grad_labels"] = inputs, labels
        elif reason:
            self.backward_not_compared[reason] += 1

    def _backward_reason(self, call: OpCall) -> str | None:
        """None when this call's backward is compared; '' when it has none; else why it is not compared."""
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return ""
        if not any(t.requires_grad for t, _ in call.state["tensors"]):
            return ""
        if not self.settings.backward:
            return "OP_AUTOCOMPARE_BACKWARD=0"
        name = call.name
        if name in VIEW_OPS or name in CONVERSIONS or name.startswith("torch.Tensor.__get"):
            return "view or conversion (gradient passed through)"
        if call.state["writes"]:
            return "in-place or out= op"
        return None

    def run(self, call: OpCall):
        state = call.state
        inputs = state.get("grad_inputs")
        if not inputs:
            return call.func(*call.args, **call.kwargs)
        # The bookkeeping around the boundary calls no torch function: no tool work to mark.
        pending = _Pending(call, state)
        runner = _Runner(self, call, pending)
        try:
            outs = _Boundary.apply(runner, *inputs)
        except _OutputAliasesInputError:
            state.pop("grad_inputs")
            self.backward_not_compared["output aliases an input"] += 1
            return call.func(*call.args, **call.kwargs)
        result = runner.result
        runner.result = None
        by_id = dict(zip(runner.output_ids, outs if isinstance(outs, tuple) else (outs,)))
        state["pending"] = pending
        return map_tensors(result, lambda t: by_id.get(id(t), t))

    def after(self, call: OpCall) -> None:
        state = call.state
        reason = state.get("skip")
        if reason is not None:
            self.skipped[reason] += 1
            return
        if "cpu_args" not in state:  # before() failed: already reported
            return
        pending: _Pending | None = state.get("pending")
        device_out = call.args[0] if state["inplace"] and call.args else call.result
        device_cpu = map_tensors(device_out, self._copies.get)
        reference, ref_note = self._reference(call, pending)
        if reference is None:
            self.skipped[f"CPU cannot run it ({ref_note})"] += 1
            state.clear()
            # A failure of the tool, not of the op: reported once per op name (an error under OP_TOOLS_STRICT=1).
            raise RuntimeError(f"the CPU reference cannot run: {ref_note}")
        ref_args, ref_kwargs, ref_result = reference
        ref_out = ref_args[0] if state["inplace"] and ref_args else ref_result
        autocast_cast = self._autocast_cast(call, device_out)
        same_out = lambda: self._same_dtype_forward(call, autocast_cast)  # run only when an error is above the floor
        signature = (call.name, tuple([t.dtype for t, _ in state.pop("tensors")]),
                     tuple(sorted(autocast_cast.items(), key=str)))
        expected = self._expected_dtypes.get(signature)
        if expected is None or expected != _leaf_dtypes(device_cpu):
            same_out = same_out()  # eager: compare_outputs then checks every output's dtype
            if expected is None:
                self._expected_dtypes[signature] = _leaf_dtypes(device_cpu if same_out is None else same_out)
        comparisons = compare_outputs(device_cpu, ref_out, same_out, self._tolerance, op_name=call.name,
                                      prefix="output")
        if ref_note:
            for c in comparisons:
                c.error_info = "; ".join(filter(None, (c.error_info, ref_note)))
        passed = all(c.passed for c in comparisons)
        self.counts["forward compared"] += 1
        self.counts["forward passed" if passed else "forward failed"] += 1
        # Finding the user's source line costs a stack walk: only for what is printed or may fail later.
        location = call.location if not passed or self.common.verbose or pending is not None else ""
        self._record(call.name, call.forward_id, "forward", location, comparisons)
        if not passed or self.common.verbose:
            self._print_forward(call, ref_args, ref_kwargs, comparisons, location, passed)
        if not passed:
            self._save(call.name, call.forward_id, state, device_cpu, ref_out, pending=pending)
            state["saved_forward"] = True
        if pending is None:
            state.clear()
            return
        # Keep, for the backward, the CPU reference graph and what a failure report would save.
        pending.location = location
        ref_flat = _unique_tensors(ref_result)
        state.update(ref_flat=ref_flat, device_out_cpu=device_cpu, ref_out=ref_out, autocast_cast=autocast_cast)
        self._pending[call.forward_id] = pending
        state.pop("grad_inputs", None)
        state.pop("pending", None)

    def _reference(self, call: OpCall, pending: _Pending | None):
        """``(args, kwargs, result)`` of the CPU reference run, and a note on its dtype (or the error)."""
        state = call.state
        attempts = self._attempts.get(call.name)
        if attempts is None:
            requested = self.settings.casts.get(op_key(call.name), DEFAULT_REFERENCE_CAST)
            attempts = [(requested, "")]
            if any(v == torch.float64 for v in requested.values()):
                attempts += [(_FALLBACK_CAST, "reference in float32: no float64 kernel on the CPU"),
                             ({}, "reference in the device's dtype: no wider kernel on the CPU")]
            self._attempts[call.name] = attempts
        grad_snaps = []
        if pending is not None:
            snap_of = _snapshots_by_device_id(call, state)
            grad_snaps = [snap_of.get(id(t)) for t in state["grad_inputs"]]
        error = None
        for cast, note in attempts:
            leaves = {}
            ref_leaves = []
            for snap in grad_snaps:
                if snap is None:
                    continue
                leaf = snap.to(dtype=cast.get(snap.dtype, snap.dtype), copy=True).requires_grad_()
                leaves[id(snap)] = leaf
                ref_leaves.append(leaf)
            args = _recast(state["cpu_args"], cast, state["writes"], leaves)
            kwargs = _recast(state["cpu_kwargs"], cast, state["writes"], leaves)
            try:
                with _grad_mode(pending is not None), _NoCpuAutocast():
                    result = call.func(*args, **kwargs)
            except (RuntimeError, NotImplementedError, TypeError) as e:
                error = e
                continue
            if pending is not None:
                state["ref_leaves"] = [leaves.get(id(s)) if s is not None else None for s in grad_snaps]
            return (args, kwargs, result), note
        return None, f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"

    def _same_dtype_forward(self, call: OpCall, cast: dict):
        """The op on the CPU in the device's own dtype (as autocast chose it on the device), or None."""
        state = call.state
        args = _recast(state["cpu_args"], cast, state["writes"])
        kwargs = _recast(state["cpu_kwargs"], cast, state["writes"])
        try:
            with torch.no_grad(), _NoCpuAutocast():
                result = call.func(*args, **kwargs)
        except (RuntimeError, NotImplementedError, TypeError):
            # No CPU kernel in that dtype: float32 rounded to it is what a correct implementation gives.
            return self._rounded_float32_forward(call, cast)
        return args[0] if state["inplace"] and args else result

    def _rounded_float32_forward(self, call: OpCall, cast: dict):
        state = call.state
        wide = {dtype: torch.float32 for dtype in (torch.float16, torch.bfloat16)}
        args = _recast(_recast(state["cpu_args"], cast, state["writes"]), wide, False)
        kwargs = _recast(_recast(state["cpu_kwargs"], cast, state["writes"]), wide, False)
        try:
            with torch.no_grad(), _NoCpuAutocast():
                result = call.func(*args, **kwargs)
        except (RuntimeError, NotImplementedError, TypeError):
            return None
        out = args[0] if state["inplace"] and args else result
        narrow = cast.get(torch.float32) or _first_low_precision(call.args, call.kwargs)
        if narrow is None:
            return out
        return map_tensors(out, lambda t: t.to(narrow) if t.dtype == torch.float32 else t)

    def _autocast_cast(self, call: OpCall, device_out) -> dict:
        if call.device is None or not torch.is_autocast_enabled(call.device.type):
            return {}
        target = _first_floating_dtype(device_out)
        return {dtype: target for dtype in _FLOATING if target is not None and dtype != target}

    # --- backward ---

    def compare_backward(self, pending: _Pending, grad_outputs: tuple, device_grads: tuple) -> None:
        state = pending.state
        ref_flat, ref_leaves = state["ref_flat"], state["ref_leaves"]
        # Through the copy cache: one op's input gradient is usually the upstream gradient of the op before it.
        copy = self._copies.get
        upstream_cpu = tuple(None if g is None else copy(g) for g in grad_outputs)
        device_grads_cpu = tuple(None if g is None else copy(g) for g in device_grads)
        if len(ref_flat) != len(upstream_cpu):
            comparisons = [Comparison("grad", False, False, error_info="reference outputs differ in number")]
            reference_grads = ()
        else:
            reference_grads = _reference_backward(ref_flat, ref_leaves, upstream_cpu)
            labelled_device = tuple(device_grads_cpu)
            comparisons = compare_outputs(labelled_device, reference_grads,
                                          lambda: self._same_dtype_backward(pending, upstream_cpu),
                                          self._tolerance, op_name=pending.name, prefix="grad")
            for c, label in zip(comparisons, pending.grad_labels):
                c.name = f"{label}.grad"
        passed = all(c.passed for c in comparisons)
        with self._lock:
            self.counts["backward compared"] += 1
            self.counts["backward passed" if passed else "backward failed"] += 1
        self._record(pending.name, pending.forward_id, "backward", pending.location, comparisons)
        if not passed or self.common.verbose:
            rows = [_named_row(pending.name, c) for c in comparisons]
            reporting.console(reporting.header(pending.name, pending.forward_id, pending.location, "backward")
                              + "\n" + reporting.table(rows, COLUMNS).get_string())
        if not passed or state.get("saved_forward"):  # a call saved for its forward gets its gradients too
            self._save(pending.name, pending.forward_id, state, state["device_out_cpu"], state["ref_out"],
                       grads=(device_grads_cpu, upstream_cpu, reference_grads))
        state.clear()
        self._pending.pop(pending.forward_id, None)

    def _same_dtype_backward(self, pending: _Pending, upstream_cpu: tuple):
        """The input gradients of a CPU run in the device's dtype, for the same upstream gradients."""
        state = pending.state
        snaps = _snapshots_in_order(state, len(pending.grad_labels))
        if snaps is None:
            return None
        leaves = [s.detach().clone().requires_grad_() for s in snaps]
        by_id = {id(s): leaf for s, leaf in zip(snaps, leaves)}
        cast = state.get("autocast_cast") or {}
        args = _recast(state["cpu_args"], {}, True, by_id)
        kwargs = _recast(state["cpu_kwargs"], {}, True, by_id)
        try:
            with torch.enable_grad(), _NoCpuAutocast():
                if cast:  # differentiable casts, as autocast made them on the device
                    args = map_tensors(args, lambda t: t.to(cast.get(t.dtype, t.dtype)))
                    kwargs = map_tensors(kwargs, lambda t: t.to(cast.get(t.dtype, t.dtype)))
                flat = _unique_tensors(call_func(state, args, kwargs))
            return _reference_backward(flat, leaves, upstream_cpu)
        except (RuntimeError, NotImplementedError, TypeError):
            return None

    # --- reporting ---

    def _record(self, name: str, forward_id: int, phase: str, location: str, comparisons: list[Comparison]) -> None:
        first_line = location.splitlines()[0] if location else ""
        rows = [(name, forward_id, phase, c, first_line) for c in comparisons]  # formatted at stop()
        failed = [c for c in comparisons if not c.passed]
        with self._order_lock:
            self.rows.extend(rows)
            if failed:
                self.failures.append({
                    "order": len(self.failures) + 1, "op": name, "phase": phase, "forward_id": forward_id,
                    "failing": ", ".join(c.name for c in failed),
                    "error_info": "; ".join(filter(None, (c.error_info for c in failed)))[:200],
                    "location": first_line,
                })

    def _print_forward(self, call: OpCall, ref_args, ref_kwargs, comparisons, location: str, passed: bool) -> None:
        arg_rows = reporting.value_rows(f"{call.name} inputs", call.args, call.kwargs)
        arg_rows += reporting.value_rows(f"{call.name} cpu_inputs", ref_args, ref_kwargs)
        rows = [_named_row(call.name, c) for c in comparisons]
        reporting.console(reporting.header(call.name, call.forward_id, location)
                          + ("" if passed else "    FAIL") + "\n"
                          + reporting.table(arg_rows, reporting.ARG_COLUMNS).get_string() + "\n"
                          + reporting.table(rows, COLUMNS).get_string())

    def _save(self, name: str, forward_id: int, state: dict, device_out, ref_out, pending=None, grads=None) -> None:
        base = state.get("save_dir")
        if base is None:
            base = state["save_dir"] = reporting.results_path(
                self.common, "op_capture_results", name, self.pid_folder, "autocompare", str(forward_id),
                time.strftime("%Y-%m-%d-%H-%M-%S", time.localtime()))
        if not state.get("saved_forward"):
            ref_args, ref_kwargs = _recast(state["cpu_args"], self.settings.casts.get(op_key(name),
                                                                                      DEFAULT_REFERENCE_CAST), False), \
                _recast(state["cpu_kwargs"], self.settings.casts.get(op_key(name), DEFAULT_REFERENCE_CAST), False)
            for side, args, kwargs, out in (("device", state["cpu_args"], state["cpu_kwargs"], device_out),
                                            ("cpu", ref_args, ref_kwargs, ref_out)):
                self._write(base, side, "input", name, args, kwargs)
                self._write(base, side, "output", name, reporting.as_tuple(out), {})
        if grads is not None:
            device_grads, upstream, reference_grads = grads
            upstream64 = tuple(None if g is None else g.double() if g.is_floating_point() else g for g in upstream)
            self._write(base, "device", "grad_inputs", name, device_grads, {})
            self._write(base, "device", "grad_outputs", name, upstream, {})
            self._write(base, "cpu", "grad_inputs", name, tuple(reference_grads), {})
            self._write(base, "cpu", "grad_outputs", name, upstream64, {})
        reporting.logger.info("OpAutoCompare: saved %s", base)

    def _write(self, base: str, side: str, identifier: str, name: str, args, kwargs) -> None:
        self.store.save(os.path.join(base, side, f"{identifier}.pth"),
                        {"name": name, "args": tuple(args), "kwargs": dict(kwargs), "identifier": identifier})

    def finish(self) -> None:
        for pending in list(self._pending.values()):  # calls whose backward never ran
            pending.state.clear()
        self._copies = CpuCopyCache()
        self._pending = weakref.WeakValueDictionary()
        reporting.console(self.summary())
        if self.rows:
            path = reporting.results_path(self.common, self.results_folder,
                                          f"op_autocompare_info_{self.stem}.csv")
            rows = [{"op": op, "forward_id": forward_id, "phase": phase, **c.row(), "location": location}
                    for op, forward_id, phase, c, location in self.rows]
            reporting.write_csv(path, [{c: row.get(c, "") for c in CSV_COLUMNS} for row in rows])
            reporting.console(f"OpAutoCompare: {len(self.rows)} comparisons saved in {path}")

    def summary(self) -> str:
        """The end-of-run text: counts, skip reasons, and the failing ops in execution order."""
        c = self.counts
        lines = [f"\nOpAutoCompare summary: forward {c['forward compared']} compared, {c['forward passed']} passed, "
                 f"{c['forward failed']} failed; backward {c['backward compared']} compared, "
                 f"{c['backward passed']} passed, {c['backward failed']} failed; "
                 f"{sum(self.skipped.values())} skipped"]
        if self.skipped:
            lines.append("skipped: " + ", ".join(f"{reason}: {n}" for reason, n in self.skipped.most_common()))
        if self.backward_not_compared:
            lines.append("backward not compared: " + ", ".join(
                f"{reason}: {n}" for reason, n in self.backward_not_compared.most_common()))
        if self.failures:
            lines.append("failing ops in execution order (the first is where to look):")
            lines.append(reporting.table(self.failures, ("order", "op", "phase", "forward_id", "failing",
                                                         "error_info", "location")).get_string())
        else:
            lines.append("no op failed")
        return "\n".join(lines)


def _leaf_dtypes(result) -> tuple:
    if isinstance(result, torch.Tensor):  # most ops: no walk
        return (result.dtype,)
    return tuple(t.dtype for t in iter_tensors(result))


def call_func(state: dict, args, kwargs):
    return state["func"](*args, **kwargs)


def _named_row(op: str, comparison: Comparison) -> dict:
    row = comparison.row()
    row["name"] = f"{op} {row['name']}"
    return row


class CpuCopyCache:
    """CPU copies of device tensors, reused while the tensor is unchanged (same object, same version).

    One op's output is usually the next op's input: its copy, made to compare the output, serves as
    the next input snapshot. Bounded in entries and bytes; copies are never modified by the tool.
    """

    MAX_ENTRIES = 1024  # the byte bound is what limits memory; many small entries cost nothing
    MAX_BYTES = 256 << 20
    _ATTR = "_op_tools_cpu_copy_key"

    def __init__(self) -> None:
        # key -> (version, copy, bytes)
        self._entries: collections.OrderedDict[int, tuple[int, torch.Tensor, int]] = collections.OrderedDict()
        self._keys = itertools.count(1)
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, t: torch.Tensor) -> torch.Tensor:
        """A CPU copy of ``t`` as it is now, outside autograd."""
        if t.is_cpu:
            return t.detach().clone()
        try:
            version = t._version
        except RuntimeError:  # an inference tensor: no version tells that it is unchanged
            return _snapshot(t)
        # A read needs no lock (one dict operation, atomic); the lock keeps an insertion and its evictions together.
        entry = self._entries.get(getattr(t, self._ATTR, None))
        if entry is not None and entry[0] == version:
            return entry[1]
        copy = _snapshot(t)
        size = copy.nbytes
        if size > self.MAX_BYTES // 4:
            return copy
        key = next(self._keys)
        try:
            setattr(t, self._ATTR, key)
        except (AttributeError, TypeError, RuntimeError):
            return copy
        with self._lock:
            self._entries[key] = (version, copy, size)
            self._bytes += size
            while len(self._entries) > self.MAX_ENTRIES or self._bytes > self.MAX_BYTES:
                self._bytes -= self._entries.popitem(last=False)[1][2]
        return copy


def _snapshot(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy outside autograd: grad disabled (a detach would be one more device op) where it matters."""
    with _grad_mode(False) if t.requires_grad else _UNCHANGED:
        return t.to(device=_CPU, copy=True)


_UNCHANGED = contextlib.nullcontext()


def _grad_mode(enabled: bool):
    """``torch.set_grad_enabled(enabled)``, or nothing to enter where grad mode is that already (entering one
    costs microseconds, and the tool would on every call)."""
    return _UNCHANGED if torch.is_grad_enabled() == enabled else torch.set_grad_enabled(enabled)


def _labelled_tensors(args, kwargs):
    """``("input[0]", tensor)``, ``("input[1][0]", ...)``, ``("input[weight]", ...)``: every tensor argument."""
    for key, value in itertools.chain(enumerate(args), kwargs.items()):
        if isinstance(value, torch.Tensor):  # most arguments: no walk
            yield f"input[{key}]", value
        else:
            for path, v in iter_items(value, f"[{key}]"):
                if isinstance(v, torch.Tensor):
                    yield f"input{path}", v


def _snapshots_by_device_id(call: OpCall, state: dict) -> dict[int, torch.Tensor]:
    """Device tensor id -> its CPU snapshot (the first one, for a tensor passed twice)."""
    mapping = {}
    for d, s in state["tensors"]:
        mapping.setdefault(id(d), s)
    state["grad_snaps"] = [mapping.get(id(t)) for t in state.get("grad_inputs", ())]
    state["func"] = call.func
    return mapping


def _snapshots_in_order(state: dict, count: int):
    snaps = state.get("grad_snaps")
    if not snaps or len(snaps) != count or any(s is None for s in snaps):
        return None
    return snaps


def _reference_backward(outputs: list[torch.Tensor], leaves: list, upstream: tuple) -> tuple:
    """Gradients of ``leaves`` for ``upstream`` gradients of ``outputs`` (cast to each output's dtype)."""
    pairs = [(o, g.to(o.dtype)) for o, g in zip(outputs, upstream)
             if g is not None and o.requires_grad]
    live = [leaf for leaf in leaves if leaf is not None]
    if not pairs or not live:
        return tuple(None for _ in leaves)
    grads = iter(torch.autograd.grad([o for o, _ in pairs], live, [g for _, g in pairs], allow_unused=True))
    return tuple(None if leaf is None else next(grads) for leaf in leaves)


class _NoCpuAutocast:
    """The CPU reference never runs under CPU autocast (the user's, if any)."""

    def __enter__(self):
        self.context = torch.autocast("cpu", enabled=False) if torch.is_autocast_enabled("cpu") else None
        if self.context is not None:
            self.context.__enter__()

    def __exit__(self, *exc):
        if self.context is not None:
            self.context.__exit__(*exc)

