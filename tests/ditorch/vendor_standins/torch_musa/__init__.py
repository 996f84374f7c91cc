"""STAND-IN for Moore Threads' torch_musa (see ../README.md): registers device "musa", computes nothing."""

import standin_device

__version__ = "0.0-standin"
standin_device.register("musa")
