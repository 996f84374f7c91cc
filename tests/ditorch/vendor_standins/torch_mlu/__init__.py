"""STAND-IN for Cambricon's torch_mlu (see ../README.md): registers device "mlu", computes nothing."""

import standin_device

__version__ = "0.0-standin"
standin_device.register("mlu")
