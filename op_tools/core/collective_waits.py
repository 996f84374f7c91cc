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

A Work whose future the program takes (``get_future()``: DDP's communication hooks, fp16 or PowerSGD compression, and
any ``then()`` chain) is followed: the program gets a future chained after the collective's, whose first callback
copies what arrived before any callback of the program's can change it (``fp16_compress_hook`` copies it out,
PowerSGD orthogonalises it in place). The check runs on that copy before the next optimizer step begins (or at the
tool's ``stop()``), on the program's thread: a moment the same on every rank, and one where no callback chain is still
issuing collectives (DDP waits for its hooks' futures before backward returns; PowerSGD issues its second all-reduce
from the first one's callback, on gloo's thread, where a check exchanging data among the ranks would interleave with
it differently on each rank). A collective issued in a future's callback, or whose future is taken in
one, is given up (``unordered_callback``): a callback runs when the collective before it completes, on the
collective's thread or at once on the program's, differently on each rank. Not where the callback runs at once, inside
the ``then()`` chaining it, on a library that completes every future when it queues the collective
(``COMPLETE_WHEN_QUEUED``: NCCL, sim): there it runs at the same point of the program on every rank. While a tool is
started, ``Future.then`` and ``add_done_callback`` mark the callbacks they run, and whether at once, so that this is
known at the call.

A Work the program uses otherwise before waiting for it (``result()``, ``boxed()``, ``is_completed()`` answering
True, or its future taken in a callback) lets the program read the result at a moment the tool never sees: that
collective is given up, and said not checked with why; so is one still open when the tool stops, or whose Work was
dropped before it was waited for (or followed).

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
from contextlib import AbstractContextManager
from typing import Any, Callable

import torch
import torch.distributed

from .shared_install import SharedInstall

_keys = itertools.count()
# Why a collective was given up, per way the program used its Work before waiting for it
GIVEN_UP = {"get_future": "waited for through its future", "get_future_result": "waited for through its future",
            "in_callback": "issued, or its future taken, in a future's callback",
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

    __slots__ = ("key", "owner", "call", "check", "work", "received", "future", "in_callback", "ordered",
                 "__weakref__")

    def __init__(self, owner: WaitedChecks, call: Any, check: Callable, work: Any, received: list | None,
                 ordered: bool = False) -> None:
        self.key = next(_keys)
        self.owner, self.call, self.work = owner, call, work
        # ``ordered``: its library completes futures when it queues a collective (``completes_when_queued``)
        self.ordered = ordered
        self.in_callback = unordered_callback(ordered)  # issued in a future's callback (``defer`` runs at the call)
        self.check: Callable | None = check  # None once run or given up: nothing held past it
        self.received = received  # the tensors the check reads, the tool's own list: replaced by copies if followed
        self.future: torch.futures.Future | None = None  # once followed: the program's future, after the copies

    def run(self) -> None:
        self.owner.run_up_to(self)

    def give_up(self, why: str) -> None:
        self.owner.give_up(self, why)

    def follow(self, future: torch.futures.Future) -> torch.futures.Future | None:
        """The future the program gets in place of ``future`` (its collective's): the same value, once what arrived
        is copied for the check; None where the check cannot follow it (given up then)."""
        if self.received is None or self.check is None:  # nothing to copy what arrived into; or checked already
            return None
        if self.in_callback or unordered_callback(self.ordered):
            self.give_up(GIVEN_UP["in_callback"])
            return None
        received, quiet = self.received, self.owner.quiet

        def arrived(done: torch.futures.Future):
            value = done.value()  # the collective's error, if any, reaches the program's callbacks unchanged
            with quiet(), torch.no_grad():  # no program call: inline on the program's thread if already complete
                received[:] = [t.detach().clone() for t in received]
            return value

        self.future = future.then(arrived)
        self.owner.followed = True
        return self.future


class WaitedChecks:
    """A tool's asynchronous collectives whose checks wait for the program's waits, in call order, and those given
    up, counted per why. ``run(check, call)`` runs a check as the tool's guarded work."""

    def __init__(self, run: Callable[[Callable, Any], None], quiet: Callable[[], AbstractContextManager]) -> None:
        self._run = run
        self.quiet = quiet  # the tool's own work, no program call: a followed collective's copies
        self._open: dict[int, WaitedCheck] = {}
        self._lock = threading.Lock()
        self.given_up: collections.Counter = collections.Counter()
        self.followed = False  # whether any open check is followed through its future (``run_followed`` has work)
        self._first: dict[str, str] = {}  # why -> the first op given up so

    def defer(self, call: Any, check: Callable, work: Any, received: list | None = None, ordered: bool = False) -> Any:
        """What the program gets in place of ``work`` (the result of the collective ``call``): a Work whose first
        wait runs ``check(call)``; ``work`` itself, counted given up, when it is no Work. ``received``: the list of
        tensors the check reads what arrived from, which a followed future's copies replace (without it, a future
        taken is given up). ``ordered``: its library completes a collective's future when it queues it, so that a
        callback chained on one runs at once, on the program's thread (``completes_when_queued``)."""
        waited = WaitedCheck(self, call, check, work, received, ordered)
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
        same on every rank), the earlier ones' Works waited for first; those followed through their futures wait for
        ``run_followed``."""
        with self._lock:
            if waited.key not in self._open or waited.future is not None:  # run or given up already; or followed
                return
            due = []
            for key in list(self._open):
                if self._open[key].future is None:
                    due.append(self._open.pop(key))
                if key == waited.key:
                    break
        self._run_due(due, waited)

    def run_followed(self) -> None:
        """Before an optimizer step, and at the tool's stop: the checks followed through their futures, in call order,
        each once its future is done (what arrived copied)."""
        if not self.followed:
            return
        with self._lock:
            due = [self._open.pop(key) for key in [key for key, check in self._open.items()
                                                  if check.future is not None]]
            self.followed = False
        self._run_due(due, None)

    def _run_due(self, due: list[WaitedCheck], waited: WaitedCheck | None) -> None:
        for check in due:
            if check is not waited:
                try:  # a followed one's future: what arrived is copied once it is done
                    check.work.wait() if check.future is None else check.future.wait()
                except Exception as error:
                    self._count(check.call.name, f"its {'wait' if check.future is None else 'future'} raised "
                                f"{type(error).__name__}")
                    continue
            run, check.work, check.check = check.check, None, None
            if run is not None:
                self._run(run, check.call)

    def give_up(self, waited: WaitedCheck, why: str) -> None:
        if why == DROPPED and waited.future is not None:  # followed: its future holds what the check needs
            return
        with self._lock:
            if self._open.pop(waited.key, None) is None:
                return
        waited.work = waited.check = None
        self._count(waited.call.name, why)

    def give_up_all(self, why: str) -> None:
        """At the tool's stop: the followed futures still open checked (the earlier collectives' first, as at a wait),
        the rest given up."""
        self.run_followed()
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


# On this thread: .depth, the future callbacks running later than their chaining (on the collective's thread, or
# when a future is completed); .inline, those running at once, inside the then() that chained them on a future already
# complete; .chaining, the then() calls under way
_callbacks = threading.local()

# The collective libraries whose futures are complete once a collective is queued (NCCL's: the device's stream orders
# the rest; sim's: waited for when taken). A callback chained on one runs at once, inside ``then()``, on the program's
# thread: at the same point of the program on every rank, so the collectives it issues are in program order.
COMPLETE_WHEN_QUEUED = ("nccl", "simccl")


def completes_when_queued(group) -> bool:
    """Whether the process group ``group`` (None: the default one) runs on a library of ``COMPLETE_WHEN_QUEUED``."""
    try:
        from torch.distributed import distributed_c10d

        process_group = group if group is not None else distributed_c10d._get_default_group()
        return process_group._get_backend_name() in COMPLETE_WHEN_QUEUED
    except Exception:  # noqa: BLE001 - no group, or one that names no library: not known to
        return False


def in_callback() -> bool:
    """Whether this thread runs a future's callback (``then``, ``add_done_callback``) while a tool is started, other
    than one run at once by the ``then()`` chaining it on a future already complete."""
    return getattr(_callbacks, "depth", 0) > 0


def unordered_callback(ordered: bool) -> bool:
    """Whether a collective issued now is issued in a callback whose moment may differ between ranks: any callback
    run later than its chaining, and one run at once unless its library completes futures when it queues a collective
    (``ordered``), on which a callback runs at once on every rank."""
    return in_callback() or (not ordered and getattr(_callbacks, "inline", 0) > 0)


def _marked(callback: Callable) -> Callable:
    def marked(future):
        kind = "inline" if getattr(_callbacks, "chaining", 0) > 0 else "depth"  # run by then() itself: at once
        setattr(_callbacks, kind, getattr(_callbacks, kind, 0) + 1)
        try:
            return callback(future)
        finally:
            setattr(_callbacks, kind, getattr(_callbacks, kind) - 1)

    return marked


_future_methods: dict[str, Callable] = {}


def _chaining(original: Callable) -> Callable:
    def chain(future, callback):
        _callbacks.chaining = getattr(_callbacks, "chaining", 0) + 1
        try:
            return original(future, _marked(callback))
        finally:
            _callbacks.chaining -= 1

    return chain


def _mark_callbacks() -> None:
    for name in ("then", "add_done_callback"):
        original = _future_methods[name] = getattr(torch._C.Future, name)
        setattr(torch._C.Future, name, _chaining(original))


def _unmark_callbacks() -> None:
    for name, original in _future_methods.items():
        setattr(torch._C.Future, name, original)
    _future_methods.clear()


# While a tool is started: the callbacks futures run are known as such (``in_callback``)
marking_callbacks = SharedInstall(_mark_callbacks, _unmark_callbacks)

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
            future = self._work.get_future()
            followed = self._check.follow(future)
            if followed is None:
                self._check.give_up(GIVEN_UP["get_future"])
            return future if followed is None else followed

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
