"""The host as a device module, for ``torch.cuda.*`` under ``DITORCH_BACKEND=cpu``.

``torch.cpu`` answers streams and devices; this adds what CUDA-written scripts also call.
Random numbers come from the CPU default generator. The host keeps no device-memory
accounting: the memory statistics answer 0 (no device memory is in use), ``mem_get_info``
the host's free and total memory. Work is synchronous: events record the host clock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable

import torch
from torch.cpu import (  # noqa: F401 - re-exported as this device module's API
    is_available,
    synchronize,
)

from ..env import local_world_size
from ..host_rng import (  # noqa: F401 - re-exported as this device module's API
    get_rng_state,
    initial_seed,
    manual_seed,
    manual_seed_all,
    seed,
    seed_all,
    set_rng_state,
    set_rng_state_all,
)

AMP_DTYPES = [torch.bfloat16, torch.float16]


def _lazy_init() -> None:
    pass


# torch.cpu's own from torch 2.5 on; the host needs no initialisation
is_initialized: Callable[[], bool] = getattr(torch.cpu, "is_initialized", lambda: True)


def _is_in_bad_fork() -> bool:
    return False


class _Selection(threading.local):
    index = 0


_selected = _Selection()


def device_count() -> int:
    """One ordinal per local rank under torchrun (``LOCAL_WORLD_SIZE``), else 1: a CUDA script's
    ``torch.cuda.set_device(local_rank)`` runs on the host as on a node with one GPU per rank."""
    return local_world_size()


def _index(device) -> int:
    if device is None:
        return _selected.index
    index = device if isinstance(device, int) else torch.device(device).index
    if index is None:
        return _selected.index
    if not 0 <= index < device_count():
        raise RuntimeError(f"host: invalid device ordinal {index}: torch.cuda.device_count() is {device_count()} "
                           "(one per local rank under torchrun)")
    return index


def current_device() -> int:
    """The ordinal last set (0 unless set), an int as CUDA's: every tensor is on the CPU whatever it is."""
    return _selected.index


def set_device(device) -> None:
    if not (isinstance(device, int) and device < 0):  # a no-op, as torch.cuda.set_device documents (--local_rank=-1)
        _selected.index = _index(device)


class device:  # noqa: N801 - named as torch.cuda.device
    """Makes ``device``'s ordinal current for the block, as ``torch.cuda.device``; tensors stay on the CPU."""

    def __init__(self, device=None) -> None:
        self.index = None if device is None or isinstance(device, int) and device < 0 else _index(device)
        self.previous = 0

    def __enter__(self):
        self.previous = _selected.index
        if self.index is not None:
            _selected.index = self.index
        return self

    def __exit__(self, *exc) -> None:
        _selected.index = self.previous


class Stream(torch.cpu.Stream):
    """A host stream with ``torch.cuda.Stream``'s methods: work has finished when an op returns, so there
    is never anything to wait for."""

    def __init__(self, device=None, priority: int = 0, **kwargs) -> None:
        try:
            super().__init__(priority)
        except TypeError:  # an older torch's host stream takes no priority
            super().__init__()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def record_event(self, event=None):
        event = event or Event()
        event.record(self)
        return event


_streams = {"default": Stream()}


def default_stream(device=None) -> Stream:
    return _streams["default"]


def current_stream(device=None) -> Stream:
    return _streams.get("current", _streams["default"])


def set_stream(stream: Stream) -> None:
    _streams["current"] = stream


@contextlib.contextmanager
def stream(stream: Stream | None):
    """Make ``stream`` current for the block (``None``: no change)."""
    previous = current_stream()
    if stream is not None:
        set_stream(stream)
    try:
        yield
    finally:
        set_stream(previous)


def get_rng_state_all() -> list:
    return [get_rng_state()]


def _zero(device=None) -> int:
    return 0


memory_allocated = max_memory_allocated = memory_reserved = max_memory_reserved = _zero


def reset_peak_memory_stats(device=None) -> None:
    pass


reset_max_memory_allocated = reset_peak_memory_stats


def empty_cache() -> None:
    pass


def memory_stats(device=None) -> dict:
    return {}


@dataclasses.dataclass(frozen=True)
class DeviceProperties:
    name: str
    total_memory: int
    major: int
    minor: int
    multi_processor_count: int
    gcnArchName: str = ""  # noqa: N815 - CUDA's name; inductor reads it where torch.version.cuda is None


def get_device_properties(device=None) -> DeviceProperties:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 0
    return DeviceProperties("cpu", total, 0, 0, os.cpu_count() or 1)


def get_device_name(device=None) -> str:
    return "cpu"


def get_device_capability(device=None) -> tuple[int, int]:
    return (0, 0)


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def get_amp_supported_dtype() -> list:
    return list(AMP_DTYPES)


def mem_get_info(device=None) -> tuple[int, int]:
    """(free, total) bytes of host memory."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"), get_device_properties().total_memory
    except (ValueError, OSError):
        return 0, 0


def is_current_stream_capturing() -> bool:
    """The host has no graph capture."""
    return False


class Event:
    """``torch.cuda.Event`` on the host (``torch.cpu.Event`` takes no arguments and keeps no time): work has
    finished when an op returns, so an event records the host clock; ``elapsed_time`` is in milliseconds.

    >>> start, end = Event(enable_timing=True), Event(enable_timing=True)
    >>> start.record(); end.record(); start.elapsed_time(end) >= 0
    True
    """

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self._recorded_at: float | None = None

    def record(self, stream=None) -> None:  # noqa: F811 - torch.cuda.Event's keyword
        self._recorded_at = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:  # noqa: F811 - torch.cuda.Event's keyword
        pass

    def elapsed_time(self, end_event: Event) -> float:
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with enable_timing=True to measure elapsed time")
        if self._recorded_at is None or end_event._recorded_at is None:
            raise RuntimeError("Both events must be recorded before calling elapsed_time()")
        return (end_event._recorded_at - self._recorded_at) * 1000.0
