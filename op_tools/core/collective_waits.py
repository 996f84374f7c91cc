"""An asynchronous collective checked when the program waits for it.

``dist.all_reduce(t, async_op=True)`` returns a ``Work`` at once: what ``t`` receives is there only once the program
waits for it (``work.wait()``; on a GPU the program's stream then waits for the collective's). A check at the call
would read what was there before it: a silent pass, or a false failure. So a tool hands the program a ``WaitedWork``
in its place (``OpTool.check_when_waited``, ``WaitedChecks.defer``): a ``dist.Work`` that passes every method on to
the collective's, and whose first ``wait()`` (or ``synchronize()``, ``block_current_stream()``, after which the tool
waits for the result too: they make a GPU stream wait, and return at once on gloo and sim) runs the tool's check once
the real one has returned, on the program's thread, where the program would read the result next. The checks of
a tool run in the order of their calls (a wait first runs those of earlier collectives still open, waiting for their
Works too): the same order on every rank, for checks that exchange data among the ranks.

A Work the program uses otherwise before waiting for it (its future, ``result()``, ``boxed()``, or
``is_completed()`` answering True) lets the program read the result at a moment the tool never sees: that collective
is given up, and said not checked with why; so is one still open when the tool stops, or whose Work was dropped
before it was waited for.

>>> work = dist.all_reduce(t, async_op=True)   # doctest: +SKIP
>>> type(work).__name__, isinstance(work, dist.Work)
('WaitedWork', True)
>>> work.wait()                                # then the tool checks what t received
True
"""

from __future__ import annotations

import collections
import itertools
import threading
import weakref
from typing import Any, Callable

import torch
import torch.distributed

_keys = itertools.count()
# Why a collective was given up, per way the program used its Work before waiting for it
GIVEN_UP = {"get_future": "waited for through its future", "get_future_result": "waited for through its future",
            "result": "its result read without a wait", "boxed": "its Work handed to C++ (boxed)",
            "is_completed": "seen complete through is_completed() instead of a wait"}
NOT_WAITED = "not waited for while the tool ran"
DROPPED = "its Work dropped before it was waited for"


# What an asynchronous collective returns (none on a torch built without torch.distributed); torch imports the module
_WORK_TYPES: tuple = (torch.distributed.Work,) if torch.distributed.is_available() else ()


def is_work(value: Any) -> bool:
    """Whether ``value`` is a collective's ``Work`` (what an asynchronous one returns): a check per call."""
    return isinstance(value, _WORK_TYPES)


class WaitedCheck:
    """One collective's check, open until the program waits for its Work or its owner gives it up."""

    __slots__ = ("key", "owner", "call", "check", "work", "__weakref__")

    def __init__(self, owner: WaitedChecks, call: Any, check: Callable, work: Any) -> None:
        self.key = next(_keys)
        self.owner, self.call, self.work = owner, call, work
        self.check: Callable | None = check  # None once run or given up: nothing held past it

    def run(self) -> None:
        self.owner.run_up_to(self)

    def give_up(self, why: str) -> None:
        self.owner.give_up(self, why)


class WaitedChecks:
    """A tool's asynchronous collectives whose checks wait for the program's waits, in call order, and those given
    up, counted per why. ``run(check, call)`` runs a check as the tool's guarded work."""

    def __init__(self, run: Callable[[Callable, Any], None]) -> None:
        self._run = run
        self._open: dict[int, WaitedCheck] = {}
        self._lock = threading.Lock()
        self.given_up: collections.Counter = collections.Counter()
        self._first: dict[str, str] = {}  # why -> the first op given up so

    def defer(self, call: Any, check: Callable, work: Any) -> Any:
        """What the program gets in place of ``work`` (the result of the collective ``call``): a Work whose first
        wait runs ``check(call)``; ``work`` itself, counted given up, when it is no Work."""
        waited = WaitedCheck(self, call, check, work)
        if not is_work(work):
            self._count(call.name, f"it returned {type(work).__name__}, no Work to wait for")
            return work
        with self._lock:
            self._open[waited.key] = waited
        wrapper = _waited_work_class()(work, waited)
        weakref.finalize(wrapper, waited.give_up, DROPPED)  # a no-op once the check ran or was given up
        return wrapper

    def run_up_to(self, waited: WaitedCheck) -> None:
        """After the program's wait for ``waited``'s collective: the checks still open up to it, in call order (the
        same on every rank), the earlier ones' Works waited for first."""
        with self._lock:
            if waited.key not in self._open:  # run or given up already
                return
            due = []
            for key in list(self._open):
                due.append(self._open.pop(key))
                if key == waited.key:
                    break
        for check in due:
            if check is not waited:
                try:
                    check.work.wait()
                except Exception as error:
                    self._count(check.call.name, f"its wait raised {type(error).__name__}")
                    continue
            run, check.work, check.check = check.check, None, None
            if run is not None:
                self._run(run, check.call)

    def give_up(self, waited: WaitedCheck, why: str) -> None:
        with self._lock:
            if self._open.pop(waited.key, None) is None:
                return
        waited.work = waited.check = None
        self._count(waited.call.name, why)

    def give_up_all(self, why: str) -> None:
        with self._lock:
            still_open = list(self._open.values())
        for waited in still_open:
            waited.give_up(why)

    def not_checked(self) -> int:
        """Collectives whose check has not run: not waited for yet, or given up."""
        with self._lock:
            return len(self._open) + sum(self.given_up.values())

    def parts(self) -> list[str]:
        """What the verdict says of them: those open, and those given up per why."""
        with self._lock:
            waiting, given_up, first = len(self._open), dict(self.given_up), dict(self._first)
        parts = [f"{waiting} asynchronous collective{'s' if waiting != 1 else ''} not waited for yet (each checked "
                 "when the program waits for it)"] if waiting else []
        return parts + [f"{n} asynchronous collective{'s' if n != 1 else ''} not checked ({why}), the first "
                        f"{first[why]}" for why, n in given_up.items()]

    def _count(self, name: str, why: str) -> None:
        with self._lock:
            self.given_up[why] += 1
            self._first.setdefault(why, name)


_wrapper_class: type | None = None


def _waited_work_class() -> type:
    global _wrapper_class
    if _wrapper_class is None:  # torch.distributed is imported by then: the program ran a collective
        _wrapper_class = _define_waited_work()
    return _wrapper_class


def _define_waited_work() -> type:
    import torch.distributed as dist

    class WaitedWork(dist.Work):
        """A collective's ``Work``: every method is the collective's own; the first wait also runs a tool's check."""

        def __init__(self, work, check: WaitedCheck) -> None:
            super().__init__()
            self._work, self._check = work, check

        def _waited(self, method: str, *args):
            try:
                done = getattr(self._work, method)(*args)
            except BaseException:  # the program's own error, unchanged: the result may never have arrived
                self._check.give_up(f"its {method}() raised")
                raise
            if done is False:  # a wait that timed out without raising: not there yet
                return done
            if method != "wait":  # a GPU stream made to wait at most: gloo's and sim's return before the result is
                try:  # there, so the check waits for it as well
                    self._work.wait()
                except Exception as error:  # not the program's call: given up, never raised into the program
                    self._check.give_up(f"its wait after {method}() raised {type(error).__name__}")
                    return done
            self._check.run()
            return done

        def wait(self, timeout=None):
            return self._waited("wait") if timeout is None else self._waited("wait", timeout)

        def synchronize(self):
            return self._waited("synchronize")

        def block_current_stream(self):
            return self._waited("block_current_stream")

        def _given_up(self, method: str, *args):
            self._check.give_up(GIVEN_UP[method])
            return getattr(self._work, method)(*args)

        def get_future(self) -> torch.futures.Future:
            return self._given_up("get_future")

        def get_future_result(self):
            return self._given_up("get_future_result")

        def result(self):
            return self._given_up("result")

        def boxed(self):
            return self._given_up("boxed")

        def is_completed(self) -> bool:
            completed = self._work.is_completed()
            if completed:
                self._check.give_up(GIVEN_UP["is_completed"])
            return completed

        def is_success(self) -> bool:
            return self._work.is_success()

        def exception(self):
            return self._work.exception()

        def source_rank(self) -> int:
            return self._work.source_rank()

        def _source_rank(self) -> int:
            return self._work._source_rank()

        def _get_duration(self) -> float:
            return self._work._get_duration()

        def _get_op_type(self):
            return self._work._get_op_type()

    return WaitedWork
