"""``torch.load(..., map_location="sim")``.

A sim storage cannot exist (sim tensors keep their bytes in CPU storages), so storages mapped to
sim are restored on the host and the tensors built on them are moved to their sim device once
loading is done. Sim tensors themselves are saved as a CPU copy plus their device (SimTensor's
``__reduce_ex__``), the way PyTorch saves any storage-less PrivateUse1 tensor.

A callable ``map_location`` is called as PyTorch calls it for a CUDA checkpoint's storages: with the saved values
in a host storage and the location they were saved from (``"sim:0"``). What it returns is where the tensor lands: a
host storage (``lambda s, loc: s``) on the host, ``s.cuda()`` (a storage moved to sim, which within ``torch.load``
is that host storage, recorded) on sim.

Each host storage is copied to its sim device once per load, and every tensor built on it becomes a view of that copy
with its own offset and strides: a view and its base, or tied weights, share one storage on sim as on CUDA.
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


def _device_location(location) -> torch.device | None:
    """The sim device a restore location names (``"sim"`` is the current one), else None."""
    if not _LOCATION.fullmatch(str(location)):
        return None
    device = torch.device(location)
    return device if device.index is not None else torch.device("sim", torch.sim.current_device())


def _on_device(data: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``data`` on ``device`` as a view of its whole storage, which is copied there once per load: tensors sharing a
    storage in the file share one on the device, as a CUDA load restores one device storage per saved storage."""
    with torch._C.DisableTorchFunction():  # the device's own work, which no TorchFunctionMode (a tool) may see
        return _device_view(data, device)


def _device_view(data: torch.Tensor, device: torch.device) -> torch.Tensor:
    copies = _loading.copies
    storage = data.untyped_storage()
    if not storage.nbytes():  # every empty storage's address is 0: each empty tensor gets one of its own, as on CUDA
        return torch.empty_strided(data.size(), data.stride(), dtype=data.dtype, device=device)
    key = (storage.data_ptr(), device)
    if key not in copies:  # the host storage is kept with its copy: its address stays unique while the load runs
        host_bytes = torch.empty(0, dtype=torch.uint8).set_(storage)
        copies[key] = (storage, host_bytes.to(device))
    device_bytes = copies[key][1]
    itemsize = data.element_size()
    typed = device_bytes[:device_bytes.numel() // itemsize * itemsize].view(data.dtype)
    # detached: a tensor of its own (not an autograd view of the bytes), as torch.load's set_ onto a storage makes
    return typed.as_strided(data.size(), data.stride(), data.storage_offset()).detach()


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
    tensor's storage; PyTorch's own refuses callables for storage-less devices. Tensors it restores on sim share
    storages as they did when saved (``_on_device``)."""

    @functools.wraps(rebuild)
    def rebuild_device_tensor(data, dtype, device, requires_grad):
        map_location = torch.serialization._serialization_tls.map_location
        if not callable(map_location):
            return _on(data, dtype, torch._utils._get_restore_location(device), requires_grad)
        if not _LOCATION.fullmatch(str(device)):
            return rebuild(data, dtype, device, requires_grad)
        storage = map_location(data.untyped_storage(), str(device))
        if storage is None:  # where it was saved, as torch.load's default_restore_location
            return _on(data, dtype, device, requires_grad)
        storage = getattr(storage, "_untyped_storage", storage)  # a TypedStorage's bytes
        tensor = torch.empty(0, dtype=data.dtype, device=storage.device)
        tensor.set_(storage, data.storage_offset(), data.size(), data.stride())
        return _on(tensor, dtype, tensor.device, requires_grad)

    return rebuild_device_tensor


def _on(data, dtype, location, requires_grad):
    device = _device_location(location)
    shareable = data.layout is torch.strided and data.dtype == dtype  # a sparse tensor's storages are its parts'
    if device is not None and shareable and getattr(_loading, "copies", None) is not None:
        tensor = _on_device(data, device)
    else:  # elsewhere, or unpickled outside torch.load (multiprocessing)
        tensor = data.to(dtype=dtype, device=location)
    tensor.requires_grad = requires_grad
    return tensor


def _move(obj, pending: dict, memo: dict):
    if id(obj) in memo:
        return memo[id(obj)]
    result = obj
    if isinstance(obj, torch.Tensor):
        device = pending.get(obj.untyped_storage().data_ptr()) if obj.device.type == "cpu" else None
        if device is not None:
            result = _on_device(obj, device).requires_grad_(obj.requires_grad)
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
        outer = getattr(_loading, "pending", None), getattr(_loading, "copies", None)
        pending = _loading.pending = {}
        _loading.copies = {}
        try:
            result = load(*args, **kwargs)
            return _move(result, pending, {}) if pending else result
        finally:
            _loading.pending, _loading.copies = outer

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
