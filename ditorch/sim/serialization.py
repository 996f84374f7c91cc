"""``torch.load(..., map_location="sim")``.

A sim storage cannot exist (sim tensors keep their bytes in CPU storages), so storages mapped to
sim are restored on the host and the tensors built on them are moved to their sim device once
loading is done. Sim tensors themselves are saved as a CPU copy plus their device (SimTensor's
``__reduce_ex__``), the way PyTorch saves any storage-less PrivateUse1 tensor.

A callable ``map_location`` is called as PyTorch calls it for a CUDA checkpoint's storages: with the saved values
in a host storage and the location they were saved from (``"sim:0"``). What it returns is where the tensor lands: a
host storage (``lambda s, loc: s``) on the host, ``s.cuda()`` (a storage moved to sim, which within ``torch.load``
is that host storage, recorded) on sim.
"""

from __future__ import annotations

import functools
import re
import threading

import torch

_LOCATION = re.compile(r"sim(:\d+)?")
_loading = threading.local()
_HOST = torch.device("cpu")
_installed = False


def _restore_on_host(storage, location: str):
    if not _LOCATION.fullmatch(location):
        return None
    pending = getattr(_loading, "pending", None)
    if pending is None:
        raise RuntimeError("sim: storages mapped to the sim device must be loaded through torch.load")
    pending[storage.data_ptr()] = torch.device(location)
    return storage


def _storage_to(to):
    @functools.wraps(to)
    def storage_to(self, *, device, non_blocking=False):
        device = torch.device(device)
        if device.type != "sim":
            return to(self, device=device, non_blocking=non_blocking)
        pending = getattr(_loading, "pending", None)
        if pending is None:  # torch.UntypedStorage(n, device="sim") crashes the process: sim has no storages
            raise RuntimeError(
                f"sim: a storage cannot be moved to {device} (sim tensors keep their values in host storages); "
                "move a tensor instead (tensor.to(device), tensor.cuda())")
        host = self if self.device.type == "cpu" else to(self, device=_HOST, non_blocking=False)
        index = device.index if device.index is not None else torch.sim.current_device()
        pending[host.data_ptr()] = torch.device("sim", index)  # moved with the tensors built on it
        return host

    return storage_to


def _rebuild_with_callable(rebuild):
    """``torch._utils._rebuild_device_tensor_from_cpu_tensor`` (how a sim tensor is saved), calling a callable
    ``map_location`` with the saved values' host storage and their location, as ``torch.load`` calls it for a CUDA
    tensor's storage; PyTorch's own refuses callables for storage-less devices."""

    @functools.wraps(rebuild)
    def rebuild_device_tensor(data, dtype, device, requires_grad):
        map_location = torch.serialization._serialization_tls.map_location
        if not (callable(map_location) and _LOCATION.fullmatch(str(device))):
            return rebuild(data, dtype, device, requires_grad)
        storage = map_location(data.untyped_storage(), str(device))
        if storage is None:  # where it was saved, as torch.load's default_restore_location
            return _on(data, dtype, torch.device(device), requires_grad)
        storage = getattr(storage, "_untyped_storage", storage)  # a TypedStorage's bytes
        tensor = torch.empty(0, dtype=data.dtype, device=storage.device)
        tensor.set_(storage, data.storage_offset(), data.size(), data.stride())
        return _on(tensor, dtype, tensor.device, requires_grad)

    return rebuild_device_tensor


def _on(data, dtype, device, requires_grad):
    tensor = data.to(dtype=dtype, device=device)
    tensor.requires_grad = requires_grad
    return tensor


def _move(obj, pending: dict, memo: dict):
    if id(obj) in memo:
        return memo[id(obj)]
    result = obj
    if isinstance(obj, torch.Tensor):
        device = pending.get(obj.untyped_storage().data_ptr()) if obj.device.type == "cpu" else None
        if device is not None:
            result = obj.to(device)
            if isinstance(obj, torch.nn.Parameter):
                result = torch.nn.Parameter(result, requires_grad=obj.requires_grad)
    elif isinstance(obj, torch.nn.Module):
        for tensor in (*obj.parameters(), *obj.buffers()):
            device = pending.get(tensor.untyped_storage().data_ptr())
            if device is not None:
                obj.to(device)
                break
    elif isinstance(obj, dict):
        result = type(obj)((k, _move(v, pending, memo)) for k, v in obj.items())
    elif isinstance(obj, (list, tuple, set)) and type(obj) in (list, tuple, set):
        result = type(obj)(_move(v, pending, memo) for v in obj)
    memo[id(obj)] = result
    return result


def _load_with_sim(load):
    @functools.wraps(load)
    def sim_aware_load(*args, **kwargs):
        outer = getattr(_loading, "pending", None)
        _loading.pending = pending = {}
        try:
            result = load(*args, **kwargs)
        finally:
            _loading.pending = outer
        return _move(result, pending, {}) if pending else result

    sim_aware_load.__wrapped_by_ditorch_sim__ = load
    return sim_aware_load


def install() -> None:
    global _installed
    if _installed:
        return
    torch.serialization.register_package(22.5, lambda storage: None, _restore_on_host)  # type: ignore[arg-type]  # the stub says int; the registry only sorts priorities
    torch.load = torch.serialization.load = _load_with_sim(torch.serialization.load)
    torch.UntypedStorage.to = _storage_to(torch.UntypedStorage.to)  # type: ignore[method-assign]  # sim's storages
    torch._utils._rebuild_device_tensor_from_cpu_tensor = _rebuild_with_callable(
        torch._utils._rebuild_device_tensor_from_cpu_tensor)
    # weights_only loading allows the rebuild functions it found on its first call: the one above from now on
    torch._weights_only_unpickler._get_allowed_globals.cache_clear()
    _installed = True
