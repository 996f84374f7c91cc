"""OpAutoCompare's verdicts judged in batches: one wait for the device per batch of calls, not one per copy.

A call's tensors go to the host without waiting (``HostCopies`` with ``non_blocking=True``: into pinned memory, in
stream order, so each copy holds the values the op saw), and what judges the call (its reference run and
comparison, forward or backward) is queued. Once ``batch`` calls are queued, or their copies pass ``max_bytes``, or
the device memory they hold for their judging does (a reference on the device: its float64 copies and results), or
something must be known now (a call judged at once, the end of an optimizer step or of the run), ``flush()`` waits
once for every copy (``HostCopies.land``) and judges the queued calls in the order they ran, so the verdicts, and
which failure is found first, are those of judging each call at once.

A failing call whose inputs came from the cache is re-read from the device before it is said to fail (a write no
call showed leaves a cached copy stale). Re-read later, an input must still hold what the call read: a call about to
write an input a queued call took from the cache (``before_write``, from the tool's ``before()`` and the engine's
``note_writes`` for calls it does not handle) flushes the queue first. The one difference from judging each call at
once: an input that a write no call shows (a collective run from C++) changed between the call and its batch's
judging is re-read with that write, only for a call that failed on a stale cached copy.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable, Iterable

import torch

from ..core.engine import OpCall
from ..numerics.host_copies import HostCopies
from ..ops.torch_versions import STORAGE_OBJECTS_KEPT


def storage_id(t: torch.Tensor) -> Hashable | None:
    """The identity of ``t``'s storage while it lives (None for a tensor without one): its Python object's, or
    where torch makes a new object at each ``untyped_storage()`` (before 2.2), where its memory is."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # storage-less tensors: never cached
        return None
    return id(storage) if STORAGE_OBJECTS_KEPT else (storage.device, storage.data_ptr())


class VerdictQueue:
    """Jobs ``(call, judge)`` run in put order by ``run(judge, call)`` (the tool's guarded runner) after one wait for
    ``copies``' copies in flight. Thread-safe: backward hooks may run on the autograd engine's device threads."""

    def __init__(self, copies: HostCopies, run: Callable[[Callable, OpCall], object], batch: int = 64,
                 max_bytes: int = 512 << 20) -> None:
        self.batch, self.max_bytes = batch, max_bytes
        self._copies, self._run = copies, run
        self._jobs: collections.deque[tuple[OpCall, Callable]] = collections.deque()
        self._reads: set[Hashable] = set()  # storages of inputs queued calls took from the cache
        self._unlooked: list[torch.Tensor] = []  # such inputs whose storage is looked up when a write may need it
        self._held = 0  # device memory the queued calls hold for their judging
        self._rows: list = []  # small results of queued calls still on their device (``read_with``)
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._jobs)

    def put(self, call: OpCall, judge: Callable, reads: Iterable[torch.Tensor] = (), held: int = 0) -> None:
        """Queue ``judge`` for ``call``; ``reads``: its inputs that came from the cache (re-read if it fails);
        ``held``: the bytes of device memory it holds until judged (bounded by ``max_bytes`` too)."""
        with self._lock:
            self._jobs.append((call, judge))
            self._unlooked.extend(reads)
            self._held += held
            full = len(self._jobs) >= self.batch or self._copies.in_flight_bytes > self.max_bytes or \
                self._held > self.max_bytes
        if full:
            self.flush()

    def read_with(self, rows) -> None:
        """``rows`` (an object whose ``host`` is a 2-D tensor on a device: a call's statistics, ``PendingStats``) is
        brought to the host with the batch: the queued calls' rows joined on each device and copied in one transfer
        when the batch is judged, ``rows.host`` then the host's part of it."""
        with self._lock:
            self._rows.append(rows)

    def _send_rows(self) -> None:
        by_device: dict[tuple, list] = {}
        for rows in self._rows:
            by_device.setdefault((rows.host.device, rows.host.dtype, rows.host.shape[1:]), []).append(rows)
        self._rows = []
        for group in by_device.values():
            host = self._copies.send(torch.cat([rows.host for rows in group]))
            start = 0
            for rows in group:
                stop = start + rows.host.shape[0]
                rows.host, start = host[start:stop], stop

    def before_write(self, tensors: Iterable[torch.Tensor]) -> None:
        """A call is about to write ``tensors``: judge the queued calls first if one may re-read them."""
        if self._unlooked:
            with self._lock:
                self._reads.update(sid for t in self._unlooked if (sid := storage_id(t)) is not None)
                self._unlooked = []
        if self._reads and any(storage_id(t) in self._reads for t in tensors):
            self.flush()

    def flush(self) -> None:
        """Wait once for the copies in flight (also with no call queued: a call judged at once reads its own), then
        judge every queued call, in order."""
        with self._lock:
            if self._rows:
                self._send_rows()
            self._copies.land()  # the one wait (the judges' own copies are made waiting)
            while self._jobs:
                call, judge = self._jobs.popleft()
                self._run(judge, call)
            self._reads.clear()
            self._unlooked = []
            self._held = 0
