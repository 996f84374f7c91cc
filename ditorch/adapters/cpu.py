"""The host. Detected when nothing else is (then nothing is patched); forced by DITORCH_BACKEND=cpu,
CUDA idioms are transferred to the CPU, the reference run to compare a device's run against."""

from __future__ import annotations

import logging
import sys

import torch

from ..backends import Backend

logger = logging.getLogger("ditorch")
CCL_SUPPORTS_AVG = False  # gloo: AVG on floating types only ("result type Float can't be cast" on integers)
# No pinned-memory allocator here, none needed: pin_memory() and pin_memory=True copy (ditorch/pinned_memory.py).
PINS_BY_COPY = True


def load() -> Backend:
    from . import host_module

    return Backend("cpu", "cpu", "cpu", torch, "gloo", host_module, sys.modules[__name__])


def activate(backend, config, patches, forced: bool) -> None:
    if not forced:
        if not config.quiet:
            logger.warning("ditorch: no accelerator found (no vendor package, no CUDA): running on the CPU, "
                           "nothing patched")
        return
    from .. import transfer

    transfer.apply(backend, config, patches)
