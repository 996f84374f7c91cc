"""Pinned host memory for the sim device: ``Tensor.pin_memory()`` and ``DataLoader(pin_memory=True)``.

With a PrivateUse1 device registered, PyTorch asks that device's hooks for its pinned-memory allocator,
which a backend written in Python cannot provide (the Python hooks of ``torch._C._acc`` do not forward
``getPinnedMemoryAllocator``): without this module ``pin_memory()`` raises ``NotImplementedError: You
should register PrivateUse1HooksInterface ...``. The sim device copies from host memory synchronously,
so pinning gains nothing there: a pinned tensor is a contiguous copy in the CPU allocator's plain memory
(``is_pinned()`` stays False), and ``.to("sim", non_blocking=True)`` accepts it as it accepts any.

Known limit: a factory asked for pinned memory (``torch.empty(n, pin_memory=True)``) still raises, since
it reaches the allocator before any kernel; pin an ordinary tensor instead.
"""

from __future__ import annotations

import torch

from .device_counters import note_pinned


def _pin_memory(self: torch.Tensor, device=None) -> torch.Tensor:
    pinned = self.clone(memory_format=torch.contiguous_format)
    note_pinned(pinned)  # a non-blocking copy into it does not synchronise (device_counters.py)
    return pinned


def register() -> torch.library.Library:
    """Give dense CPU tensors a ``_pin_memory`` kernel (``pin_memory()`` calls it when a tensor is not pinned)."""
    library = torch.library.Library("aten", "IMPL")
    library.impl("_pin_memory", _pin_memory, "CPU")  # beside the CompositeExplicitAutograd one: nothing overridden
    return library
