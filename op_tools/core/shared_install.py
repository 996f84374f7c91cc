"""Something the started tools share, installed while at least one of them needs it: global module hooks, wrappers
in the ``torch.distributed`` namespace. The first ``acquire()`` installs it, the last ``release()`` removes it;
thread-safe, and a ``release()`` with no user left does nothing.

>>> hooks = SharedInstall(install=lambda: print("on"), remove=lambda: print("off"))
>>> hooks.acquire(); hooks.acquire(); hooks.release(); hooks.release()
on
off
"""

from __future__ import annotations

import threading
from typing import Callable


class SharedInstall:
    def __init__(self, install: Callable[[], None], remove: Callable[[], None]) -> None:
        self._install, self._remove = install, remove
        self._users = 0
        self._lock = threading.Lock()

    def in_use(self) -> bool:
        return self._users > 0

    def acquire(self) -> None:
        with self._lock:
            self._users += 1
            if self._users == 1:
                self._install()

    def release(self) -> None:
        with self._lock:
            if self._users == 0:
                return
            self._users -= 1
            if self._users == 0:
                self._remove()
