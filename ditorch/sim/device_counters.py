"""What a real device charges the host, counted on sim: host synchronisations, copies each way, kernel launches.

Sim's "device" is host memory, so a copy to the host or a synchronisation costs it nothing, and a tool that copies
and synchronises per call looks affordable on sim while on a GPU it costs ten times its work. The counts make that
cost visible on any machine, exactly (counts do not move with the machine's load, times do):

- ``synchronizations``: every call after which the host has waited for the device, as CUDA's would
  (``torch.cuda.set_sync_debug_mode`` flags the same ones): ``item()``/``tolist()``/``bool()``, a blocking copy
  either way (PyTorch synchronises the stream after a copy without ``non_blocking``, and after one to pageable host
  memory), ops whose output size depends on the data (``nonzero``, boolean indexing, ``unique``...),
  ``synchronize()`` of the device, a stream or an event;
- ``device_to_host_bytes`` / ``host_to_device_bytes`` and the number of such copies;
- ``kernel_launches``: ops that run device work (views, allocations and host-device copies are not kernels).

A copy to the host with ``non_blocking=True`` does not synchronise when its destination is pinned: the result of
``.to("cpu", non_blocking=True)`` (PyTorch pins it) or of ``pin_memory()``. Reading it is then the caller's business:
an event's ``query()`` (no synchronisation) or ``synchronize()`` (one).

Per process, for every thread, always on (a few hundred nanoseconds per op, against sim's 30-50 µs):

>>> before = torch.sim.device_counts()                  # doctest: +SKIP
>>> (torch.ones(4, device="sim") * 2).sum().item()      # doctest: +SKIP
>>> torch.sim.device_counts() - before                  # doctest: +SKIP
DeviceCounts(synchronizations=1, device_to_host_bytes=4, ..., kernel_launches=3)
"""

from __future__ import annotations

import dataclasses
import threading
import weakref

import torch

from . import async_completion


@dataclasses.dataclass(frozen=True)
class DeviceCounts:
    """A snapshot of the counters (``torch.sim.device_counts()``); ``a - b`` is what happened between two."""

    synchronizations: int = 0
    device_to_host_copies: int = 0
    device_to_host_bytes: int = 0
    host_to_device_copies: int = 0
    host_to_device_bytes: int = 0
    kernel_launches: int = 0

    def __sub__(self, other: DeviceCounts) -> DeviceCounts:
        return DeviceCounts(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def per(self, n: int) -> dict[str, float]:
        """Each count divided by ``n`` (steps, calls): what the benchmarks print."""
        return {field: value / n for field, value in dataclasses.asdict(self).items()}


class _Counters:
    """One list of counts per thread (autograd's device thread counts too): no lock on the per-op path, where a lock
    shared with the device thread convoyed both behind the GIL (125 µs an op in backward)."""

    _SIZE = len(dataclasses.fields(DeviceCounts))

    def __init__(self) -> None:
        self._local = threading.local()
        self._all: list[list[int]] = []  # every thread's list (a list's append is atomic)

    def _mine(self) -> list[int]:
        values = getattr(self._local, "values", None)
        if values is None:
            values = self._local.values = [0] * self._SIZE
            self._all.append(values)
        return values

    def add(self, synchronizations: int = 0, d2h_bytes: int = -1, h2d_bytes: int = -1, launches: int = 0) -> None:
        values = self._mine()
        values[0] += synchronizations
        if d2h_bytes >= 0:
            values[1] += 1
            values[2] += d2h_bytes
        if h2d_bytes >= 0:
            values[3] += 1
            values[4] += h2d_bytes
        values[5] += launches

    @property
    def launches(self) -> int:
        return sum(values[5] for values in list(self._all))

    def snapshot(self) -> DeviceCounts:
        return DeviceCounts(*(sum(column) for column in zip(*list(self._all), [0] * self._SIZE)))

    def reset(self) -> None:
        for values in list(self._all):
            values[:] = [0] * self._SIZE


COUNTERS = _Counters()


def device_counts() -> DeviceCounts:
    """The counts since the process started or since ``reset_device_counts()``."""
    return COUNTERS.snapshot()


def reset_device_counts() -> None:
    COUNTERS.reset()


def count_synchronization() -> None:
    """The host waited for the device (``synchronize()`` of the device, a stream or an event)."""
    COUNTERS.add(synchronizations=1)


# --- pinned host memory: where a non-blocking copy to the host does not synchronise ---

_pinned: dict[int, weakref.ref] = {}  # storage data_ptr -> the pinned tensor (a freed one leaves a dead reference)


def note_pinned(tensor: torch.Tensor) -> None:
    key = tensor.untyped_storage().data_ptr()

    def forget(_: weakref.ref) -> None:
        _pinned.pop(key, None)

    _pinned[key] = weakref.ref(tensor, forget)


def _is_pinned(tensor: torch.Tensor) -> bool:
    ref = _pinned.get(tensor.untyped_storage().data_ptr())
    return ref is not None and ref() is not None


# --- what each op charges; run_op calls ``charge`` with the op's arguments as the caller passed them ---

def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0


def _copy_between(destination_on_sim: bool, source_on_sim: bool, nbytes: int, blocking: bool,
                  destination=None) -> bool:
    """Count a copy between host and device; False when both ends are on one side (a device kernel, or host work).
    A non-blocking copy to the host lands late where sim is asynchronous (``async_completion.py``)."""
    if destination_on_sim == source_on_sim:
        return False
    if source_on_sim:
        COUNTERS.add(synchronizations=int(blocking), d2h_bytes=nbytes)
        if not blocking and async_completion.LAG.kernels and isinstance(destination, torch.Tensor):
            async_completion.land_later(destination, COUNTERS.launches)
    else:
        COUNTERS.add(synchronizations=int(blocking), h2d_bytes=nbytes)
    return True


def _argument(args: tuple, kwargs: dict, position: int, name: str, default=None):
    if len(args) > position:
        return args[position]
    return kwargs.get(name, default)


def _copy_(is_sim, args, kwargs, out) -> bool:  # copy_(self=destination, src, non_blocking)
    destination, source = args[0], _argument(args, kwargs, 1, "src")
    non_blocking = bool(_argument(args, kwargs, 2, "non_blocking", False))
    blocking = not non_blocking or (not is_sim(destination) and not _is_pinned(destination))
    return _copy_between(is_sim(destination), is_sim(source), _nbytes(source), blocking, destination)


def _copy_from(is_sim, args, kwargs, out) -> bool:  # _copy_from(self=source, dst, non_blocking)
    source, destination = args[0], _argument(args, kwargs, 1, "dst")
    non_blocking = bool(_argument(args, kwargs, 2, "non_blocking", False))
    blocking = not non_blocking or (not is_sim(destination) and not _is_pinned(destination))
    return _copy_between(is_sim(destination), is_sim(source), _nbytes(source), blocking, destination)


def _to_copy(is_sim, args, kwargs, out) -> bool:  # _to_copy(self, *, device, non_blocking): to the host here
    device = kwargs.get("device")
    if device is None or torch.device(device).type == "sim" or not is_sim(args[0]):
        return False
    non_blocking = bool(kwargs.get("non_blocking", False))
    if non_blocking and isinstance(out, torch.Tensor):
        note_pinned(out)  # PyTorch allocates a non-blocking copy to the host in pinned memory
    return _copy_between(False, True, _nbytes(args[0]), not non_blocking, out)


def _scalar(is_sim, args, kwargs, out) -> bool:  # item(), bool(), float(): one element read back
    COUNTERS.add(synchronizations=1, d2h_bytes=_nbytes(args[0]) // max(args[0].numel(), 1))
    return True


def _data_dependent(is_sim, args, kwargs, out) -> bool:  # the output's size is read back before it is allocated
    COUNTERS.add(synchronizations=1, launches=1)
    return True


def _index(is_sim, args, kwargs, out) -> bool:  # boolean masks are turned into indices through nonzero
    indices = _argument(args, kwargs, 1, "indices", ()) or ()
    if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
        return _data_dependent(is_sim, args, kwargs, out)
    return False


def _repeat_interleave(is_sim, args, kwargs, out) -> bool:  # the output size is the repeats' sum, unless given
    if kwargs.get("output_size") is None and isinstance(args[0], torch.Tensor):
        return _data_dependent(is_sim, args, kwargs, out)
    return False


# An entry returns True when it counted the op itself; otherwise the op counts as one kernel launch.
CHARGES = {
    "aten::copy_": _copy_,
    "aten::_copy_from": _copy_from,
    "aten::_copy_from_and_resize": _copy_from,
    "aten::_to_copy": _to_copy,
    "aten::_local_scalar_dense": _scalar,
    "aten::is_nonzero": _scalar,
    "aten::equal": _scalar,
    "aten::nonzero": _data_dependent,
    "aten::masked_select": _data_dependent,
    "aten::_unique": _data_dependent,
    "aten::_unique2": _data_dependent,
    "aten::unique_dim": _data_dependent,
    "aten::unique_consecutive": _data_dependent,
    "aten::unique_dim_consecutive": _data_dependent,
    "aten::bincount": _data_dependent,
    "aten::index": _index,
    "aten::index_put_": _index,
    "aten::_index_put_impl_": _index,
    "aten::repeat_interleave": _repeat_interleave,
}

# Ops that launch no kernel: allocations and metadata. Views are known from their schema.
NO_KERNEL = frozenset({
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::new_empty_strided",
    "aten::set_", "aten::resize_", "aten::lift_fresh", "aten::is_same_size", "aten::is_set_to",
    "aten::_has_same_storage_numel", "aten::_pin_memory", "aten::is_pinned", "aten::record_stream",
})


def launches_kernel(name: str, is_view: bool) -> bool:
    return not is_view and name not in NO_KERNEL


def charge(name: str, launches: bool, is_sim, args: tuple, kwargs: dict, out) -> None:
    """Count what running the op ``name`` cost (``is_sim(x)``: whether ``x`` is a sim tensor)."""
    rule = CHARGES.get(name)
    if rule is not None and rule(is_sim, args, kwargs, out):
        return
    if launches:
        COUNTERS.add(launches=1)
        if async_completion.PENDING:
            async_completion.land_due(COUNTERS.launches)


def count_tolist(tensor: torch.Tensor) -> None:
    """``Tensor.tolist()`` of a sim tensor: the whole tensor read back, one synchronisation."""
    COUNTERS.add(synchronizations=1, d2h_bytes=_nbytes(tensor))
