"""Which accelerator ditorch drives: a table of backends, tried in order, and the detected result.

``DITORCH_BACKEND`` forces one row. Otherwise the first row whose probe succeeds wins: an installed
vendor package, then native CUDA/ROCm, then the host. The ``sim`` row is only ever forced.

>>> import ditorch
>>> ditorch.backend.name, ditorch.backend.device_type  # doctest: +SKIP
('cpu', 'cpu')
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
import types
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Backend:
    """The detected backend: what it is called, its torch device type, and what drives it."""

    name: str
    device_type: str
    arch: str
    framework: types.ModuleType
    ccl: str | None
    device_module: types.ModuleType | None
    adapter: types.ModuleType = dataclasses.field(repr=False)

    @property
    def framework_version(self) -> str:
        return str(getattr(self.framework, "__version__", "unknown"))


@dataclasses.dataclass(frozen=True)
class BackendRow:
    name: str
    adapter: str  # module under ditorch.adapters that loads and activates it
    probe: Callable[[], bool]  # cheap: never imports the vendor package
    needs: str  # said when the row is forced but its probe fails
    detected: bool = True  # False: only DITORCH_BACKEND selects it


def _installed(package: str) -> Callable[[], bool]:
    return lambda: importlib.util.find_spec(package) is not None


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


BACKENDS: tuple[BackendRow, ...] = (
    BackendRow("npu", "npu", _installed("torch_npu"), "the package torch_npu"),
    BackendRow("mlu", "mlu", _installed("torch_mlu"), "the package torch_mlu"),
    BackendRow("dipu", "dipu", _installed("torch_dipu"), "the package torch_dipu"),
    BackendRow("musa", "musa", _installed("torch_musa"), "the package torch_musa"),
    BackendRow("cuda", "cuda", _cuda_available, "a CUDA or ROCm build of torch with a visible GPU"),
    BackendRow("sim", "sim", lambda: True, "", detected=False),
    BackendRow("cpu", "cpu", lambda: True, ""),
)


def _row(name: str) -> BackendRow:
    return next(row for row in BACKENDS if row.name == name)


def adapter_module(name: str) -> types.ModuleType:
    return importlib.import_module(f"ditorch.adapters.{_row(name).adapter}")


def detect(forced: str | None = None) -> Backend:
    """Load the backend named by ``forced`` (from DITORCH_BACKEND), or the first available one."""
    if forced is not None:
        row = _row(forced)
        if not row.probe():
            raise RuntimeError(f"DITORCH_BACKEND={forced!r}: that backend needs {row.needs}, which is not available")
        return adapter_module(row.name).load()
    for row in BACKENDS:
        if row.detected and row.probe():
            try:
                return adapter_module(row.name).load()
            except (ImportError, RuntimeError) as error:
                # A vendor package installed beside a CUDA build of torch with a GPU refuses to import (torch_npu
                # >= 2.5: "Two accelerators cannot be used at the same time"): the GPU is the accelerator, said.
                # Elsewhere the vendor's error stands: falling back to the host would run on the wrong device.
                if row.name == "cuda" or not _cuda_available():
                    raise
                logging.getLogger("ditorch").warning(
                    "ditorch: %s is installed but failed to import (%s: %s); using the CUDA GPU instead "
                    "(DITORCH_BACKEND=%s makes this an error)", row.needs.removeprefix("the package "),
                    type(error).__name__, error, row.name)
                return adapter_module("cuda").load()
    raise AssertionError("unreachable: the cpu row always matches")
