"""Host (CPU) copies of device tensors, reused across calls only while they are proven current (``current_values``).

One op's output is usually the next op's input: the copy made to compare the output serves as the next input's
snapshot, which saves a device-to-host copy per call. OpAutoCompare re-reads the cached inputs of a call that fails
and compares again (``stale`` counts the copies found out of date that way): a write no call showed never makes a
false failure.
"""

from __future__ import annotations

import contextlib

import torch

from ..ops.arguments import whole
from .current_values import CurrentValues, locate

_CPU = torch.device("cpu")


class HostCopies:
    """A bounded cache of CPU copies, each reused only while proven current (``current_values``). Thread-safe."""

    MAX_ENTRIES = 1024  # the byte bound is what limits memory; many small entries cost nothing
    MAX_BYTES = 256 << 20

    def __init__(self) -> None:
        self._values = CurrentValues(self.MAX_ENTRIES, self.MAX_BYTES)

    def get(self, t: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """``(copy, reused)``: a CPU copy of ``t`` as it is now, outside autograd, and whether the cache had it."""
        if t.is_cpu:
            return t.detach().clone(), False
        where = locate(t)
        if where is not None:
            found = self._values.find(where)
            if found is not None:
                return found, True
        return self._store(t, where), False

    def fresh(self, t: torch.Tensor, written: bool = False) -> torch.Tensor:
        """A new copy of ``t`` (an op's output, an input re-read), remembered; ``written``: the op wrote ``t``, so
        every copy of its storage (its views' too) is dropped first."""
        if t.is_cpu:
            return t.detach().clone()
        where = locate(t)
        if where is not None and written:
            self._values.drop(id(where[0]))
        return self._store(t, where)

    def forget(self, tensors) -> None:
        """Drop every copy of the storages of ``tensors``: a call wrote to them."""
        self._values.forget(tensors)

    def clear(self) -> None:
        self._values.clear()

    def _store(self, t: torch.Tensor, where) -> torch.Tensor:
        copy = snapshot(t)
        self._values.put(where, copy, copy.nbytes)
        return copy


def snapshot(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy outside autograd: grad disabled (a detach would be one more device op) where it matters. A DTensor
    is copied whole (``arguments.whole``: a collective every rank makes at the same call); it is never cached, as
    it has no storage of its own (``_locate``)."""
    with grad_mode(False) if t.requires_grad else _UNCHANGED:
        return whole(t).to(device=_CPU, copy=True)


_UNCHANGED = contextlib.nullcontext()


def grad_mode(enabled: bool):
    """``torch.set_grad_enabled(enabled)``, or nothing to enter where grad mode is that already (entering one
    costs microseconds, and the tool would on every call)."""
    return _UNCHANGED if torch.is_grad_enabled() == enabled else torch.set_grad_enabled(enabled)
