"""``torch.sim``: the device module of the sim device, shaped like ``torch.cuda``.

The sim device computes on the host, synchronously; its random numbers come from the CPU's
default generator, so a run on sim draws exactly the numbers the same run on CPU draws.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time

import torch

from ..host_rng import (  # noqa: F401 - re-exported: the sim device draws from the CPU generator
    get_rng_state,
    initial_seed,
    manual_seed,
    manual_seed_all,
    seed,
    seed_all,
    set_rng_state,
    set_rng_state_all,
)
from .async_completion import EventClock, synchronize_all
from .device_counters import (  # noqa: F401 - part of the device module: what a real device would charge
    COUNTERS,
    DeviceCounts,
    count_synchronization,
    device_counts,
    reset_device_counts,
)
from .tensor import MEMORY, DeviceSelection
from .tf32 import FamilySwitch, float32_reduced_precision  # noqa: F401 - part of the device module

# The sim device's own precision switches, as torch_npu has torch.npu.matmul.allow_hf32.
matmul = FamilySwitch("matmul")
conv = FamilySwitch("conv")

_AMP_DTYPES = [torch.float16, torch.bfloat16, torch.float32]  # CUDA's autocast takes float32 too


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return DeviceSelection.initialized


def _is_in_bad_fork() -> bool:
    return False


def _lazy_init() -> None:
    # PyTorch calls it before creating a tensor on the device, as it calls torch.cuda._lazy_init.
    DeviceSelection.initialized = True


def device_count() -> int:
    return DeviceSelection.count


def current_device() -> int:
    _lazy_init()
    return DeviceSelection.current()


def _index(device) -> int:
    if device is None:
        return DeviceSelection.current()
    if isinstance(device, int):
        return DeviceSelection.check(device)
    device = torch.device(device)
    if device.type != "sim":
        raise ValueError(f"sim: expected a sim device, got {device}")
    return DeviceSelection.check(device.index) if device.index is not None else DeviceSelection.current()


def _selects_none(device) -> bool:
    # torch.cuda.set_device and torch.cuda.device document a negative ordinal as a no-op: scripts pass their
    # --local_rank, -1 by default outside a launcher
    return device is None or isinstance(device, int) and device < 0


def set_device(device) -> None:
    if not _selects_none(device):
        DeviceSelection.set_current(_index(device))


class device:  # noqa: N801 - named as torch.cuda.device
    """Context manager that makes ``device`` current, and restores the previous one on exit."""

    def __init__(self, device) -> None:
        self.index = None if _selects_none(device) else _index(device)
        self.previous = None

    def __enter__(self):
        self.previous = DeviceSelection.current()
        if self.index is not None:
            DeviceSelection.set_current(self.index)
        return self

    def __exit__(self, *exc) -> None:
        DeviceSelection.set_current(self.previous)  # type: ignore[arg-type]  # set by __enter__


def synchronize(device=None) -> None:
    """Every op has finished when it returns."""
    _index(device)
    _lazy_init()
    count_synchronization()
    synchronize_all()


def get_rng_state_all() -> list:
    return [get_rng_state() for _ in range(device_count())]


# Memory statistics: real bytes of the sim device's live storages.
def memory_allocated(device=None) -> int:
    return MEMORY.allocated.get(_index(device), 0)


def max_memory_allocated(device=None) -> int:
    return MEMORY.peak.get(_index(device), 0)


memory_reserved = memory_allocated
max_memory_reserved = max_memory_allocated


def reset_peak_memory_stats(device=None) -> None:
    MEMORY.reset_peak(_index(device))


reset_max_memory_allocated = reset_peak_memory_stats


def empty_cache() -> None:
    """The sim device keeps no cache."""


def memory_stats(device=None) -> dict:
    return {
        "allocated_bytes.all.current": memory_allocated(device),
        "allocated_bytes.all.peak": max_memory_allocated(device),
        "reserved_bytes.all.current": memory_reserved(device),
        "reserved_bytes.all.peak": max_memory_reserved(device),
    }


def mem_get_info(device=None) -> tuple[int, int]:
    total = MEMORY.total
    return max(total - memory_allocated(device), 0), total


@dataclasses.dataclass(frozen=True)
class DeviceProperties:
    name: str
    total_memory: int
    major: int
    minor: int
    multi_processor_count: int
    is_integrated: bool = True


def get_device_properties(device=None) -> DeviceProperties:
    _index(device)
    return DeviceProperties("sim", MEMORY.total, 1, 0, os.cpu_count() or 1)


def get_device_name(device=None) -> str:
    return get_device_properties(device).name


def get_device_capability(device=None) -> tuple[int, int]:
    props = get_device_properties(device)
    return props.major, props.minor


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def narrow_accumulation() -> str:
    """What sim's kernels add a narrow dtype's terms in, for tools that judge by it: ``"narrow"`` with the CPU's
    kernels (its embedding backward adds bfloat16 rows in bfloat16), ``"float32"`` in a GPU's numerics
    (``ditorch.sim.numerics("gpu")``, ``DITORCH_SIM_NUMERICS=gpu``), as CUDA's kernels add them."""
    from .gpu_numerics import NUMERICS

    return "float32" if NUMERICS.mode == "gpu" else "narrow"


def get_amp_supported_dtype() -> list[torch.dtype]:
    return list(_AMP_DTYPES)


class Stream:
    """A sim stream: work is already finished when an op returns, so streams only keep order."""

    def __init__(self, device=None, priority: int = 0, **kwargs) -> None:
        self.device = torch.device("sim", _index(device))
        self.priority = priority

    def synchronize(self) -> None:
        count_synchronization()
        synchronize_all()

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def query(self) -> bool:
        return True

    def record_event(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def __eq__(self, other) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        return f"<torch.sim.Stream device={self.device}>"


_DEFAULT_STREAMS: dict[int, Stream] = {}
_CURRENT_STREAM: dict[int, Stream] = {}


def default_stream(device=None) -> Stream:
    index = _index(device)
    if index not in _DEFAULT_STREAMS:
        _DEFAULT_STREAMS[index] = Stream(index)
    return _DEFAULT_STREAMS[index]


def current_stream(device=None) -> Stream:
    index = _index(device)
    return _CURRENT_STREAM.get(index) or default_stream(index)


def set_stream(stream: Stream) -> None:
    _CURRENT_STREAM[stream.device.index] = stream


@contextlib.contextmanager
def stream(s: Stream | None):
    """Make ``s`` the current stream of its device for the block (``None`` is a no-op)."""
    if s is None:
        yield
        return
    previous = _CURRENT_STREAM.get(s.device.index)
    _CURRENT_STREAM[s.device.index] = s
    try:
        yield
    finally:
        if previous is None:
            _CURRENT_STREAM.pop(s.device.index, None)
        else:
            _CURRENT_STREAM[s.device.index] = previous


def _launches() -> int:
    return COUNTERS.launches


class Event:
    """A sim event records the host clock; ``elapsed_time`` is in milliseconds, as for CUDA. It completes at once,
    or kernels later where sim is asynchronous (``DITORCH_SIM_ASYNC``, ``async_completion.py``)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self._time: float | None = None
        self._clock = EventClock(_launches)

    def record(self, stream: Stream | None = None) -> None:
        self._time = time.perf_counter()
        self._clock.record()

    def query(self) -> bool:
        return self._clock.query()

    def synchronize(self) -> None:
        count_synchronization()
        self._clock.synchronize()

    def wait(self, stream: Stream | None = None) -> None:
        pass

    def elapsed_time(self, end: Event) -> float:
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("sim: Events must be created with enable_timing=True to measure elapsed time")
        if self._time is None or end._time is None:
            raise RuntimeError("sim: both events must be recorded before elapsed_time()")
        return (end._time - self._time) * 1000.0


# --- What PyTorch and libraries ask of torch.sim itself, beyond the core above --------------------------
# (the device layer's part: optimizers' graph-capture checks, FSDP's memory report; torch.cuda's other
# names reach sim through ditorch/cuda_api.py and its fallbacks)

def is_current_stream_capturing() -> bool:
    """The sim device has no graph capture."""
    return False


import sys  # noqa: E402 - imports of this section, kept with it

from ..cuda_fallbacks import memory_summary_of  # noqa: E402

memory_summary = memory_summary_of("sim", sys.modules[__name__])
