"""Cambricon MLU through ``torch_mlu``: the vendor's ``model_transfer``, then ditorch's gap patches."""

from __future__ import annotations

from . import vendor

PACKAGE = "torch_mlu"
TRANSFER = "torch_mlu.utils.model_transfer"
CCL_SUPPORTS_AVG = False  # cncl: sum, prod, max, min (not verified on hardware here)


def load():
    return vendor.load(__name__, PACKAGE, arch="camb", ccl="cncl", device_type="mlu")


def activate(backend, config, patches, forced: bool) -> None:
    vendor.activate_with_vendor_transfer(TRANSFER, backend, config, patches)
