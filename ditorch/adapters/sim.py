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


def COMPILE_PREPARE() -> str:  # noqa: N802 - an adapter's table entry (ditorch/compile.py)
    """What torch.compile needs on sim, done at its first call (importing dynamo costs a second); what it set.

    - A DDP model's graph compiled whole (``optimize_ddp=False``). Dynamo's DDPOptimizer splits it at the gradient
      buckets and, with an AOTAutograd backend, hands each piece the previous one's output faked on its first call:
      for a tensor subclass (SimTensor) the inner CPU fake, so the next piece failed ("found at least two devices,
      sim:0 and cpu"). nanoGPT compiles its model, then wraps it in DDP. Unsplit, the numbers are the same.
    - simccl's collectives called, not traced, by compiled code (``torch.compile(DDP(model))``): see
      ``hide_from_dynamo``.
    """
    import torch._dynamo

    from ..sim import distributed

    torch._dynamo.config.optimize_ddp = False
    distributed.hide_from_dynamo()
    return "torch._dynamo.config.optimize_ddp=False"


# No pinned-memory allocator here, none needed: pin_memory() and pin_memory=True copy (ditorch/pinned_memory.py).
PINS_BY_COPY = True
