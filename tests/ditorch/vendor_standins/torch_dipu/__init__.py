"""STAND-IN for DeepLink's torch_dipu (see ../README.md), NOT the real package: computes nothing.

As the real one (deeplink.framework's dipu/torch_dipu: XPU dispatch key, no PrivateUse1 name), it registers no
PrivateUse1 device; with DIPU_MOCK_CUDA on (its default) it maps torch.cuda itself, here only the few answers the
tests read (is_available, device_count, set_device/current_device)."""

import os

import torch

__version__ = "0.0-standin"
vendor_type = "MLU"  # the real one names the chip's vendor it was built for

if os.environ.get("DIPU_MOCK_CUDA", "True").lower() not in ("0", "false", "off", "no"):
    _state = {"device": 0}
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 2
    torch.cuda.current_device = lambda: _state["device"]
    torch.cuda.set_device = lambda device: _state.update(device=torch.device(device).index or 0
                                                         if not isinstance(device, int) else device)
