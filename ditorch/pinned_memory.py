"""Pinned host memory where PyTorch has no allocator for it: the sim device, and the host forced as the device.

``Tensor.pin_memory()`` asks the accelerator's hooks for a pinned-memory allocator. A backend written in Python (sim)
cannot provide one (the Python hooks of ``torch._C._acc`` do not forward ``getPinnedMemoryAllocator``: ``You should
register PrivateUse1HooksInterface ...``), and a host without an accelerator has none (``Cannot access accelerator
device when none is available``). Neither needs one: sim copies from host memory synchronously, and on the host a
tensor never leaves it. While held (``hold``), dense CPU tensors get a ``_pin_memory`` kernel that makes a contiguous
copy in the CPU allocator's plain memory, equal to the tensor: ``is_pinned()`` stays False, and ``.to(device,
non_blocking=True)`` takes the copy as it takes any tensor. The CompositeExplicitAutograd kernel stays beside it.

A factory asked for pinned memory (``torch.empty(n, pin_memory=True)``) reaches the allocator before any kernel;
the transfer makes such a tensor unpinned and pins it (``ditorch/transfer.py``, for an adapter declaring
``PINS_BY_COPY``).

>>> import torch
>>> release = hold()
>>> torch.arange(3.0).pin_memory()
tensor([0., 1., 2.])
>>> release()
"""

from __future__ import annotations

import functools
import threading
from typing import Callable

import torch

_lock = threading.Lock()
_library: torch.library.Library | None = None
_holds = 0
_notes: list[Callable[[torch.Tensor], None]] = []  # told of each pinned copy (sim: its device counters)


def _pin_memory(self: torch.Tensor, device=None) -> torch.Tensor:
    pinned = self.clone(memory_format=torch.contiguous_format)
    for note in _notes:
        note(pinned)
    return pinned


def hold(note: Callable[[torch.Tensor], None] | None = None) -> Callable[[], None]:
    """Give dense CPU tensors the copying ``_pin_memory`` kernel until every hold is released; ``note`` is told of
    each pinned copy from now on. Returns what releases this hold (once; later calls do nothing)."""
    global _library, _holds
    with _lock:
        if _library is None:
            _library = torch.library.Library("aten", "IMPL")
            _library.impl("_pin_memory", _pin_memory, "CPU")
        _holds += 1
        if note is not None and note not in _notes:
            _notes.append(note)
    released = threading.Event()

    def release() -> None:
        global _library, _holds
        with _lock:
            if released.is_set():
                return
            released.set()
            _holds -= 1
            if _holds == 0 and _library is not None:
                _library._destroy()  # pin_memory() is PyTorch's own again
                _library = None

    return release


def _on_host(device) -> bool:
    if device is None:
        return torch.get_default_device().type == "cpu"
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "cpu"


def pinned_by_copy(factory: Callable) -> Callable:
    """``factory`` (``torch.empty``, ``Tensor.new_zeros``, ...) where ``pin_memory=True`` on the host makes the tensor
    unpinned, then pins it by ``_pin_memory``'s copy; a tensor that wants a gradient still is a leaf."""

    @functools.wraps(factory)
    def with_pinned_memory(*args, **kwargs):
        if not (kwargs.get("pin_memory") and _on_host(kwargs.get("device"))):
            return factory(*args, **kwargs)
        kwargs["pin_memory"] = False
        requires_grad = kwargs.pop("requires_grad", False)
        return factory(*args, **kwargs).pin_memory().requires_grad_(requires_grad)

    return with_pinned_memory
