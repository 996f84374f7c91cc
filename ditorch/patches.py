"""A reversible record of patches: every ``set`` (and ``on_undo``) is undone, in reverse order, by ``undo``."""

from __future__ import annotations

import threading

_ABSENT = object()
_CALL = object()  # an entry whose owner is a function that undoes something other than an attribute


class Patches:
    """Set attributes on modules and classes, remembering what was there (or that nothing was).

    >>> import types
    >>> ns = types.SimpleNamespace(x=1)
    >>> patches = Patches()
    >>> patches.set(ns, "x", 2); patches.set(ns, "y", 3)
    >>> patches.undo(); ns
    namespace(x=1)
    """

    def __init__(self) -> None:
        self._undo: list[tuple[object, str, object]] = []
        self._lock = threading.Lock()

    def set(self, owner: object, name: str, value: object) -> None:
        # vars(), not getattr: restore the raw descriptor (property, staticmethod), or delete an
        # attribute that was only inherited.
        previous = vars(owner).get(name, _ABSENT)
        with self._lock:
            self._undo.append((owner, name, previous))
        setattr(owner, name, value)

    def on_undo(self, restore) -> None:
        """Call ``restore()`` at ``undo``, in turn with the attributes: a change that is no attribute (a kernel
        registered with the dispatcher)."""
        with self._lock:
            self._undo.append((restore, "", _CALL))

    def undo(self) -> None:
        with self._lock:
            entries, self._undo = self._undo, []
        for owner, name, previous in reversed(entries):
            if previous is _CALL:
                owner()  # type: ignore[operator]  # on_undo's function
            elif previous is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)

    def __len__(self) -> int:
        return len(self._undo)
