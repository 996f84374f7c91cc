"""``DITORCH_SHOW_DEVICE_AS_CUDA=1``: tensors on the backend's device report ``cuda`` from Python.

Only the ``Tensor.device`` property is replaced (a dict lookup per read); no ``__torch_function__``
mode is pushed, so ops pay nothing. C++ still sees the real device, and the transfer maps every
``cuda`` that Python code hands back (``torch.ones(2, device=t.device)``) to the real one again.
"""

from __future__ import annotations

import torch

_device_getter = (getattr(torch._C, "TensorBase", None) or torch._C._TensorBase).device.__get__  # _TensorBase < 2.3
_modes_on = torch._C._is_torch_function_mode_enabled
_no_torch_function = torch._C.DisableTorchFunction


def apply(backend, patches) -> None:
    # The bare getter: under a mode it comes back through this property, and what it shows, shows as itself.
    real_device = _device_getter
    target = backend.device_type
    count = backend.device_module.device_count()
    # Keyed by the real device: one C-level lookup per read, devices elsewhere pass through.
    shown = {torch.device(target, i): torch.device("cuda", i) for i in range(count)}

    def device(self):
        real = real_device(self)
        return shown.get(real, real)

    if target == "cpu":
        # The host has one device and CUDA scripts select an ordinal per rank (set_device(local_rank)): a host
        # tensor shows as the ordinal selected, so `t.device == torch.device("cuda", local_rank)` holds.
        current, cpu = backend.device_module.current_device, torch.device("cpu")
        as_cuda = [torch.device("cuda", i) for i in range(backend.device_module.device_count())]

        def device(self):
            real = real_device(self)
            return as_cuda[current()] if real == cpu else real

    shown_as_cuda = device
    # set while torch.compile traces (dynamo, AOTAutograd); try_get from torch 2.2, get before
    tracing = getattr(torch._guards.TracingContext, "try_get", None) or torch._guards.TracingContext.get

    def device(self):  # type: ignore[no-redef]  # noqa: F811 - the shown device, less while torch.compile traces
        # Dynamo makes its fake tensors on `t.device`: a fake "cuda" tensor would send ops to a device this
        # torch may not have. While it traces, tensors show where they really are.
        return shown_as_cuda(self) if tracing() is None else real_device(self)

    patches.set(torch.Tensor, "device", property(device, doc=f"The tensor's device; {target} shows as cuda."))


def real_device(tensor: torch.Tensor) -> torch.device:
    """The device a tensor is really on, whatever ``tensor.device`` shows, also under a ``TorchFunctionMode``."""
    if _modes_on():  # the C getter would hand a mode the patched Tensor.device property, which shows cuda
        with _no_torch_function():
            return _device_getter(tensor)
    return _device_getter(tensor)
