"""ditorch: ``import torch; import ditorch`` and a CUDA-written script runs on the detected device.

On import: read the environment (``ditorch.env``), detect the backend (``ditorch.backends``), log
one banner line (logger ``ditorch``, INFO, on stderr unless the application configured logging;
``DITORCH_QUIET=1`` silences it) and, unless ``DITORCH_DISABLE_MOCK=1``, apply the
backend's CUDA-to-device transfer. ``ditorch.deactivate()`` undoes every patch.

>>> import torch, ditorch
>>> ditorch.backend.name in ("npu", "mlu", "dipu", "musa", "cuda", "sim", "cpu")
True
"""

from __future__ import annotations

import logging
import os

from . import activation as _activation
from . import log as _log
from .backends import Backend, detect
from .env import DeviceLayerConfig, unknown_variables

__version__ = "0.1.0"
__all__ = ["Backend", "activate", "arch", "backend", "config", "deactivate", "framework", "is_active"]

config: DeviceLayerConfig = DeviceLayerConfig.from_env()
for _message in unknown_variables():  # a misspelt DITORCH_* variable would otherwise do nothing, silently
    logging.getLogger("ditorch").warning("%s", _message)
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


_log.install()
if not _activation.banner_shown:
    _activation.banner_shown = True
    if not config.quiet:
        _log.logger.info(banner())
if not config.disable_mock:
    activate()
