"""Host (CPU) copies of device tensors, reused across calls only while they are proven current.

One op's output is usually the next op's input: the copy made to compare the output serves as the next
input's snapshot, which saves a device-to-host copy per call. A copy is reused only when all of these hold:

- the same storage is alive (a weak reference to the tensor's storage object: a freed storage whose memory is
  reused is another object), with the same offset, sizes, strides and dtype;
- the tensor's version counter has not moved since the copy was made;
- no call seen since wrote to that storage (``forget``): the callers mark every write they know of from the
  op's schema, ``out=``, ``inplace=True`` and the ops that write without saying so (``op_tools.ops.writes``), so
  kernels that write without bumping the version counter (GradScaler's unscale, BatchNorm's running
  statistics, CUDA's ``_foreach_lerp_``) and writes through an alias with its own counter (``.data``) are seen.

Nothing in the tensor itself is touched (no attribute, no weak reference to the tensor: those would end up in
the user's checkpoints, or stop ``Module.to`` from swapping parameters). Writes no call shows (a collective
run from C++, another thread) are caught where it matters: OpAutoCompare re-reads the cached inputs of a call
that fails and compares again (``stale`` counts the copies found out of date that way).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import weakref

import torch

from ..ops.arguments import whole

_CPU = torch.device("cpu")


class HostCopies:
    """A bounded cache of CPU copies (see the module docstring for when one is reused). Thread-safe."""

    MAX_ENTRIES = 1024  # the byte bound is what limits memory; many small entries cost nothing
    MAX_BYTES = 256 << 20

    def __init__(self) -> None:
        # id(storage) -> (weak reference to the storage, {(offset, sizes, strides, dtype): (version, copy, bytes)})
        self._storages: dict[int, tuple[weakref.ref, dict]] = {}
        self._order: collections.OrderedDict[tuple, None] = collections.OrderedDict()  # (storage id, key), oldest first
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, t: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """``(copy, reused)``: a CPU copy of ``t`` as it is now, outside autograd, and whether the cache had it."""
        if t.is_cpu:
            return t.detach().clone(), False
        where = _locate(t)
        if where is not None:
            storage, key, version = where
            entry = self._storages.get(id(storage))  # a read needs no lock: one dict operation
            if entry is not None and entry[0]() is storage:
                found = entry[1].get(key)
                if found is not None and found[0] == version:
                    return found[1], True
        return self._store(t, where), False

    def fresh(self, t: torch.Tensor, written: bool = False) -> torch.Tensor:
        """A new copy of ``t`` (an op's output, an input re-read), remembered; ``written``: the op wrote ``t``, so
        every copy of its storage (its views' too) is dropped first."""
        if t.is_cpu:
            return t.detach().clone()
        where = _locate(t)
        if where is not None and written:
            self._drop(id(where[0]))
        return self._store(t, where)

    def forget(self, tensors) -> None:
        """Drop every copy of the storages of ``tensors``: a call wrote to them."""
        for t in tensors:
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError, TypeError):
                continue
            self._drop(id(storage))

    def clear(self) -> None:
        with self._lock:
            self._storages.clear()
            self._order.clear()
            self._bytes = 0

    def _drop(self, sid: int) -> None:
        with self._lock:
            entry = self._storages.pop(sid, None)
            if entry is not None:
                for key, (_, _, size) in entry[1].items():
                    self._order.pop((sid, key), None)
                    self._bytes -= size

    def _store(self, t: torch.Tensor, where) -> torch.Tensor:
        copy = snapshot(t)
        size = copy.nbytes
        if where is None or size > self.MAX_BYTES // 4:
            return copy
        storage, key, version = where
        sid = id(storage)
        with self._lock:
            entry = self._storages.get(sid)
            if entry is None or entry[0]() is not storage:
                if entry is not None:  # a dead storage's id, reused
                    for old_key, (_, _, old_size) in entry[1].items():
                        self._order.pop((sid, old_key), None)
                        self._bytes -= old_size
                entry = self._storages[sid] = (weakref.ref(storage), {})
            previous = entry[1].get(key)
            if previous is not None:
                self._bytes -= previous[2]
            entry[1][key] = (version, copy, size)
            self._order[(sid, key)] = None
            self._order.move_to_end((sid, key))
            self._bytes += size
            while len(self._order) > self.MAX_ENTRIES or self._bytes > self.MAX_BYTES:
                old_sid, old_key = self._order.popitem(last=False)[0]
                old = self._storages.get(old_sid)
                if old is not None:
                    removed = old[1].pop(old_key, None)
                    if removed is not None:
                        self._bytes -= removed[2]
                    if not old[1]:
                        del self._storages[old_sid]
        return copy


def _locate(t: torch.Tensor):
    """``(storage, (offset, sizes, strides, dtype), version)``, or None for a tensor that cannot be cached."""
    try:
        return (t.untyped_storage(), (t.storage_offset(), t.shape, t.stride(), t.dtype), t._version)
    except (RuntimeError, NotImplementedError, TypeError):  # inference tensors (no version), storage-less tensors
        return None


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
