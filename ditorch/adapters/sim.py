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
CCL_SUPPORTS_AVG = True  # simccl: gloo's AVG on floating types, SUM then divide on integers
CCL_ADAPTS_REDUCTIONS = True  # simccl does AVG and DITORCH_REDUCE_LOW_PRECISION_IN_FP32 itself, funcol included
# Inductor has no code generator for a Python PrivateUse1 device: torch.compile's default runs this instead
# (ditorch/compile.py). AOTAutograd's graphs run the CPU kernels behind the sim tensors.
COMPILE_FALLBACK = "aot_eager"
# No pinned-memory allocator here, none needed: pin_memory() and pin_memory=True copy (ditorch/pinned_memory.py).
PINS_BY_COPY = True
