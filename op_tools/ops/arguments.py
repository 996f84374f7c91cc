"""Walking the arguments and results of a call: tensors inside nested containers, their devices."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any, Callable

import torch

from .torch_versions import TensorBase

_CPU = "cpu"


def _is_structseq(x) -> bool:
    return type(x).__module__ == "torch.return_types"


def iter_items(obj, path: str = "") -> Iterator[tuple[str, Any]]:
    """Leaves of ``obj`` with their index path (``[0]``, ``[1][2]``, ``[dim]``)."""
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from iter_items(v, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_items(v, f"{path}[{k}]")
    else:
        yield path, obj


_NESTED = (list, tuple, dict)


def tensor_items(obj, path: str = "") -> list[tuple[str, torch.Tensor]]:
    """The tensors among the leaves of ``obj`` with their ``iter_items`` paths, in the same order: asked per handled
    call by the tools meant to stay on, so built in one list with a path string only per tensor and container (a
    call's arguments are mostly flat, and mostly not tensors: sizes, dims, flags)."""
    found: list[tuple[str, torch.Tensor]] = []
    if isinstance(obj, torch.Tensor):
        found.append((path, obj))
    elif isinstance(obj, _NESTED):
        _add_tensor_items(obj, path, found)
    return found


def _add_tensor_items(obj, path: str, found: list) -> None:
    for key, v in (obj.items() if isinstance(obj, dict) else enumerate(obj)):
        if isinstance(v, torch.Tensor):
            found.append((f"{path}[{key}]", v))
        elif isinstance(v, _NESTED) and v:
            _add_tensor_items(v, f"{path}[{key}]", found)


_dtensor: list[type] = []  # DTensor, once its module is loaded (it never unloads)


def dtensor_class() -> type | None:
    """``torch.distributed.tensor.DTensor`` where that module is loaded, else None (then no DTensor exists)."""
    if _dtensor:
        return _dtensor[0]
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    if dtensor is not None:
        _dtensor.append(dtensor)
    return dtensor


class UnsupportedInputError(Exception):
    """Raised by a tool's step on a call it cannot check by design (its message says what: "sparse tensors are not
    compared"): the engine counts the call as not checked for that reason, said in the verdict beside the tool's
    failures, without a traceback; raised in strict mode, as a failure is."""


def strided(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t``, when its layout is the dense one; else ``UnsupportedInputError`` saying that ``what`` (a tool's work: "are
    compared") takes no such tensor."""
    if t.layout is not torch.strided:
        kind = "sparse" if t.is_sparse or t.layout in COMPRESSED else str(t.layout).removeprefix("torch.")
        raise UnsupportedInputError(f"{kind} tensors {what}")
    return t


COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def sparse_values(t: torch.Tensor, summed: bool = False) -> torch.Tensor | None:
    """A sparse tensor's stored values (its implicit zeros aside), outside autograd; ``summed``: a COO tensor's
    duplicate indices added first, as its dense form adds them (for its norm). None for another layout (mkldnn)."""
    with torch.no_grad():
        if t.layout is torch.sparse_coo:
            return t.coalesce().values() if summed else t._values()  # uncoalesced: every stored value
        return t.values() if t.layout in COMPRESSED else None


def local_part(value):
    """A DTensor's part held by this rank (its local tensor), any other value as it is: what is on this host.

    A shard or a replica of the global tensor, or a partial sum (``Partial``) before its reduction: an inf or nan in
    the global tensor is one in some rank's part.
    """
    dtensor = dtensor_class()
    if dtensor is not None and isinstance(value, dtensor):
        return value._local_tensor
    return value


def whole(value):
    """A DTensor as the global tensor it stands for (``full_tensor()``: gathered, or reduced from partial sums, over
    its mesh: a collective, which every rank makes at the same call of the same program), any other value as it is."""
    dtensor = dtensor_class()
    if dtensor is not None and isinstance(value, dtensor):
        return value.full_tensor()
    return value


def is_dtensor(value) -> bool:
    dtensor = dtensor_class()
    return dtensor is not None and isinstance(value, dtensor)


def iter_tensors(obj) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from iter_tensors(v)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_tensors(v)


_transforms_active = torch._C._are_functorch_transforms_active
_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def promoted_dtype(args, kwargs) -> torch.dtype | None:
    """The dtype type promotion gives the call's floating tensors (what the op returns with autocast off)."""
    promoted = None
    for t in iter_tensors((args, kwargs)):
        if t.is_floating_point():
            promoted = t.dtype if promoted is None else torch.promote_types(promoted, t.dtype)
    return promoted


def in_transform(args, kwargs) -> bool:
    """Whether a call works on ``torch.func`` transforms' tensors (``vmap``'s batched tensors, ``grad``'s wrappers):
    they have no storage to read, copy or save, and one logical value stands for a batch of them. One call into torch
    outside transforms."""
    return _transforms_active() and any(_wrapped(t) for t in iter_tensors((args, kwargs)))


def map_tensors(obj, fn: Callable[[torch.Tensor], Any]):
    """``obj`` with every tensor replaced by ``fn(tensor)``; containers rebuilt with their own type."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        items = [map_tensors(v, fn) for v in obj]
        if _is_structseq(obj):
            return type(obj)(items)
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return type(obj)(*items)
        return type(obj)(items)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj


_device_getter = TensorBase.device.__get__
_modes_on = torch._C._is_torch_function_mode_enabled


def storage_address(t: torch.Tensor) -> int | None:
    """Where ``t``'s storage's memory starts (its views share it), or None for a tensor without one (sparse,
    nested)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):  # storage-less tensors
        return None


def real_device(tensor: torch.Tensor) -> torch.device:
    """The device ``tensor`` is on, whatever a device layer makes ``Tensor.device`` show (ditorch shows cuda)."""
    if _modes_on():  # the C getter would hand a mode the Tensor.device property, which may show another device
        with torch._C.DisableTorchFunction():
            return _device_getter(tensor)
    return _device_getter(tensor)


# Devices whose calls are no device's work: the CPU (the reference), and meta, whose tensors hold no values (a model
# built there, then ``to_empty`` on the device: FSDP2's way): nothing to compare, flag, save, or move to the CPU
_NOT_DEVICES = (_CPU, "meta")


def call_device(args, kwargs, name: str = "") -> torch.device | None:
    """The first device other than the CPU and meta among the tensors and devices of a call, or None (the call is on
    the CPU, or on meta tensors)."""
    device: torch.device | None
    for obj in args:  # _device_in(args) unrolled: asked once per handled call, mostly of a tensor first
        if isinstance(obj, torch.Tensor):
            device = obj.device
            if device.type not in _NOT_DEVICES:
                return device
        elif isinstance(obj, _CONTAINERS):
            device = _device_in(obj)
            if device is not None:
                return device
    if kwargs:
        device = _device_in(kwargs)
        if device is not None:
            return device
        device = kwargs.get("device")
        if isinstance(device, (str, int)) and not isinstance(device, bool):
            return _non_cpu(device)
    if name.endswith(".to"):  # Tensor.to("sim"), Tensor.to("sim", torch.float16)
        for arg in args[1:]:
            if isinstance(arg, str):
                return _non_cpu(arg)
    return None


_CONTAINERS = (list, tuple, dict, torch.device)


def _device_in(obj) -> torch.device | None:
    if isinstance(obj, torch.Tensor):
        shown = obj.device
        return shown if shown.type not in _NOT_DEVICES else None
    if isinstance(obj, torch.device):
        return obj if obj.type not in _NOT_DEVICES else None
    if isinstance(obj, (list, tuple)):
        for v in obj:
            device = _device_in(v)
            if device is not None:
                return device
    elif isinstance(obj, dict):
        for v in obj.values():
            device = _device_in(v)
            if device is not None:
                return device
    return None


def _non_cpu(text) -> torch.device | None:
    try:
        device = torch.device(text)
    except (RuntimeError, TypeError):
        return None
    return device if device.type not in _NOT_DEVICES else None
