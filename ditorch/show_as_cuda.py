"""``DITORCH_SHOW_DEVICE_AS_CUDA=1``: tensors on the backend's device report ``cuda`` from Python.

Only the ``Tensor.device`` property is replaced (a dict lookup per read); no ``__torch_function__``
mode is pushed, so ops pay nothing. C++ still sees the real device, and the transfer maps every
``cuda`` that Python code hands back (``torch.ones(2, device=t.device)``) to the real one again.
"""

from __future__ import annotations

import torch


def apply(backend, patches) -> None:
    real_device = torch._C.TensorBase.device.__get__
    target = backend.device_type
    as_cuda: dict = {}

    def device(self):
        real = real_device(self)
        if real.type != target:
            return real
        shown = as_cuda.get(real.index)
        if shown is None:
            shown = as_cuda[real.index] = torch.device("cuda", real.index)
        return shown

    patches.set(torch.Tensor, "device", property(device, doc=f"The tensor's device; {target} shows as cuda."))


def real_device(tensor: torch.Tensor) -> torch.device:
    """The device a tensor is really on, whatever ``tensor.device`` shows."""
    return torch._C.TensorBase.device.__get__(tensor)
