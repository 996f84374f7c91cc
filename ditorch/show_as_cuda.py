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
    count = backend.device_module.device_count() if backend.device_type != "cpu" else 1
    # Keyed by the real device: one C-level lookup per read, devices elsewhere pass through.
    shown = {torch.device(target, i): torch.device("cuda", i) for i in range(count)}
    if target == "cpu":
        shown = {torch.device("cpu"): torch.device("cuda", 0)}

    def device(self):
        real = real_device(self)
        return shown.get(real, real)

    patches.set(torch.Tensor, "device", property(device, doc=f"The tensor's device; {target} shows as cuda."))


def real_device(tensor: torch.Tensor) -> torch.device:
    """The device a tensor is really on, whatever ``tensor.device`` shows."""
    return torch._C.TensorBase.device.__get__(tensor)
