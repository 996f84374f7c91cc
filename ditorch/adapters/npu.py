"""Huawei Ascend through ``torch_npu``: the vendor's ``transfer_to_npu``, then ditorch's gap patches, and
``torch.npu.float32_reduced_precision()`` (the device-math protocol) where torch_npu lacks it."""

from __future__ import annotations

import functools
import logging
import os
import threading

import torch

from . import vendor

PACKAGE = "torch_npu"
TRANSFER = "torch_npu.contrib.transfer_to_npu"
# (op family, the torch.npu namespace whose `allow_hf32` switches it, torch_npu's documented default):
# `torch.npu.matmul.allow_hf32` (off unless set) and `torch.npu.conv.allow_hf32` (on unless set; the
# same option as `torch.npu.aclnn.allow_hf32`).
# hccl's reduce ops are sum, prod, max, min (no average); not verified on hardware here. False is the safe answer:
# SUM then divide gives what AVG would.
CCL_SUPPORTS_AVG = False
HF32_SWITCHES = (("matmul", "matmul", False), ("conv", "conv", True))


def load():
    _visible_devices_from_cuda()
    return vendor.load(__name__, PACKAGE, arch="ascend", ccl="hccl", device_type="npu")


def _visible_devices_from_cuda() -> None:
    """A launcher's ``CUDA_VISIBLE_DEVICES`` as ``ASCEND_RT_VISIBLE_DEVICES`` where that is unset: torch_npu reads only
    its own (``torch_npu/npu/__init__.py``), so the CUDA mask was ignored and every rank saw every card. Set before
    torch_npu is imported (the runtime reads it when the device starts), said once."""
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    if mask is None or "ASCEND_RT_VISIBLE_DEVICES" in os.environ:
        return
    os.environ["ASCEND_RT_VISIBLE_DEVICES"] = mask
    logging.getLogger("ditorch").info("ditorch: ASCEND_RT_VISIBLE_DEVICES=%s, from CUDA_VISIBLE_DEVICES", mask)


def activate(backend, config, patches, forced: bool) -> None:
    vendor.activate_with_vendor_transfer(TRANSFER, backend, config, patches)
    module = backend.device_module
    if not hasattr(module, "float32_reduced_precision"):
        patches.set(module, "float32_reduced_precision", float32_reduced_precision_of(module))
    patches.set(torch.cuda, "get_device_capability", capability_or_ampere(torch.cuda.get_device_capability))


# What the original ditorch answered for an NPU's capability (its torch_npu adapter's mock): a CUDA script gating
# bf16 or fused attention on `get_device_capability()[0] >= 8` takes the path it takes on an A100.
ASSUMED_CAPABILITY = (8, 0)


def capability_or_ampere(get_device_capability):
    """``torch.cuda.get_device_capability`` answering ``ASSUMED_CAPABILITY`` where torch_npu answers None (it does
    unless ``TORCH_NPU_DEVICE_CAPABILITY`` is set: ``capability[0] >= 8`` raised TypeError), said once."""

    @functools.wraps(get_device_capability)
    def get_capability(device=None):
        found = get_device_capability(device)
        if found is not None:
            return found
        if not _said_capability.is_set():
            _said_capability.set()
            logging.getLogger("ditorch").info(
                "ditorch: torch_npu gives no device capability (TORCH_NPU_DEVICE_CAPABILITY unset): "
                "torch.cuda.get_device_capability() answers %s, as the original ditorch did", ASSUMED_CAPABILITY)
        return ASSUMED_CAPABILITY

    return get_capability


_said_capability = threading.Event()


def float32_reduced_precision_of(module):
    """``float32_reduced_precision()`` for the device module ``module`` (``torch.npu``)."""

    def float32_reduced_precision() -> dict[str, str]:
        """The float32 op families the NPU computes in reduced precision right now, e.g.
        ``{"matmul": "hf32", "conv": "hf32"}``, read from ``torch.npu.matmul.allow_hf32`` and
        ``torch.npu.conv.allow_hf32``; ``{}`` when both are off. A switch this torch_npu cannot read
        (old releases had setters only) counts as its documented default."""
        found = {}
        for family, namespace, default in HF32_SWITCHES:
            try:
                on = getattr(module, namespace).allow_hf32
            except AttributeError:
                on = None
            if bool(default if on is None else on):
                found[family] = "hf32"
        return found

    return float32_reduced_precision
