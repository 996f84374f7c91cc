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
        return True


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
