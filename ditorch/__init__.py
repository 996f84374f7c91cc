"""ditorch: ``import torch; import ditorch`` and a CUDA-written script runs on the detected device.

On import: read the environment (``ditorch.env``), detect the backend (``ditorch.backends``), print
one banner line (``DITORCH_QUIET=1`` silences it) and, unless ``DITORCH_DISABLE_MOCK=1``, apply the
backend's CUDA-to-device transfer. ``ditorch.deactivate()`` undoes every patch.

>>> import torch, ditorch
>>> ditorch.backend.name in ("npu", "mlu", "dipu", "musa", "cuda", "sim", "cpu")
True
"""

from __future__ import annotations

import os
import sys

from . import activation as _activation
from .backends import Backend, detect
from .env import DeviceLayerConfig

__version__ = "0.1.0"
__all__ = ["Backend", "activate", "arch", "backend", "config", "deactivate", "framework", "is_active"]

config: DeviceLayerConfig = DeviceLayerConfig.from_env()
backend: Backend = detect(config.backend)
framework = backend.framework
arch: str = backend.arch


def banner() -> str:
    return f"ditorch: {arch} {framework.__name__}:{backend.framework_version} pid: {os.getpid()}"


def activate() -> bool:
    """(Re)apply the detected backend's transfer; False if one is already active."""
    return _activation.activate(backend, config, forced=config.backend is not None)


def deactivate() -> bool:
    """Restore every attribute the transfer patched; False if nothing was active.

    >>> import ditorch
    >>> ditorch.deactivate() in (True, False)
    True
    """
    return _activation.deactivate()


def is_active() -> bool:
    """True while the transfer has attributes patched (never on native CUDA or an undetected host)."""
    return _activation.patch_count() > 0


if not _activation.banner_shown:
    _activation.banner_shown = True
    if not config.quiet:
        # stderr: stdout stays the script's own output.
        print(banner(), file=sys.stderr)
if not config.disable_mock:
    activate()
