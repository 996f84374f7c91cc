"""The host as a device module, for ``torch.cuda.*`` under ``DITORCH_BACKEND=cpu``.

``torch.cpu`` answers streams and devices; this adds what CUDA-written scripts also call.
Random numbers come from the CPU default generator. The host keeps no device-memory
accounting: the memory statistics answer 0 (no device memory is in use).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch
from torch.cpu import (  # noqa: F401 - re-exported as this device module's API
    Event,
    Stream,
    current_device,
    current_stream,
    device_count,
    is_available,
    is_initialized,
    set_device,
    stream,
    synchronize,
)

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


def _is_in_bad_fork() -> bool:
    return False


class device(contextlib.nullcontext):  # noqa: N801 - named as torch.cuda.device
    """There is one host device: entering it changes nothing."""

    def __init__(self, device=None) -> None:
        super().__init__()


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
