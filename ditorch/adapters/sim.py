"""The simulated accelerator (``ditorch.sim``): a PrivateUse1 backend computing on the CPU."""

from __future__ import annotations

import sys

import torch

from ..backends import Backend


def load() -> Backend:
    from .. import sim

    sim.register()
    device_module = torch.sim  # type: ignore[attr-defined]  # set by sim.register()
    return Backend("sim", "sim", "sim", torch, "simccl", device_module, sys.modules[__name__])


def activate(backend, config, patches, forced: bool) -> None:
    from .. import transfer
    from ..sim import distributed

    distributed.register()
    transfer.apply(backend, config, patches)
GENERATOR_DEVICE = "cpu"  # the sim device draws from the CPU default generator
