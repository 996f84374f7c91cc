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

C++ code that allocates pinned staging memory itself cannot be wrapped so: DDP's reducer, finding unused parameters
on a PrivateUse1 device, stages its map of used parameters in ``empty_like(..., pin_memory=true)`` and asserts
``is_pinned()`` (``reducer.cpp``, ``all_reduce_local_used_map``). While ``hold_staging`` is held, the CPU kernel of
``empty_strided`` (which that ``empty_like`` calls) allocates plain memory for ``pin_memory=True`` too, and
``is_pinned()`` is True for such a tensor alone. Every CPU ``empty_strided`` call then runs in Python (a few
microseconds), so sim holds it only while a DDP module that finds unused parameters lives (``ditorch/sim/ddp.py``).

>>> import torch
>>> release = hold()
>>> torch.arange(3.0).pin_memory()
tensor([0., 1., 2.])
>>> release()
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from typing import Callable

import torch


class _HeldKernels:
    """CPU kernels registered while at least one hold is kept, PyTorch's own again when the last is released."""

    def __init__(self, kernels: dict[str, Callable]) -> None:
        self.kernels = kernels
        self._library: torch.library.Library | None = None
        self._holds = 0

    def hold(self) -> Callable[[], None]:
        """Register the kernels (on the first hold); returns what releases this hold (once; later calls do nothing)."""
        with _lock:
            if self._library is None:
                self._library = torch.library.Library("aten", "IMPL")
                with warnings.catch_warnings():  # "Overriding a previously registered kernel": the CPU one, meant
                    warnings.simplefilter("ignore", UserWarning)
                    for name, kernel in self.kernels.items():
                        self._library.impl(name, kernel, "CPU")
            self._holds += 1
        released = threading.Event()

        def release() -> None:
            with _lock:
                if released.is_set():
                    return
                released.set()
                self._holds -= 1
                if self._holds == 0 and self._library is not None:
                    self._library._destroy()  # PyTorch's kernels again
                    self._library = None

        return release


_lock = threading.Lock()
_notes: list[Callable[[torch.Tensor], None]] = []  # told of each pinned copy (sim: its device counters)


def _pin_memory(self: torch.Tensor, device=None) -> torch.Tensor:
    pinned = self.clone(memory_format=torch.contiguous_format)
    for note in _notes:
        note(pinned)
    return pinned


def hold(note: Callable[[torch.Tensor], None] | None = None) -> Callable[[], None]:
    """Give dense CPU tensors the copying ``_pin_memory`` kernel until every hold is released; ``note`` is told of
    each pinned copy from now on. Returns what releases this hold (once; later calls do nothing)."""
    release = _PINNING.hold()
    with _lock:
        if note is not None and note not in _notes:
            _notes.append(note)
    return release


_staged: set[int] = set()  # data pointers of the live storages allocated as pinned


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None) -> torch.Tensor:
    dtype = dtype or torch.get_default_dtype()
    extent = 1 + sum((n - 1) * step for n, step in zip(size, stride)) if all(size) else 0
    storage = torch.UntypedStorage(extent * dtype.itemsize)
    if pin_memory:
        _staged.add(storage.data_ptr())
        weakref.finalize(storage, _staged.discard, storage.data_ptr())  # storages keep their Python object
    return torch.empty(0, dtype=dtype).set_(storage, 0, size, stride)


def _is_pinned(self: torch.Tensor, device=None) -> bool:
    return self.untyped_storage().data_ptr() in _staged


def hold_staging() -> Callable[[], None]:
    """Let C++ callers allocate pinned CPU staging tensors (see the module's doc) until every hold is released.
    Returns what releases this hold (once; later calls do nothing)."""
    return _STAGING.hold()


_PINNING = _HeldKernels({"_pin_memory": _pin_memory})
_STAGING = _HeldKernels({"empty_strided": _empty_strided, "is_pinned": _is_pinned})


def _default_device_before_2_3() -> torch.device:
    """``torch.get_default_device()``, which torch 2.3 added: before it, what ``torch.set_default_device`` set."""
    from torch.utils import _device

    return torch.device(getattr(_device, "CURRENT_DEVICE", None) or "cpu")


_default_device = getattr(torch, "get_default_device", _default_device_before_2_3)


def _on_host(device) -> bool:
    if device is None:
        return _default_device().type == "cpu"
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
