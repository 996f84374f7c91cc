"""Process-wide state of the transfer: at most one activation at a time, undone by ``deactivate``.

Kept apart from ``ditorch/__init__.py`` so that re-executing the package (``importlib.reload``)
finds the activation already there instead of patching twice.
"""

from __future__ import annotations

import threading

from .patches import Patches

_lock = threading.Lock()
_active: tuple[object, Patches] | None = None
banner_shown = False


def activate(backend, config, forced: bool) -> bool:
    """Apply ``backend``'s adapter; False (and nothing done) when an activation is already in place."""
    global _active
    with _lock:
        if _active is not None:
            return False
        patches = Patches()
        try:
            backend.adapter.activate(backend, config, patches, forced)
        except BaseException:
            patches.undo()
            raise
        _active = (backend, patches)
        _streams_known_to_dynamo()
        return True


def _streams_known_to_dynamo() -> None:
    """torch 2.2 to 2.5's dynamo asserts, when it first loads (an optimizer's constructor loads it), that
    ``torch.cuda.Event`` and ``Stream`` derive from ``torch._streambase``'s bases: the classes the transfer put there
    (the backend's) are registered as their virtual subclasses (``abc``), which changes nothing else."""
    try:
        from torch._streambase import _EventBase, _StreamBase
    except ImportError:  # a torch without them
        return
    import torch

    for name, base in (("Event", _EventBase), ("Stream", _StreamBase)):
        cls, register = getattr(torch.cuda, name, None), getattr(base, "register", None)
        if register is not None and isinstance(cls, type) and not issubclass(cls, base):  # an ABC before 2.6
            register(cls)


def deactivate() -> bool:
    """Restore every patched attribute; False when nothing was active."""
    global _active
    with _lock:
        if _active is None:
            return False
        _, patches = _active
        _active = None
    patches.undo()
    return True


def active_backend():
    """The backend whose transfer is in place, or None."""
    current = _active
    return current[0] if current is not None else None


def patch_count() -> int:
    current = _active
    return len(current[1]) if current is not None else 0
