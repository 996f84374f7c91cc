"""``param.data = param.to("sim")``: moving a host tensor to sim by assigning ``.data``.

FSDP1 (``device_id=``), FSDP2 (``fully_shard`` of a module still on the host) and many libraries move parameters so.
PyTorch's ``set_data`` refuses it between a CPU tensor and a sim tensor, whose dispatch keys differ (a Python
device's tensor is a wrapper subclass), with "incompatible tensor type". Sim moves such a tensor as ``Module.to``
already moves its parameters (they are traceable wrapper subclasses): ``torch.utils.swap_tensors`` with a tensor of
the new value, so the same Python object (a Parameter stays a Parameter, its attributes kept) holds the new data.
Assignments PyTorch accepts are PyTorch's own; a sim tensor's own ``.data`` is SimTensor's (it refuses a host value,
by name).
"""

from __future__ import annotations

from typing import Any

import torch

from .tensor import SimTensor

_data: Any = torch._C.TensorBase.__dict__["data"]  # the C getset descriptor
_compatible = torch._has_compatible_shallow_copy_type


def _set_data(self, value) -> None:
    if not isinstance(value, SimTensor) or _compatible(self, value):
        _data.__set__(self, value)
        return
    with torch.no_grad():
        replacement = value.detach()
    if isinstance(self, torch.nn.Parameter):
        replacement = torch.nn.Parameter(replacement, requires_grad=self.requires_grad)
    else:
        replacement.requires_grad_(self.requires_grad)
    for name, attribute in self.__dict__.items():  # the caller's marks on the tensor (FSDP's, a library's)
        replacement.__dict__.setdefault(name, attribute)
    torch.utils.swap_tensors(self, replacement)


def install() -> None:
    """Let ``.data`` assignments move a host tensor to sim. Idempotent."""
    if not isinstance(torch.Tensor.__dict__.get("data"), property):
        torch.Tensor.data = property(_data.__get__, _set_data, doc=_data.__doc__)  # type: ignore[assignment]
