"""Moore Threads MUSA through ``torch_musa``: a PrivateUse1 backend, ditorch's generic transfer."""

from __future__ import annotations

from . import vendor

PACKAGE = "torch_musa"
CCL_SUPPORTS_AVG = False  # mccl: unverified here; SUM then divide is the safe answer


def load():
    return vendor.load(__name__, PACKAGE, arch="musa", ccl="mccl", device_type="musa")


def activate(backend, config, patches, forced: bool) -> None:
    from .. import transfer

    transfer.apply(backend, config, patches)
