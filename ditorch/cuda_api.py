"""``torch.cuda.*`` answered by the backend's device module (``torch.sim``, ``torch.npu``, ...).

Every public name of ``torch.cuda`` is mapped: to the device module's attribute of the same
name when it has one (device arguments rewritten), else to a stand-in that raises
``NotImplementedError`` naming the API and the backend, so a gap fails clearly instead of
reaching CUDA's C++ and dying there.
"""

from __future__ import annotations

import types

import torch

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
    return missing


class DeviceSubmodule(types.ModuleType):
    """Stands in for a submodule of ``torch.cuda`` (``memory``, ``random``, ``jiterator``, ...): a name the
    device module has is answered by it, any other raises on use."""

    def __init__(self, api: str, backend, remap) -> None:
        super().__init__(api)
        self._api = api
        self._backend = backend
        self._remap = remap

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _replacement_for(f"{self._api}.{name}", None, getattr(self._backend.device_module, name, None),
                                self._backend, self._remap)


class _MissingClassMeta(type):
    def __call__(cls, *args, **kwargs):
        raise missing_api_error(cls._api, cls._backend)

    def __instancecheck__(cls, instance) -> bool:
        return False


def _missing_class(api: str, backend) -> type:
    return _MissingClassMeta(api.rsplit(".", 1)[-1], (), {"_api": api, "_backend": backend})


def _replacement_for(api: str, current, provided, backend, remap):
    if isinstance(current, types.ModuleType):
        return provided if isinstance(provided, types.ModuleType) else DeviceSubmodule(api, backend, remap)
    if isinstance(current, type) or (current is None and isinstance(provided, type)):
        if isinstance(provided, type):
            from .transfer import forwarding_class

            return forwarding_class(api.rsplit(".", 1)[-1], provided, remap.device_anywhere(provided))
        return _missing_class(api, backend)
    if callable(provided):
        return remap.device_anywhere(provided)
    return _missing_function(api, backend)


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


def apply(backend, remap, patches, names=None) -> None:
    """Point ``torch.cuda.<name>`` (every mapped name, or just ``names``) at ``backend.device_module``."""
    module = backend.device_module
    for name in names if names is not None else mapped_names():
        current = getattr(torch.cuda, name, None)
        provided = getattr(module, name, None)
        patches.set(torch.cuda, name, _replacement_for(f"torch.cuda.{name}", current, provided, backend, remap))
