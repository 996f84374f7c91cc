"""DeepLink DIPU through ``torch_dipu``: a PrivateUse1 backend without a transfer utility, so
ditorch's generic transfer. (Its device type is the PrivateUse1 name it registers.)"""

from __future__ import annotations

from . import vendor

PACKAGE = "torch_dipu"
CCL_SUPPORTS_AVG = False  # dicl (the vendor library under it): unverified here; SUM then divide is safe


def load():
    return vendor.load(__name__, PACKAGE, arch="dipu", ccl="dicl")


def activate(backend, config, patches, forced: bool) -> None:
    from .. import transfer

    transfer.apply(backend, config, patches)
