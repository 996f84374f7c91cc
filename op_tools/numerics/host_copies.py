"""Host (CPU) copies of device tensors, reused across calls only while they are proven current (``current_values``).

One op's output is usually the next op's input: the copy made to compare the output serves as the next input's
snapshot, which saves a device-to-host copy per call. OpAutoCompare re-reads the cached inputs of a call that fails
and compares again (``stale`` counts the copies found out of date that way): a write no call showed never makes a
false failure.

A copy may be made without waiting for it (``non_blocking=True``, into pinned memory where the device has events):
it is on its way to the host, and ``land()`` waits once for every copy made so since the last call. Whoever reads a
copy calls ``land()`` first.
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
        self._in_flight: set[torch.device] = set()  # devices with copies made without waiting since land()
        self.in_flight_bytes = 0

    def get(self, t: torch.Tensor, non_blocking: bool = False) -> tuple[torch.Tensor, bool]:
        """``(copy, reused)``: a CPU copy of ``t`` as it is now, outside autograd, and whether the cache had it;
        ``non_blocking``: a new copy is not waited for (``land()``)."""
        if t.is_cpu:
            return t.detach().clone(), False
        where = locate(t)
        if where is not None:
            found = self._values.find(where)
            if found is not None:
                return found, True
        return self._store(t, where, non_blocking), False

    def get_without_waiting(self, t: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """``get(t, non_blocking=True)``, the form OpAutoCompare's before() calls per argument."""
        return self.get(t, True)

    def fresh(self, t: torch.Tensor, written: bool = False, non_blocking: bool = False) -> torch.Tensor:
        """A new copy of ``t`` (an op's output, an input re-read), remembered; ``written``: the op wrote ``t``, so
        every copy of its storage (its views' too) is dropped first."""
        if t.is_cpu:
            return t.detach().clone()
        where = locate(t)
        if where is not None and written:
            self._values.drop(id(where[0]))
        return self._store(t, where, non_blocking)

    def send(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` (a tool's own values) on its way to the host, not cached: read after ``land()``."""
        copy = snapshot(t, non_blocking=True)
        self._in_flight.add(t.device)
        self.in_flight_bytes += copy.nbytes
        return copy

    def land(self) -> None:
        """Wait for the copies made without waiting: one synchronisation per device they came from (an event
        recorded after them), none when there are none."""
        while self._in_flight:
            wait_for_copies(self._in_flight.pop())
        self.in_flight_bytes = 0

    def forget(self, tensors) -> None:
        """Drop every copy of the storages of ``tensors``: a call wrote to them."""
        self._values.forget(tensors)

    def clear(self) -> None:
        self._values.clear()

    def _store(self, t: torch.Tensor, where, non_blocking: bool = False) -> torch.Tensor:
        copy = snapshot(t, non_blocking)
        if non_blocking:
            self._in_flight.add(t.device)
            self.in_flight_bytes += copy.nbytes
        self._values.put(where, copy, copy.nbytes)
        return copy


def snapshot(t: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """A CPU copy outside autograd: grad disabled (a detach would be one more device op) where it matters. A DTensor
    is copied whole (``arguments.whole``: a collective every rank makes at the same call); it is never cached, as
    it has no storage of its own (``locate``). ``non_blocking``: the copy goes into pinned memory (PyTorch pins a
    non-blocking copy's destination) and is read only after ``wait_for_copies``."""
    with grad_mode(False) if t.requires_grad else _UNCHANGED:
        return whole(t).to(device=_CPU, copy=True, non_blocking=non_blocking)


def has_events(device: torch.device) -> bool:
    """Whether the device's module has events: copies from it can be waited for after the fact."""
    return getattr(getattr(torch, device.type, None), "Event", None) is not None


def wait_for_copies(device: torch.device) -> None:
    """Wait for the work queued on ``device`` so far (its non-blocking copies): an event recorded on its current
    stream and waited for (one synchronisation)."""
    module = getattr(torch, device.type)
    event = module.Event()
    event.record(module.current_stream(device))
    event.synchronize()


_UNCHANGED = contextlib.nullcontext()


def grad_mode(enabled: bool):
    """``torch.set_grad_enabled(enabled)``, or nothing to enter where grad mode is that already (entering one
    costs microseconds, and the tool would on every call)."""
    return _UNCHANGED if torch.is_grad_enabled() == enabled else torch.set_grad_enabled(enabled)
