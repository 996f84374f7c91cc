"""STAND-IN for Huawei's torch_npu (see ../README.md): registers device "npu", computes nothing.

Its HF32 switches have torch_npu's documented names and defaults (`torch.npu.matmul.allow_hf32` off,
`torch.npu.conv.allow_hf32` on), as plain attributes: the real ones set CANN options.
"""

import os
import types

import standin_device

__version__ = "0.0-standin"


def get_device_capability(device=None):
    """As torch_npu's (torch_npu/npu/__init__.py, v2.6 to master; npu/utils.py before): None, with a warning in the
    real one, unless TORCH_NPU_DEVICE_CAPABILITY ("8.0") is set."""
    value = os.environ.get("TORCH_NPU_DEVICE_CAPABILITY")
    return None if not value else tuple(int(part) for part in value.split("."))


class NPUGraph:
    """A stand-in for torch_npu's graph class, which its transfer_to_npu puts in torch.cuda.CUDAGraph."""


standin_device.register("npu", {"get_device_capability": get_device_capability, "NPUGraph": NPUGraph,
                                "matmul": types.SimpleNamespace(allow_hf32=False),
                                "conv": types.SimpleNamespace(allow_hf32=True)})
