"""``when_imported(name, action)``: ``action(module)`` as soon as the module ``name`` has been imported, or at once if
it already is: the transfer's patches of modules too heavy for ``import ditorch`` to import itself (FSDP's take a
second where nothing imported ``torch.distributed.tensor`` before).

>>> import sys
>>> seen = []
>>> cancel = when_imported("json", lambda module: seen.append(module.__name__))  # json is imported by now
>>> seen
['json']
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from typing import Callable

Action = Callable[[object], None]
_lock = threading.Lock()


class _Watch(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path`` until its module is looked for: then it finds the module as the other finders do,
    and runs its actions, in order, when the module's code has run. One per module name."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.actions: list[Action] = []

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        with _lock:  # once, and out of the search below
            if _WATCHES.get(fullname) is not self:
                return None  # cancelled meanwhile
            del _WATCHES[fullname]
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module) -> None:
            del loader.exec_module  # the loader's own again, for a reload
            run(module)
            for action in list(self.actions):
                action(module)

        loader.exec_module = exec_module  # this module's loader: one per file
        return spec


_WATCHES: dict[str, _Watch] = {}


def when_imported(name: str, action: Action) -> Callable[[], None]:
    """Run ``action(module)`` once ``name`` is imported (now, if it is); returns what cancels a run still to come."""
    module = sys.modules.get(name)
    if module is not None:
        action(module)
        return lambda: None
    with _lock:
        watch = _WATCHES.get(name)
        if watch is None:
            watch = _WATCHES[name] = _Watch(name)
            sys.meta_path.insert(0, watch)
        watch.actions.append(action)

    def cancel() -> None:
        with _lock:
            if action in watch.actions:
                watch.actions.remove(action)
            if not watch.actions and _WATCHES.get(name) is watch:
                del _WATCHES[name]
                sys.meta_path.remove(watch)

    return cancel
