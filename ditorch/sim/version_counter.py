"""The ``unversioned`` fault: matched in-place and ``out=`` ops write without bumping version counters.

On real hardware some kernels write tensors behind autograd's back: GradScaler's
``_amp_foreach_non_finite_check_and_unscale_``, BatchNorm's running statistics, CUDA's fused
``_foreach_lerp_``. Code that trusts ``tensor._version`` to notice a write (caches, "was this
input mutated?" checks) misses those writes. On sim, the ops without an ADInplaceOrView kernel
(the foreach family, those batch-norm and AMP ops) already write that way; this fault makes any
other in-place or ``out=`` op do the same.

The bump happens in PyTorch's ADInplaceOrView kernel after the device's kernel returns (and
``_unsafe_set_version_counter`` refuses to lower a counter), so sim's kernel cannot undo it. While
such a fault is active, each matched overload gets a Python kernel on the ADInplaceOrView key that
does what the generated one does (torchgen's ``gen_inplace_or_view_type.py``: dispatch below the
key, then ``increment_version`` on every returned tensor; ``resize_``/``resize_as_`` only when the
size changed, as in ``VariableTypeManual.cpp``) except for the sim tensors of a matching call.
Other devices keep the default behaviour; ``clear`` destroys the library, restoring the original
kernels.
"""

from __future__ import annotations

import threading
import warnings

import torch

# Every key the ADInplaceOrView kernel must not re-enter: itself, autograd and all above them. A call
# with these excluded dispatches exactly as a redispatch with ``keyset & after_ADInplaceOrView``
# would, but through OpOverload.__call__, which (unlike ``redispatch``) takes back the Python numbers
# that wrapped-number tensors became on their way into this Python kernel (``x.add_(1)``).
_ABOVE = torch._C.DispatchKeySet.from_raw_repr(
    torch._C._dispatch_keyset_full().raw_repr() & ~torch._C._after_ADInplaceOrView_keyset.raw_repr())
_BUMP_IF_RESIZED = {"resize_", "resize_as_"}  # their manual kernels bump only when the size changes


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _call_dtypes(args, kwargs) -> set:
    found = {t.dtype for a in (*args, *kwargs.values()) for t in _tensors(a)}
    if isinstance(kwargs.get("dtype"), torch.dtype):
        found.add(kwargs["dtype"])
    return found


def _kernel(op, dtypes: frozenset | None, bump_if_resized: bool, writes: UnversionedWrites):
    """The ADInplaceOrView kernel of ``op``; ``dtypes`` None: every call on sim is unversioned."""

    def kernel(*args, **kwargs):
        before = args[0].shape if bump_if_resized else None
        with torch._C._ExcludeDispatchKeyGuard(_ABOVE):
            out = op(*args, **kwargs)
        if bump_if_resized and args[0].shape == before:
            return out
        skip_sim = dtypes is None or not dtypes.isdisjoint(_call_dtypes(args, kwargs))
        for tensor in _tensors(out):
            if not (skip_sim and isinstance(tensor, writes.sim_tensor_class)):
                torch.autograd.graph.increment_version(tensor)
        return out

    return kernel


def matching_overloads(faults) -> dict:
    """``{aten overload: dtypes or None}`` for the overloads with an ADInplaceOrView kernel that
    mutate an argument and match a fault's pattern (``None``: a fault without ``@dtype`` matched)."""
    matched: dict = {}
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::"):
            continue
        packet, _, overload_name = name[len("aten::"):].partition(".")
        full = f"{packet}.{overload_name or 'default'}"
        hits = [f for f in faults if f.matches_name(packet, full)]
        if not hits or not torch._C._dispatch_has_kernel_for_dispatch_key(name, "ADInplaceOrView"):
            continue
        op = getattr(getattr(torch.ops.aten, packet), overload_name or "default")
        if not any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments):
            continue  # a view op: its ADInplaceOrView kernel makes views, it bumps nothing
        dtypes = None if any(f.dtype is None for f in hits) else frozenset(f.dtype for f in hits)
        matched[op] = dtypes
    return matched


class UnversionedWrites:
    """The ADInplaceOrView kernels of the active ``unversioned`` faults (none: the original kernels)."""

    def __init__(self) -> None:
        self._library: torch.library.Library | None = None
        self._lock = threading.Lock()
        self.overloads: dict = {}
        # Set by tensor.py, which defines SimTensor and sits above this module; read per call, as faults
        # may be set before it is imported. Until then () (isinstance is False): no sim tensor exists.
        self.sim_tensor_class: type | tuple[type, ...] = ()

    def apply(self, faults) -> None:
        """Replace the kernels with those for ``faults`` (the ``unversioned`` ones among them)."""
        faults = [f for f in faults if f.kind == "unversioned"]
        with self._lock:
            self._clear()
            if not faults:
                return
            self.overloads = matching_overloads(faults)
            library = torch.library.Library("aten", "IMPL")
            with warnings.catch_warnings():
                # Replacing the built-in kernel is the point; PyTorch warns that a kernel is overridden.
                warnings.filterwarnings("ignore", message=".*[Oo]verrid")
                for op, dtypes in self.overloads.items():
                    bump_if_resized = op._schema.name.removeprefix("aten::") in _BUMP_IF_RESIZED
                    library.impl(op, _kernel(op, dtypes, bump_if_resized, self), "ADInplaceOrView")
            self._library = library

    def _clear(self) -> None:
        if self._library is not None:
            self._library._destroy()
            self._library = None
        self.overloads = {}


WRITES = UnversionedWrites()
