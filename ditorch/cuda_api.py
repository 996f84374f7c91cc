"""``torch.cuda.*`` answered by the backend's device module (``torch.sim``, ``torch.npu``, ...).

Every public name of ``torch.cuda`` is mapped, by one rule (``resolve``):

- *answered*: the device module has the name; its function runs, device arguments rewritten;
- *mapped*: it does not, and ``ditorch.cuda_fallbacks`` has an answer (profiling markers become
  ``torch.profiler`` ranges, ``is_current_stream_capturing()`` is False, ...);
- *refused*: neither: a stand-in raises ``NotImplementedError`` naming the API and the backend, so a
  gap fails clearly instead of reaching CUDA's C++ and dying there.

``coverage(backend)`` reports that rule for every public callable of ``torch.cuda``; the table in
``docs/device_layer.md`` is generated from it (``scripts/gen_cuda_api_docs.py``).
"""

from __future__ import annotations

import sys
import types

import torch

from .class_forwarding import forwarding_class
from .cuda_fallbacks import FALLBACKS

ANSWERED, MAPPED, REFUSED = "answered", "mapped", "refused"
# Kept as torch has them: torch.cuda.amp's classes subclass torch.amp's, which the transfer maps.
KEPT = frozenset({"amp"})
# Answered too although private: torch's own code calls them on the device module it picked.
PRIVATE = ("_lazy_init", "_is_in_bad_fork")


def missing_api_error(api: str, backend) -> NotImplementedError:
    return NotImplementedError(
        f"{api} is not available on the {backend.name} backend: {backend.device_module.__name__} "
        f"has no {api.rsplit('.', 1)[-1]} (ditorch maps torch.cuda to {backend.device_module.__name__})"
    )


def _missing_function(api: str, backend):
    def missing(*args, **kwargs):
        raise missing_api_error(api, backend)

    missing.__name__ = api.rsplit(".", 1)[-1]
    missing.__qualname__ = api
    missing._ditorch_refused = True  # type: ignore[attr-defined]  # the mark is_refused reads
    return missing


class DeviceSubmodule(types.ModuleType):
    """Stands in for a submodule of ``torch.cuda`` (``memory``, ``random``, ``nvtx``, ...): each name is
    resolved as a top-level one (the device module's, else ditorch's fallback, else refused)."""

    def __init__(self, api: str, backend, remap) -> None:
        super().__init__(api)
        self._api = api
        self._backend = backend
        self._remap = remap

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _replacement(f"{self._api}.{name}", None, self._backend, self._remap)


class _MissingClassMeta(type):
    def __call__(cls, *args, **kwargs):
        raise missing_api_error(cls._api, cls._backend)

    def __instancecheck__(cls, instance) -> bool:
        return False


def _missing_class(api: str, backend) -> type:
    return _MissingClassMeta(api.rsplit(".", 1)[-1], (), {"_api": api, "_backend": backend,
                                                          "_ditorch_refused": True})


def resolve(api: str, backend) -> tuple[str, object]:
    """How ``api`` (``"torch.cuda.memory_summary"``, ``"torch.cuda.nvtx.range_push"``) is answered on
    ``backend``: ``(ANSWERED, the device module's attribute)``, ``(MAPPED, ditorch's function)`` or
    ``(REFUSED, None)``."""
    name = api.rsplit(".", 1)[-1]
    provided = getattr(backend.device_module, name, None)
    if provided is not None:
        return ANSWERED, provided
    entry = FALLBACKS.get(name)
    answer = entry.for_backend(backend, name) if entry is not None else None
    return (MAPPED, answer) if answer is not None else (REFUSED, None)


def _replacement(api: str, current, backend, remap):
    replacement = _replacement_object(api, current, backend, remap)
    wrapped = getattr(current, "__wrapped__", None)
    if wrapped is not None and not hasattr(replacement, "__wrapped__"):
        # torch._dynamo, imported late, reads e.g. torch.cuda.use_mem_pool.__wrapped__ (a contextmanager's).
        replacement.__wrapped__ = wrapped
    return replacement


def _replacement_object(api: str, current, backend, remap):
    status, provided = resolve(api, backend)
    if isinstance(current, types.ModuleType):
        return provided if isinstance(provided, types.ModuleType) else DeviceSubmodule(api, backend, remap)
    if isinstance(provided, type):
        return forwarding_class(api.rsplit(".", 1)[-1], provided, remap.device_module_arguments(provided))
    if callable(provided):
        return remap.device_module_arguments(provided)
    return _missing_class(api, backend) if isinstance(current, type) else _missing_function(api, backend)


def is_refusal(obj) -> bool:
    """True for the stand-ins that raise ``NotImplementedError`` (a refused name)."""
    return getattr(obj, "_ditorch_refused", False) is True


def mapped_names() -> list[str]:
    """The ``torch.cuda`` attributes the mapping replaces (public API less exceptions, legacy types, data)."""
    names = []
    for name in (*torch.cuda.__all__, *PRIVATE):
        current = getattr(torch.cuda, name, None)
        if name in KEPT or current is None or name.endswith(("Tensor", "Storage")):
            continue
        if isinstance(current, type) and issubclass(current, BaseException):
            continue  # still needed by `except torch.cuda.CudaError`
        if isinstance(current, (types.ModuleType, type)) or callable(current):
            names.append(name)
    return names


def surface() -> list[str]:
    """Every public callable of ``torch.cuda`` the mapping answers, as ``"torch.cuda.<name>"``: the mapped
    top-level names (a submodule stands for the names in its ``__all__`` that are not top-level too)."""
    top = set(torch.cuda.__all__)
    apis = []
    for name in mapped_names():
        if name in PRIVATE:
            continue
        current = getattr(torch.cuda, name)
        if isinstance(current, types.ModuleType):
            module = sys.modules.get(f"torch.cuda.{name}", current)  # torch's own, even where it is mapped
            apis += [f"torch.cuda.{name}.{member}" for member in getattr(module, "__all__", ()) if member not in top]
        else:
            apis.append(f"torch.cuda.{name}")
    return apis


def coverage(backend) -> dict[str, str]:
    """``{api: ANSWERED | MAPPED | REFUSED}`` for every name of ``surface()`` on ``backend``."""
    return {api: resolve(api, backend)[0] for api in surface()}


def apply(backend, remap, patches, names=None) -> None:
    """Point ``torch.cuda.<name>`` (every mapped name, or just ``names``) at ``backend.device_module``."""
    for name in names if names is not None else mapped_names():
        current = getattr(torch.cuda, name, None)
        patches.set(torch.cuda, name, _replacement(f"torch.cuda.{name}", current, backend, remap))
