"""What ``torch.cuda.<name>`` does on a backend whose device module has no ``<name>``: ditorch's own answer.

PyTorch itself calls some of these on whatever ``torch.cuda`` is (SyncBatchNorm and older optimizers ask
``torch.cuda.is_current_stream_capturing()``), and training scripts call others every step (profiling
markers, memory reports): a backend that lacks them should not end the run. Each entry says what it
answers instead, in the docs' words (``docs/device_layer.md``'s table is generated from ``FALLBACKS``).
A name with no entry here, and not in the device module, is refused with ``NotImplementedError``.

``build(backend, name)`` returns the function; ``needs`` names what it uses of the device module, and
where the module lacks one of them the name is refused instead. Device arguments reach the function
already rewritten (``"cuda:0"`` is ``"sim:0"``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
from typing import Callable

import torch

from .show_as_cuda import real_device  # what a tensor is on, whatever Tensor.device shows

logger = logging.getLogger("ditorch")


@dataclasses.dataclass(frozen=True)
class Fallback:
    build: Callable  # (backend, name) -> the function answering torch.cuda.<name>
    what: str  # what it answers, for the docs
    needs: tuple[str, ...] = ()  # the device module's names it uses

    def for_backend(self, backend, name: str):
        """The function answering ``torch.cuda.<name>`` on ``backend``, or None when its module lacks a need."""
        if any(getattr(backend.device_module, need, None) is None for need in self.needs):
            return None
        return self.build(backend, name)


FALLBACKS: dict[str, Fallback] = {}


def fallback(*names: str, what: str, needs: tuple[str, ...] = ()):
    """Register ``build`` as the answer for each of ``names``."""

    def register(build):
        for name in names:
            FALLBACKS[name] = Fallback(build, what, needs)
        return build

    return register


_noted: set = set()
_noted_lock = threading.Lock()


def note_once(backend, api: str, message: str) -> None:
    """One warning on the ``ditorch`` logger per backend and API: a degraded answer is said, not hidden."""
    with _noted_lock:
        if (backend.name, api) in _noted:
            return
        _noted.add((backend.name, api))
    logger.warning("ditorch: torch.cuda.%s on the %s backend: %s", api, backend.name, message)


def _index(module, device) -> int:
    """The ordinal that ``device`` (None, an int, ``"sim:1"``, a torch.device) designates on ``module``'s device."""
    if isinstance(device, int):
        return device
    if device is not None and torch.device(device).index is not None:
        return torch.device(device).index
    current = getattr(module, "current_device", None)
    return current() if current is not None else 0


def _constant(value):
    def build(backend, name):
        def answer(*args, **kwargs):
            return list(value) if isinstance(value, list) else value  # a list of one's own, as CUDA's

        answer.__name__ = name
        return answer

    return build


fallback("is_current_stream_capturing", what="`False`: nothing is captured on a device without graphs")(
    _constant(False))
fallback("is_tf32_supported", what="`False`: no TF32 on this device")(_constant(False))
fallback("get_arch_list", what="`[]`: no CUDA architectures")(_constant([]))
fallback("get_gencode_flags", what="`\"\"`: no CUDA architectures")(_constant(""))
fallback("ipc_collect", "reset_accumulated_memory_stats",
         what="nothing to do: no CUDA IPC memory, no accumulated allocator counters")(_constant(None))


@fallback("init", what="the device module's `_lazy_init()`")
def _init(backend, name):
    lazy_init = getattr(backend.device_module, "_lazy_init", None)

    def init() -> None:
        if lazy_init is not None:
            lazy_init()

    return init


@fallback("utilization", "temperature", "power_draw", "clock_rate",
          what="`0`, with a note on the `ditorch` logger: not measured on this device")
def _unmeasured(backend, name):
    def unmeasured(device=None) -> int:
        note_once(backend, name, "not measured on this device; answering 0")
        return 0

    unmeasured.__name__ = name
    return unmeasured


_fractions: dict = {}


@fallback("set_per_process_memory_fraction",
          what="checked as CUDA checks it and kept (`get_per_process_memory_fraction` answers it), not enforced, "
               "with a note on the `ditorch` logger")
def _set_memory_fraction(backend, name):
    def set_per_process_memory_fraction(fraction, device=None) -> None:
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if not 0 <= fraction <= 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        _fractions[(backend.name, _index(backend.device_module, device))] = fraction
        note_once(backend, name, f"the limit ({fraction}) is kept but not enforced: this device has no allocator "
                                 "limit ditorch can set")

    return set_per_process_memory_fraction


@fallback("get_per_process_memory_fraction", what="the fraction last set, else `1.0`")
def _get_memory_fraction(backend, name):
    def get_per_process_memory_fraction(device=None) -> float:
        return _fractions.get((backend.name, _index(backend.device_module, device)), 1.0)

    return get_per_process_memory_fraction


_ALIASES = {"memory_cached": "memory_reserved", "max_memory_cached": "max_memory_reserved",
            "reset_max_memory_cached": "reset_peak_memory_stats"}


def _alias(backend, name):
    return getattr(backend.device_module, _ALIASES[name])


for _old, _current in _ALIASES.items():
    fallback(_old, what=f"the device module's `{_current}` (the current name)", needs=(_current,))(_alias)


@fallback("StreamContext", what="a class whose instances enter the device module's `stream(s)`", needs=("stream",))
def _stream_context(backend, name):
    stream = backend.device_module.stream

    # A class, as CUDA's: torch._dynamo asks `isinstance(value, torch.cuda.StreamContext)` of every value.
    class StreamContext:
        """Context manager that makes ``stream`` current for the block (``None``: no change)."""

        def __init__(self, stream_) -> None:
            self.stream = stream_
            self._entered: list = []  # the device module's context managers, innermost last (re-entrant)

        def __enter__(self):
            context = stream(self.stream)
            self._entered.append(context)
            return context.__enter__()

        def __exit__(self, *exc_info):
            return self._entered.pop().__exit__(*exc_info)

    return StreamContext


@fallback("memory_stats_as_nested_dict", what="the device module's `memory_stats()`, nested at the dots",
          needs=("memory_stats",))
def _nested_stats(backend, name):
    memory_stats = backend.device_module.memory_stats

    def memory_stats_as_nested_dict(device=None) -> dict:
        nested: dict = {}
        for key, value in memory_stats(device).items():
            *path, leaf = key.split(".")
            node = nested
            for part in path:
                node = node.setdefault(part, {})
            node[leaf] = value
        return nested

    return memory_stats_as_nested_dict


_SUMMARY_ROWS = (("allocated", "memory_allocated", "max_memory_allocated"),
                 ("reserved", "memory_reserved", "max_memory_reserved"))


@fallback("memory_summary", what="a short table from the device module's memory statistics")
def _memory_summary(backend, name):
    return memory_summary_of(backend.name, backend.device_module)


def memory_summary_of(device_name: str, module) -> Callable:
    """``memory_summary(device=None, abbreviated=False)`` made of ``module``'s memory statistics."""

    def memory_summary(device=None, abbreviated: bool = False) -> str:
        index = _index(module, device)
        where = f"{device_name}:{index}" if isinstance(index, int) else device_name
        lines = [f"ditorch: memory of {where} (from {module.__name__}; "
                 "CUDA's allocator details do not apply)",
                 f"{'':<16}{'current':>16}{'peak':>16}"]
        for label, current, peak in _SUMMARY_ROWS:
            values = [getattr(module, fn, None) for fn in (current, peak)]
            cells = [f"{fn(index):>16,}" if fn is not None else f"{'not kept':>16}" for fn in values]
            lines.append(f"{label + ' bytes':<16}{''.join(cells)}")
        return "\n".join(lines) + "\n"

    return memory_summary


@fallback("device_of", what="a subclass of the device module's `device`, for the tensor's ordinal",
          needs=("device",))
def _device_of(backend, name):
    device = backend.device_module.device
    on_device, indexed = backend.device_type, backend.device_type != "cpu"

    # A class, as CUDA's (a subclass of `device`): a class stays a class for isinstance checks.
    class device_of(device):  # noqa: N801 - named as torch.cuda.device_of
        """Context manager that makes the device of tensor ``obj`` current (not on this device: no change)."""

        def __init__(self, obj) -> None:
            ours = isinstance(obj, torch.Tensor) and real_device(obj).type == on_device
            super().__init__(obj.get_device() if ours and indexed else None)

    return device_of


# Profiling markers: ranges in torch.profiler's trace (record_function), the nearest thing a device
# without NVTX has; never an error.
class _Ranges(threading.local):
    def __init__(self) -> None:
        self.stack: list = []


_ranges = _Ranges()
_started: dict = {}  # range_start ids -> open record_function (range_end may come from another thread)
_ids = itertools.count(1)


def range_push(msg: str) -> int:
    """Open a range (as ``record_function(msg)``); the depth of the range opened, from 0."""
    marker = torch.autograd.profiler.record_function(msg)
    marker.__enter__()
    _ranges.stack.append(marker)
    return len(_ranges.stack) - 1


def range_pop() -> int:
    """Close this thread's innermost range; the depth of the range closed, or -1 when none is open."""
    if not _ranges.stack:
        return -1
    _ranges.stack.pop().__exit__(None, None, None)
    return len(_ranges.stack)


def range_start(msg: str) -> int:
    marker = torch.autograd.profiler.record_function(msg)
    marker.__enter__()
    range_id = next(_ids)
    _started[range_id] = marker
    return range_id


def range_end(range_id: int) -> None:
    marker = _started.pop(range_id, None)
    if marker is not None:
        marker.__exit__(None, None, None)


def mark(msg: str) -> None:
    with torch.autograd.profiler.record_function(msg):
        pass


@contextlib.contextmanager
def range(msg: str, *args, **kwargs):  # torch.cuda.nvtx.range
    range_push(msg.format(*args, **kwargs))
    try:
        yield
    finally:
        range_pop()


_NVTX = {f.__name__: f for f in (range_push, range_pop, range_start, range_end, mark, range)}


@fallback(*_NVTX, what="a `torch.profiler` range (`record_function`): shows in profiler traces, never fails")
def _nvtx(backend, name):
    return _NVTX[name]
