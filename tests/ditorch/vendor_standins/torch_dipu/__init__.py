"""STAND-IN for DeepLink's torch_dipu (see ../README.md): registers device "dipu", computes nothing."""

import standin_device

__version__ = "0.0-standin"
standin_device.register("dipu")
