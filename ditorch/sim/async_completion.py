"""``DITORCH_SIM_ASYNC=<kernels>``: sim's events and non-blocking copies to the host complete late, as a GPU's do.

Sim runs each op before returning, so its events have always completed and its non-blocking copies have always
landed: code that reads a non-blocking copy to the host without waiting for an event after it reads the right
values on sim, and whatever the memory held before on a GPU. With a lag of N kernels:

- an event recorded now completes (``query()`` turns True) once N more kernels were launched, or when it, a stream or
  the device is synchronised;
- a non-blocking copy to the host lands after N more kernel launches, or at such a synchronisation, or when an
  event recorded after it is found complete; until then its destination holds NaN (integers: -1), so reading it
  early shows.

0 (the default) keeps sim synchronous. ``ditorch.sim.asynchronous(lag)`` sets it for a block.
"""

from __future__ import annotations

import threading

import torch

ENV_VAR = "DITORCH_SIM_ASYNC"


class _Lag:
    kernels = 0  # 0: synchronous


LAG = _Lag()
PENDING: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (launch count it lands at, destination, its values)
_lock = threading.Lock()


def land_later(destination: torch.Tensor, launches: int) -> None:
    """A non-blocking copy just wrote ``destination`` (host memory), ``launches`` kernels into the run (the device
    counters' count): hide its values until the copy is due."""
    with torch._C.DisableTorchFunction():
        values = destination.clone()
        destination.fill_(float("nan") if destination.is_floating_point() or destination.is_complex() else -1)
    with _lock:
        PENDING.append((launches + LAG.kernels, destination, values))


def land_due(upto: int) -> None:
    """Land the copies due by launch count ``upto``; every one with ``upto=-1``."""
    with _lock:
        due = [p for p in PENDING if upto == -1 or p[0] <= upto]
        PENDING[:] = [p for p in PENDING if not (upto == -1 or p[0] <= upto)]
    with torch._C.DisableTorchFunction():  # the device's doing, not the program's: no tool sees it
        for _, destination, values in due:
            destination.copy_(values)


class EventClock:
    """When a sim event completes: ``record`` notes the launch count it is due at. ``launches`` reads the device
    counters' kernel count (``device_counters.py``, which calls into this module: not imported here)."""

    __slots__ = ("due", "launches")

    def __init__(self, launches) -> None:
        self.due = 0
        self.launches = launches

    def record(self) -> None:
        self.due = self.launches() + LAG.kernels

    def query(self) -> bool:
        if self.launches() < self.due:
            return False
        land_due(self.due)
        return True

    def synchronize(self) -> None:
        land_due(self.due)
        self.due = 0


def synchronize_all() -> None:
    land_due(-1)
