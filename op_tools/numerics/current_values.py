"""Values derived from device tensors (a host copy, an inf/nan flag), reused across calls only while proven current.

One op's output is usually the next op's input: what a tool derived from the output (its CPU copy, its flag) serves
for the next input, which saves a copy or a pass over the tensor per call. A value is reused only when all of these
hold:

- the same storage is alive (a weak reference to the tensor's storage object: a freed storage whose memory is
  reused is another object) at the same address (``storage.resize_()``, which FSDP2 uses to free and allocate
  again its unsharded parameters, gives the same object other memory; memory given back at the same address is
  not told apart, and a verdict's re-read catches it), with the same offset, sizes, strides, dtype, and conjugate
  and negative bits;
- the tensor's version counter has not moved since the value was derived;
- no call seen since wrote to that storage (``forget``): the callers mark every write they know of from the
  op's schema, ``out=``, ``inplace=True`` and the ops that write without saying so (``op_tools.ops.writes``), so
  kernels that write without bumping the version counter (GradScaler's unscale, BatchNorm's running
  statistics, CUDA's ``_foreach_lerp_``) and writes through an alias with its own counter (``.data``) are seen.

Nothing in the tensor itself is touched (no attribute, no weak reference to the tensor: those would end up in
the user's checkpoints, or stop ``Module.to`` from swapping parameters). Writes no call shows (a collective
run from C++, another thread) are the callers' to catch where it matters: a verdict that rests on a reused value
re-reads the tensor before it is said (OpAutoCompare's failing calls, OpOverflowCheck's first overflow).
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Any

import torch

from ..ops.torch_versions import STORAGE_OBJECTS_KEPT


def _untracked(t: torch.Tensor) -> None:
    """``locate`` where torch makes a new storage object at each ``untyped_storage()`` (before 2.2): nothing tells
    that a storage is the one a value was derived from, so no value is ever reused (and no weak reference made)."""
    return None


def locate(t: torch.Tensor):
    """``(storage, (memory, offset, sizes, strides, dtype, conjugated, negated), version)``, or None for a tensor that
    cannot be tracked. A conjugate or negative view (``x.conj()``) reads the same memory as ``x`` the same way, and
    holds other values. ``memory`` is the storage's address: ``storage.resize_()`` (FSDP2 frees its unsharded
    parameters so after each use and allocates them again) gives the same storage object other memory, with no
    version bump and no call a tool sees."""
    try:
        storage = t.untyped_storage()
        # a tuple of numbers (not ``t.shape``, a tuple subclass): the collector stops tracking it
        return (storage, (storage.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.is_conj(),
                          t.is_neg()), t._version)
    except (RuntimeError, NotImplementedError, TypeError):  # inference tensors (no version), storage-less tensors
        return None


def locate_values(t: torch.Tensor):
    """``locate`` for what depends on a tensor's values in their flat order only, not on its shape (a run
    recording's statistics, an inf/nan flag): a contiguous tensor is placed as its flat view, so that a reshaped view
    of it (``view``, ``reshape``, ``flatten``, ``unsqueeze``, a gradient's ``view`` back) finds what was derived from
    the tensor. The statistics are the same numbers: every reduction behind them reads contiguous memory in its flat
    order whatever the shape."""
    try:
        if t.is_contiguous():
            storage = t.untyped_storage()
            return (storage, (storage.data_ptr(), t.storage_offset(), (t.numel(),), (1,), t.dtype, t.is_conj(),
                              t.is_neg()), t._version)
    except (RuntimeError, NotImplementedError, TypeError):  # inference tensors (no version), storage-less tensors
        return None
    return locate(t)


if not STORAGE_OBJECTS_KEPT:
    locate = locate_values = _untracked  # noqa: F811


class _StorageRef(weakref.ref):
    """A weak reference to a storage that knows the storage's ``id`` once the storage is gone."""

    __slots__ = ("sid",)
    sid: int


class CurrentValues:
    """A bounded cache of values derived from tensors, each with its size in bytes (see the module docstring for
    when one is reused): at most ``max_entries`` of them, ``max_bytes`` in all, the least recently used dropped first;
    a value larger than a quarter of ``max_bytes`` is not kept. The values of a storage freed are dropped at the next
    ``put``: a step's temporaries, freed, would otherwise hold the room of the values still to be reused (the weights,
    an optimizer's state) until they aged out. Thread-safe."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        # id(storage) -> (weak reference to the storage, {(offset, sizes, strides, dtype): (version, value, bytes)})
        self._storages: dict[int, tuple[_StorageRef, dict]] = {}
        # (storage id, key), least recently used first
        self._order: collections.OrderedDict[tuple, None] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        # references whose storage died: appended by the collector's callback (from any thread, even one inside
        # this lock: so it only appends), dropped under the lock by ``put``
        self._dead: list[_StorageRef] = []

    def find(self, where) -> Any:
        """The value kept for ``where`` (``locate``'s answer), or None where none is current; a value found is the
        most recently used."""
        storage, key, version = where
        sid = id(storage)
        entry = self._storages.get(sid)
        if entry is not None and entry[0]() is storage:
            found = entry[1].get(key)
            if found is not None and found[0] == version:
                try:  # no lock on this per-call path: one OrderedDict operation, atomic as a dict's
                    self._order.move_to_end((sid, key))
                except KeyError:  # dropped meanwhile
                    pass
                return found[1]
        return None

    def forget(self, tensors) -> None:
        """Drop every value of the storages of ``tensors``: a call wrote to them."""
        for t in tensors:
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError, TypeError):
                continue
            self.drop(id(storage))

    def clear(self) -> None:
        with self._lock:
            self._storages.clear()
            self._order.clear()
            self._bytes = 0

    def drop(self, sid: int) -> None:
        """Drop every value of the storage whose ``id`` is ``sid``."""
        with self._lock:
            self._drop(sid)

    def _drop(self, sid: int, ref: _StorageRef | None = None) -> None:
        """``drop`` under the lock; ``ref``: only if the entry is still that reference's (an ``id`` is reused)."""
        entry = self._storages.get(sid)
        if entry is None or ref is not None and entry[0] is not ref:
            return
        del self._storages[sid]
        for key, (_, _, size) in entry[1].items():
            self._order.pop((sid, key), None)
            self._bytes -= size

    def put(self, where, value, size: int = 0) -> None:
        """Keep ``value``, derived from the tensor at ``where`` as it is now (``size`` bytes)."""
        if where is None or size > self.max_bytes // 4:
            return
        storage, key, version = where
        sid = id(storage)
        with self._lock:
            while self._dead:
                ref = self._dead.pop()
                self._drop(ref.sid, ref)
            entry = self._storages.get(sid)
            if entry is None or entry[0]() is not storage:
                if entry is not None:  # a dead storage's id, reused
                    self._drop(sid)
                ref = _StorageRef(storage, self._dead.append)
                ref.sid = sid
                entry = self._storages[sid] = (ref, {})
            previous = entry[1].get(key)
            if previous is not None:
                self._bytes -= previous[2]
            entry[1][key] = (version, value, size)
            self._order[(sid, key)] = None
            self._order.move_to_end((sid, key))
            self._bytes += size
            while len(self._order) > self.max_entries or self._bytes > self.max_bytes:
                old_sid, old_key = self._order.popitem(last=False)[0]
                old = self._storages.get(old_sid)
                if old is not None:
                    removed = old[1].pop(old_key, None)
                    if removed is not None:
                        self._bytes -= removed[2]
                    if not old[1]:
                        del self._storages[old_sid]
