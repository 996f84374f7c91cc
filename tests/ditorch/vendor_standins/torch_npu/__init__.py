"""STAND-IN for Huawei's torch_npu (see ../README.md): registers device "npu", computes nothing."""

import standin_device

__version__ = "0.0-standin"
standin_device.register("npu", {"get_device_capability": lambda device=None: (9, 9)})
