"""What the vendor adapters share: load a vendor package as a Backend, and patch the gaps its own
CUDA-to-device transfer leaves."""

from __future__ import annotations

import importlib
import sys

import torch

from ..backends import Backend

# torch.cuda APIs that vendor transfer utilities leave pointing at CUDA (setters they skip, CUDA-only
# features), and those ditorch has a fallback for: mapped to the device module when it has them, else to
# ditorch's fallback (ditorch/cuda_fallbacks.py), else to a clear NotImplementedError.
GAPS = (
    "set_stream", "set_device", "current_stream", "default_stream", "get_device_capability",
    "get_device_properties", "is_bf16_supported", "jiterator", "nvtx", "CUDAGraph", "graph", "graphs",
    "make_graphed_callables", "cudart", "nccl", "ExternalStream", "get_arch_list", "get_gencode_flags",
    "set_sync_debug_mode", "get_sync_debug_mode", "tunable",
)


# The gap names the last vendor transfer mapped itself where ditorch would only refuse them: left the vendor's.
VENDOR_KEPT: list[str] = []


def gap_names() -> list[str]:
    """The torch.cuda names ditorch maps after a vendor's own transfer."""
    from ..cuda_fallbacks import FALLBACKS

    return [name for name in dict.fromkeys((*GAPS, *FALLBACKS)) if hasattr(torch.cuda, name)]


def load(adapter: str, package: str, arch: str, ccl: str, device_type: str | None = None) -> Backend:
    framework = importlib.import_module(package)
    # PrivateUse1 vendors rename the key on import: the name they chose is the device type.
    device_type = device_type or torch._C._get_privateuse1_backend_name()
    module = getattr(torch, device_type, None)
    if module is None:
        raise RuntimeError(f"ditorch: {package} is installed but torch.{device_type} does not exist after importing it")
    return Backend(device_type, device_type, arch, framework, ccl, module, sys.modules[adapter])


def activate_with_vendor_transfer(transfer_module: str, backend, config, patches) -> None:
    """Import the vendor's transfer (it patches on import, for good), then ours for the gaps. A name the vendor's
    transfer mapped itself to something ditorch would only refuse stays the vendor's (``torch.cuda.CUDAGraph``,
    which ``transfer_to_npu`` sets to ``torch.npu.NPUGraph``: ditorch's refusal replaced a working class)."""
    from .. import cuda_api, distributed_adapters, transfer

    before = {name: getattr(torch.cuda, name, None) for name in gap_names()}
    importlib.import_module(transfer_module)
    remap = transfer.DeviceMap(backend.device_type, backend.device_module)
    names = [name for name, original in before.items()
             if getattr(torch.cuda, name, None) is original
             or cuda_api.resolve(f"torch.cuda.{name}", backend)[0] != cuda_api.REFUSED]
    VENDOR_KEPT[:] = [name for name in before if name not in names]
    cuda_api.apply(backend, remap, patches, names=names)
    distributed_adapters.apply(backend, patches)  # AVG and float32 reductions where the library lacks them
    if config.show_device_as_cuda:
        from .. import show_as_cuda

        show_as_cuda.apply(backend, patches)
