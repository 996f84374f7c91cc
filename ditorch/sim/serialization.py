"""``torch.load(..., map_location="sim")``.

A sim storage cannot exist (sim tensors keep their bytes in CPU storages), so storages mapped to
sim are restored on the host and the tensors built on them are moved to their sim device once
loading is done. Sim tensors themselves are saved as a CPU copy plus their device (SimTensor's
``__reduce_ex__``), the way PyTorch saves any storage-less PrivateUse1 tensor.
"""

from __future__ import annotations

import functools
import re
import threading

import torch

_LOCATION = re.compile(r"sim(:\d+)?")
_loading = threading.local()
_installed = False


def _restore_on_host(storage, location: str):
    if not _LOCATION.fullmatch(location):
        return None
    pending = getattr(_loading, "pending", None)
    if pending is None:
        raise RuntimeError("sim: storages mapped to the sim device must be loaded through torch.load")
    pending[storage.data_ptr()] = torch.device(location)
    return storage


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
    _installed = True
