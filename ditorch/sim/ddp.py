"""DDP finding unused parameters on sim (``find_unused_parameters=True``, transformers' Trainer's default for its
models, and ``static_graph=True`` on its first step).

Its reducer stages the map of used parameters through pinned host memory on a PrivateUse1 device, which PyTorch
asks the device's hooks to allocate (``getPinnedMemoryAllocator``), and the hooks a Python device registers
(``torch._C._acc.PrivateUse1Hooks``) forward only ``is_available``, ``is_built`` and ``has_primary_context``:
"You should register PrivateUse1HooksInterface". While such a DDP module lives with sim parameters,
``pinned_memory.hold_staging`` gives the reducer plain host memory marked pinned; sim copies from host memory
synchronously, so nothing else is needed.
"""

from __future__ import annotations

import functools
import weakref

from torch.nn.parallel import DistributedDataParallel

from .. import pinned_memory
from .tensor import SimTensor

_ORIGINALS = {name: DistributedDataParallel.__dict__[name] for name in ("__init__", "_set_static_graph")}
_STAGING: weakref.WeakSet = weakref.WeakSet()  # the DDP modules holding it


def _stage_while_alive(ddp: DistributedDataParallel) -> None:
    if ddp in _STAGING or not (ddp.find_unused_parameters or ddp.static_graph):
        return
    if any(isinstance(p, SimTensor) for p in ddp.module.parameters()):
        _STAGING.add(ddp)
        weakref.finalize(ddp, pinned_memory.hold_staging())


def _after(method):
    @functools.wraps(method)
    def staged(self, *args, **kwargs):
        result = method(self, *args, **kwargs)
        _stage_while_alive(self)
        return result

    staged._ditorch_sim = True
    return staged


def install() -> None:
    """Wrap ``DistributedDataParallel.__init__`` and ``_set_static_graph``. Idempotent."""
    for name, method in _ORIGINALS.items():
        if not getattr(DistributedDataParallel.__dict__[name], "_ditorch_sim", False):
            setattr(DistributedDataParallel, name, _after(method))
