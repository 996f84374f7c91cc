"""STAND-IN for Huawei's torch_npu (see ../README.md): registers device "npu", computes nothing.

Its HF32 switches have torch_npu's documented names and defaults (`torch.npu.matmul.allow_hf32` off,
`torch.npu.conv.allow_hf32` on), as plain attributes: the real ones set CANN options.
"""

import types

import standin_device

__version__ = "0.0-standin"
standin_device.register("npu", {"get_device_capability": lambda device=None: (9, 9),
                                "matmul": types.SimpleNamespace(allow_hf32=False),
                                "conv": types.SimpleNamespace(allow_hf32=True)})
