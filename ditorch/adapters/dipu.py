"""DeepLink DIPU through ``torch_dipu``: the vendor's own CUDA mapping, nothing of ditorch's.

DIPU runs on torch's XPU dispatch key, not PrivateUse1, and on import (``DIPU_MOCK_CUDA``, on unless set false)
maps ``torch.cuda``, ``torch.device("cuda")``, ``"nccl"`` (to its ``dicl``) and tensors' devices (shown as cuda)
itself (deeplink.framework's ``dipu/torch_dipu/__init__.py``, ``dipu/device.py``). The original ditorch imported
it and patched nothing; so does this adapter: its device is what the script's ``torch.cuda`` answers. With the
mocking off, CUDA idioms reach no DIPU device, which the adapter says at import."""

from __future__ import annotations

import importlib
import logging
import os
import sys

import torch

from ..backends import Backend

PACKAGE = "torch_dipu"
CCL_SUPPORTS_AVG = False  # dicl (the vendor library under it): unverified here; SUM then divide is safe
_OFF = ("0", "false", "off", "no")


def load() -> Backend:
    framework = importlib.import_module(PACKAGE)
    arch = str(getattr(framework, "vendor_type", "dipu"))  # the chip's vendor, as the original ditorch reported
    return Backend("dipu", "cuda", arch, framework, "dicl", torch.cuda, sys.modules[__name__])


def activate(backend, config, patches, forced: bool) -> None:
    """Nothing to patch: DIPU maps CUDA itself; said where its mapping is off."""
    if os.environ.get("DIPU_MOCK_CUDA", "True").strip().lower() in _OFF:
        logging.getLogger("ditorch").warning(
            "ditorch: DIPU_MOCK_CUDA=%s: torch_dipu maps no CUDA idiom to its device, and ditorch leaves that to it: "
            "torch.cuda and device=\"cuda\" address CUDA (unset DIPU_MOCK_CUDA for DIPU's mapping)",
            os.environ["DIPU_MOCK_CUDA"])
