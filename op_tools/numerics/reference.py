"""The CPU reference of a device call: the op rerun on host copies of its inputs in float64 (or the widest dtype
the CPU runs it in), and, when the verdict needs it, in the device's own dtype with the device's declared math.

Reruns never touch what the user's run uses: they work on tensors they own (an op that writes an argument writes
the reference's own copy), never run under the user's CPU autocast nor under saved-tensor hooks
(``torch.utils.checkpoint``'s would count the reference's saved tensors as the user's), and leave the CPU
generator as they found it.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from ..ops.arguments import iter_tensors, map_tensors
from ..ops.torch_versions import autocast_enabled
from .device_math import DeviceMath, emulated

_CPU = torch.device("cpu")
DEFAULT_CAST = {torch.float16: torch.float64, torch.bfloat16: torch.float64, torch.float32: torch.float64,
                torch.complex64: torch.complex128}
_FALLBACK_CAST = {torch.float16: torch.float32, torch.bfloat16: torch.float32}
_ERRORS = (RuntimeError, NotImplementedError, TypeError, ValueError, IndexError)


# --- moving arguments to the CPU ---

@functools.lru_cache(maxsize=1024)
def device_named(value: str) -> torch.device | None:
    """The device a string argument names ("cuda:0", "cpu"), or None for any other string ("mean", "tanh")."""
    try:
        return torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        return None


def _is_device_text(value: str) -> bool:
    device = device_named(value)
    return device is not None and device.type != "cpu"


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


def map_arguments(obj, tensor_fn, cast: dict | None = None, keep_devices: bool = False):
    """``obj`` (args tuple or kwargs dict) with tensors through ``tensor_fn``, devices moved to the CPU (kept with
    ``keep_devices``: a reference run on the device) and dtypes through ``cast``."""
    if isinstance(obj, torch.Tensor):
        return tensor_fn(obj)
    kind = type(obj)
    if kind in _PLAIN:
        return obj
    if kind is tuple or kind is list:  # most arguments: tensors and plain values, mapped without a call each
        return kind([tensor_fn(v) if isinstance(v, torch.Tensor) else v if type(v) in _PLAIN
                     else map_arguments(v, tensor_fn, cast, keep_devices) for v in obj])
    if kind is dict and not obj:
        return {}
    if isinstance(obj, dict):
        return {k: (_CPU if k == "device" and v is not None and not isinstance(v, torch.Tensor) and not keep_devices
                    else map_arguments(v, tensor_fn, cast, keep_devices)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        items = [map_arguments(v, tensor_fn, cast, keep_devices) for v in obj]
        if type(obj).__module__ == "torch.return_types":
            return type(obj)(items)
        return type(obj)(items) if not hasattr(obj, "_fields") else type(obj)(*items)
    if keep_devices:
        return cast.get(obj, obj) if cast and isinstance(obj, torch.dtype) else obj
    return _cpu_value(obj, cast)


def recast(obj, cast: dict, owned: set | frozenset = frozenset(), leaves: dict | None = None,
           mapped: dict | None = None, keep_devices: bool = False):
    """The tensors of ``obj`` cast by ``cast``. A tensor whose id is in ``owned`` (one the op writes) is always a
    new tensor; one in ``leaves`` becomes that leaf (cloned when owned: an in-place op cannot write a leaf).
    ``mapped`` collects id(original) -> tensor handed to the op."""
    def tensor_fn(t: torch.Tensor) -> torch.Tensor:
        leaf = leaves.get(id(t)) if leaves else None
        if leaf is not None:
            out = leaf.clone() if id(t) in owned else leaf
        else:
            target = cast.get(t.dtype, t.dtype)
            out = t if target == t.dtype and id(t) not in owned else t.to(dtype=target, copy=True)
        if mapped is not None:
            mapped[id(t)] = out
        return out

    return map_arguments(obj, tensor_fn, cast, keep_devices)


# --- running it ---

_NOTHING = contextlib.nullcontext()  # reusable: entering it holds no state


def isolated():
    """The context of every rerun: no CPU autocast of the user's, no saved-tensor hooks of the user's."""
    autocast, hooks = autocast_enabled("cpu"), _saved_tensor_hooks_active()
    # most calls have neither: no generator-based context built for them (several per compared call)
    return _isolating(autocast, hooks) if autocast or hooks else _NOTHING


@contextlib.contextmanager
def _isolating(autocast: bool, hooks: bool):
    with contextlib.ExitStack() as stack:
        if autocast:
            stack.enter_context(torch.autocast("cpu", enabled=False))
        if hooks:
            # Identity hooks: the reference graph saves its tensors plainly (checkpoint's would claim them).
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_same, _same))
        yield


def _same(t):
    return t


def _saved_tensor_hooks_active() -> bool:
    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(True) is not None
    except (AttributeError, TypeError, RuntimeError):
        return True  # unknown: the identity hooks are harmless


def attempts_for(requested: dict) -> list[tuple[dict, str]]:
    """The casts to try for the reference, in order, with the note each adds to a report."""
    attempts = [(requested, "")]
    if any(v == torch.float64 for v in requested.values()):
        attempts += [(_FALLBACK_CAST, "reference in float32: no float64 kernel on the CPU"),
                     ({}, "reference in the device's dtype: no wider kernel on the CPU")]
    return attempts


class Reference:
    """One reference run: its arguments, result, leaves (for backward) and, per written argument, its result."""

    __slots__ = ("args", "kwargs", "result", "leaves", "mapped", "note", "math_used")

    def __init__(self, args, kwargs, result, leaves, mapped, note: str, math_used: DeviceMath | None = None) -> None:
        self.args, self.kwargs, self.result, self.leaves, self.mapped, self.note = \
            args, kwargs, result, leaves, mapped, note
        self.math_used = math_used  # the part of the device's declared math its ops applied (same-dtype runs)


def run_reference(func, cpu_args, cpu_kwargs, attempts, owned: set, grad_snaps: list, keep_devices: bool = False) \
        -> tuple[Reference | None, str]:
    """The op on the CPU under the first cast in ``attempts`` its CPU kernels take; ``(None, error)`` if none does.

    ``grad_snaps``: the host copies of the inputs whose gradients are compared (they become float64 leaves).
    ``keep_devices``: the copies are the tool's own float64 copies on the device (``device_reference``), and the op
    runs there; a copy already in the cast's dtype becomes its leaf without another copy (the op never writes a leaf).
    """
    error = None
    for cast, note in attempts:
        leaves = {}
        ordered = []
        for snap in grad_snaps:
            target = cast.get(snap.dtype, snap.dtype)
            leaf = (snap.detach() if keep_devices and target == snap.dtype
                    else snap.to(dtype=target, copy=True)).requires_grad_()
            leaves[id(snap)] = leaf
            ordered.append(leaf)
        mapped: dict = {}
        # an argument the op writes gets a clone of its leaf: made with gradients on, or it would be cut from the leaf
        # (the backward's same-dtype rerun runs in an autograd hook, where they are off)
        with torch.set_grad_enabled(bool(grad_snaps)):
            args = recast(cpu_args, cast, owned, leaves, mapped, keep_devices)
            kwargs = recast(cpu_kwargs, cast, owned, leaves, mapped, keep_devices)
        try:
            with torch.set_grad_enabled(bool(grad_snaps)), isolated():
                result = func(*args, **kwargs)
        except _ERRORS as e:
            error = e
            continue
        return Reference(args, kwargs, result, ordered, mapped, note), ""
    return None, f"{type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"


def run_same_dtype(func, cpu_args, cpu_kwargs, owned: set, math: DeviceMath, grad_snaps: list | tuple = ()):
    """The op on the CPU in the device's dtypes, computing as the device declared (autocast, TF32); ``Reference``,
    or None when the CPU has no kernel (then float32 rounded to the device's dtype, if that runs). On a device that
    sums a narrow dtype's terms in float32 (``math.float32_sums``), a forward run is made in float32 and rounded once
    to the dtypes a run in the device's dtypes gives (``_summed_in_float32``), as such a device computes it."""
    if math.float32_sums and not grad_snaps:
        run = _summed_in_float32(func, cpu_args, cpu_kwargs, owned, math)
        if run is not None:
            return run
    leaves = {id(s): s.detach().clone().requires_grad_() for s in grad_snaps}
    mapped: dict = {}
    with torch.set_grad_enabled(bool(grad_snaps)):  # a written argument's leaf clone stays connected (run_reference)
        args = recast(cpu_args, {}, owned, leaves, mapped)
        kwargs = recast(cpu_kwargs, {}, owned, leaves, mapped)
    used: set = set()
    try:
        with torch.set_grad_enabled(bool(grad_snaps)), isolated(), emulated(math, used):
            result = func(*args, **kwargs)
    except _ERRORS:
        return None if grad_snaps else _rounded_float32(func, cpu_args, cpu_kwargs, owned, math)
    return Reference(args, kwargs, result, [leaves[id(s)] for s in grad_snaps], mapped, "",
                     math.only(used) if used else None)


def meta_dtypes(func, cpu_args, cpu_kwargs, math: DeviceMath) -> tuple | None:
    """The dtypes of the op's tensor outputs as a correct run in the device's dtypes and math gives them, from a
    run on meta tensors (no computation); None when the op has no meta kernel."""
    to_meta = functools.partial(map_tensors, fn=lambda t: t.detach().to("meta"))
    try:
        with torch.no_grad(), isolated(), emulated(math):
            result = func(*to_meta(cpu_args), **to_meta(cpu_kwargs))
    except Exception:  # noqa: BLE001 - no meta kernel, or a data-dependent op: the same-dtype run decides
        return None
    return tuple(t.dtype for t in iter_tensors(result))


def _summed_in_float32(func, cpu_args, cpu_kwargs, owned: set, math: DeviceMath) -> Reference | None:
    """The op on the CPU with its narrow floating arguments in float32, each result (and written argument) rounded
    once to the dtype a run in the device's dtypes gives (learnt on meta tensors); None where that cannot be learnt
    or run (the usual run then decides)."""
    dtypes = meta_dtypes(func, cpu_args, cpu_kwargs, math)
    if dtypes is None:
        return None
    original = {id(t): t.dtype for t in (*iter_tensors(cpu_args), *iter_tensors(cpu_kwargs))}
    run = _in_float32(func, cpu_args, cpu_kwargs, owned, math)
    if run is None or len(list(iter_tensors(run.result))) != len(dtypes):
        return None
    rounded = iter(dtypes)
    run.result = map_tensors(run.result, lambda t: t.to(next(rounded)))
    run.mapped = {k: v.to(original[k]) for k, v in run.mapped.items()}
    return run


def _rounded_float32(func, cpu_args, cpu_kwargs, owned: set, math: DeviceMath):
    """No CPU kernel in the device's dtype: float32 rounded to it is what a correct implementation gives."""
    narrow = _first_low_precision(cpu_args, cpu_kwargs) or math.autocast_dtype
    run = _in_float32(func, cpu_args, cpu_kwargs, owned, math)
    if run is not None and narrow is not None:
        run.result = map_tensors(run.result, lambda t: t.to(narrow) if t.dtype == torch.float32 else t)
        run.mapped = {k: v.to(narrow) if v.dtype == torch.float32 else v for k, v in run.mapped.items()}
    return run


def _in_float32(func, cpu_args, cpu_kwargs, owned: set, math: DeviceMath) -> Reference | None:
    """The op on the CPU with its float16 and bfloat16 arguments in float32, without a graph; None if it raised."""
    wide = {dtype: torch.float32 for dtype in (torch.float16, torch.bfloat16)}
    mapped: dict = {}
    args = recast(cpu_args, wide, owned, None, mapped)
    kwargs = recast(cpu_kwargs, wide, owned, None, mapped)
    used: set = set()
    try:
        with torch.no_grad(), isolated(), emulated(math, used):
            result = func(*args, **kwargs)
    except _ERRORS:
        return None
    return Reference(args, kwargs, result, [], mapped, "", math.only(used) if used else None)


def _first_low_precision(*objs) -> torch.dtype | None:
    for obj in objs:
        for t in iter_tensors(obj):
            if t.dtype in (torch.float16, torch.bfloat16):
                return t.dtype
    return None


def reference_backward(outputs: list[torch.Tensor], leaves: list, upstream: tuple, math: DeviceMath | None = None,
                       retain: bool = False) -> tuple:
    """Gradients of ``leaves`` for ``upstream`` gradients of ``outputs`` (cast to each output's dtype); with ``math``,
    the backward kernels compute as the device declared (a same-dtype run's backward); ``retain``: the graph can be
    run backward again (for other upstream gradients: a stale copy re-read)."""
    pairs = [(o, g.to(o.dtype)) for o, g in zip(outputs, upstream)
             if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
    live = [leaf for leaf in leaves if leaf is not None]
    if not pairs or not live:
        return tuple(None for _ in leaves)
    with isolated(), emulated(math or DeviceMath()):
        grads = iter(_grad(tuple(o for o, _ in pairs), tuple(live), tuple(g for _, g in pairs), retain))
    return tuple(None if leaf is None else next(grads) for leaf in leaves)


def broadcast_terms(func, reference: Reference, upstream: tuple, shape: torch.Size) -> tuple:
    """For an op computed element by element over ``shape`` (its outputs'), whose gradient for an input broadcast to
    ``shape`` sums, over the broadcast elements, that element's gradient (``op_facts``' ``broadcast_sums``): per leaf
    of ``reference`` with fewer elements, ``(magnitudes, n)``, the sum of its terms' magnitudes in float64 and how
    many terms each element sums (None for any other leaf). The op is rerun with each use of such a leaf expanded to
    ``shape`` and made a leaf of its own: its gradient is the terms themselves, whatever the op computes from its
    inputs (a maximum's selection, a lerp's ``1 - weight``), which a rerun on absolute values would not give."""
    size = shape.numel()
    broadcast = {id(leaf): leaf for leaf in reference.leaves
                 if leaf is not None and 0 < leaf.numel() < size}
    uses: dict[int, list[torch.Tensor]] = {key: [] for key in broadcast}

    def term(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in broadcast:
            return t.detach().clone()  # an in-place op writes its own copy, never the reference's
        expanded = t.detach().expand(shape).clone().requires_grad_()
        uses[id(t)].append(expanded)
        return expanded

    with isolated(), torch.enable_grad():
        result = func(*map_tensors(reference.args, term), **map_tensors(reference.kwargs, term))
    outputs = [result] if isinstance(result, torch.Tensor) else list(iter_tensors(result))
    copies = [copy for key in broadcast for copy in uses[key]]
    grads = iter(reference_backward(outputs, copies, upstream))
    summed = {}
    for key, leaf in broadcast.items():
        terms = [g for g in (next(grads) for _ in uses[key]) if g is not None]
        if terms:
            summed[key] = (sum(g.abs().sum_to_size(leaf.shape) for g in terms), size // leaf.numel() * len(terms))
    return tuple(None if leaf is None else summed.get(id(leaf)) for leaf in reference.leaves)


def index_sum_terms(func, reference: Reference, upstream: tuple) -> tuple:
    """For an op whose gradient for its floating input sums the upstream gradient's rows by index (``op_facts``'
    ``index_sums``: an embedding's weight): per leaf of ``reference``, ``(magnitudes, n)``, the gradient the op gives
    for the upstream's absolute values in float64 (a row's terms are upstream rows, divided by their index's count
    at most: that gradient sums their magnitudes) and the most rows one index sums; None for any other leaf. The op
    is rerun on copies of the leaves: its gradient does not depend on their values (``max_norm`` writes the copy)."""
    copies = {id(leaf): leaf.detach().clone().requires_grad_() for leaf in reference.leaves
              if leaf is not None and leaf.is_floating_point()}
    n = _most_repeats(reference)
    if n is None or not copies:
        return tuple(None for _ in reference.leaves)

    def copy(t: torch.Tensor) -> torch.Tensor:
        return copies.get(id(t), t)

    with isolated(), torch.enable_grad():
        result = func(*map_tensors(reference.args, copy), **map_tensors(reference.kwargs, copy))
    outputs = [result] if isinstance(result, torch.Tensor) else list(iter_tensors(result))
    grads = reference_backward(outputs, list(copies.values()), tuple(None if g is None else g.abs() for g in upstream))
    summed = {key: (grad, n) for key, grad in zip(copies, grads) if grad is not None}
    return tuple(None if leaf is None else summed.get(id(leaf)) for leaf in reference.leaves)


def accumulated_terms(func, reference: Reference) -> tuple[torch.Tensor, int] | None:
    """For an op that adds values into its first argument where an index repeats (``op_facts``' ``accumulates_when``:
    ``index_put``'s ``accumulate``): ``(magnitudes, n)``, ``|self| + 2 sum |values|`` per element in float64 (an
    in-place call's first argument holds its result already: counting the values twice covers what it held before)
    and one more than the most values one position takes (``_most_repeats``); None without an index."""
    first = next(iter_tensors(reference.args), None)
    repeats = _most_repeats(reference)
    if first is None or repeats is None:
        return None

    def without_self(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(t) if t is first else _absolute(t)

    with isolated(), torch.no_grad():
        total = func(*map_tensors(reference.args, _absolute), **map_tensors(reference.kwargs, _absolute))
        values = func(*map_tensors(reference.args, without_self), **map_tensors(reference.kwargs, without_self))
    return total + values, 1 + repeats


def _most_repeats(reference: Reference) -> int | None:
    """How often one position is indexed at most: the most terms it sums. The index is the first argument holding a
    non-floating tensor (an embedding's ids, ``index_put``'s index tensors, a ``__getitem__`` key); its tensors, a
    boolean mask as the positions it holds, broadcast together, name a position per row, counted as whole rows:
    a mask holds each position once, and with several index tensors a position repeats only as often as its tuple
    does (the first tensor's counts took a mask of 30,000 elements for 20,000 terms a position, and a float32 sum's
    bound passed a fault of 1e-4). The number of rows where a value is negative (another name for a
    position) or the tensors do not broadcast; None without an index."""
    index = next((a for a in (*reference.args, *reference.kwargs.values())
                  if any(not (t.is_floating_point() or t.is_complex()) for t in iter_tensors(a))), None)
    columns: list[torch.Tensor] = []
    for t in iter_tensors(index):
        if t.is_floating_point() or t.is_complex():
            continue
        t = t.to("cpu")
        columns.extend(t.nonzero(as_tuple=True) if t.dtype == torch.bool else (t.to(torch.int64),))
    if not columns:
        return None
    try:
        columns = list(torch.broadcast_tensors(*columns))
    except RuntimeError:
        return max(c.numel() for c in columns) or None
    rows = torch.stack([c.reshape(-1) for c in columns], 1)
    if not rows.shape[0]:
        return None
    if bool((rows < 0).any()):
        return rows.shape[0]
    if rows.shape[1] == 1:
        return int(torch.bincount(rows[:, 0]).max())
    return int(torch.unique(rows, dim=0, return_counts=True)[1].max())


def magnitudes_forward(func, reference: Reference):
    """The op rerun in float64 on the absolute values of every floating argument: for an op whose result elements are
    sums or means of its input's elements (``op_facts``' ``sums_elements``), the magnitudes each one sums."""
    with isolated(), torch.no_grad():
        return func(*map_tensors(reference.args, _absolute), **map_tensors(reference.kwargs, _absolute))


def _absolute(t: torch.Tensor) -> torch.Tensor:
    return t.detach().abs() if t.is_floating_point() else t


# torch.autograd.grad's checks and conversions cost about as much as a small op's float64 backward; the engine's
# entry (PyTorch >= 2.3) is taken where those checks hold by construction (one gradient per output, same shapes)
_engine_run_backward = getattr(torch.autograd.graph, "_engine_run_backward", None)


def _grad(outputs: tuple, inputs: tuple, grads: tuple, retain: bool = False) -> tuple:
    if _engine_run_backward is None or any(o.shape != g.shape for o, g in zip(outputs, grads)):
        return torch.autograd.grad(outputs, inputs, grads, retain_graph=retain, allow_unused=True)
    return _engine_run_backward(outputs, grads, retain, False, inputs, True, accumulate_grad=False)
