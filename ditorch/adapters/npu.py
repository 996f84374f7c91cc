"""Huawei Ascend through ``torch_npu``: the vendor's ``transfer_to_npu``, then ditorch's gap patches."""

from __future__ import annotations

from . import vendor

PACKAGE = "torch_npu"
TRANSFER = "torch_npu.contrib.transfer_to_npu"


def load():
    return vendor.load(__name__, PACKAGE, arch="ascend", ccl="hccl", device_type="npu")


def activate(backend, config, patches, forced: bool) -> None:
    vendor.activate_with_vendor_transfer(TRANSFER, backend, config, patches)
