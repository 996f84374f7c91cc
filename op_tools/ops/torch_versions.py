"""What torch names differently across the versions op_tools runs on (``pyproject.toml``: 2.1 on).

Each name here is what the newest torch calls it, answered from where an older torch keeps it. Vendors' builds
(torch_npu, torch_mlu) are often a year or two behind; the test that runs every tool on any torch is
``tests/op_tools/test_tools_on_any_torch.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch import OutOfMemoryError
    from torch._C import TensorBase
    from torch.amp import GradScaler
else:
    # torch._C._TensorBase before torch 2.3
    TensorBase = getattr(torch._C, "TensorBase", None) or torch._C._TensorBase
    # torch.OutOfMemoryError from 2.5 (an alias of CUDA's, which every device's allocator raises)
    OutOfMemoryError = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    # the device-generic scaler from 2.3, which CUDA's subclasses
    GradScaler = getattr(torch.amp, "GradScaler", None) or torch.cuda.amp.GradScaler
# Whether a storage's Python object lives as long as the storage (torch 2.2 on); before, ``untyped_storage()`` makes a
# new one at each call, so neither its identity nor a weak reference to it says which storage a tensor has.
_probe = torch.empty(1)
STORAGE_OBJECTS_KEPT: bool = _probe.untyped_storage() is _probe.untyped_storage()
del _probe
# public from 2.3; torch._utils' before (it never imports dynamo)
is_compiling: Callable[[], bool] = getattr(torch.compiler, "is_compiling", None) or \
    torch._utils.is_compiling


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def _autocast_dtype_before_2_4(device_type: str) -> torch.dtype | None:
    """Before 2.4 each device type has its own functions: CUDA's are the unqualified ones, a vendor's live on its
    module (``torch.npu.is_autocast_enabled``)."""
    if device_type == "cpu":
        return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None
    if device_type == "cuda":
        return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None
    module = getattr(torch, device_type, None)
    enabled = getattr(module, "is_autocast_enabled", None) or getattr(torch, f"is_autocast_{device_type}_enabled",
                                                                       None)
    dtype = getattr(module, "get_autocast_dtype", None) or getattr(torch, f"get_autocast_{device_type}_dtype", None)
    if enabled is None or dtype is None or not enabled():
        return None
    return dtype()


# The dtype autocast casts to on a device type, or None where it is off there.
autocast_dtype: Callable[[str], torch.dtype | None] = \
    _autocast_dtype if hasattr(torch, "get_autocast_dtype") else _autocast_dtype_before_2_4
# Whether autocast is on for a device type (torch's own from 2.4: no frame added where it is hot).
autocast_enabled: Callable[[str], bool] = torch.is_autocast_enabled if hasattr(torch, "get_autocast_dtype") else \
    (lambda device_type: _autocast_dtype_before_2_4(device_type) is not None)
