"""Worker processes: each op x dtype runs in a child process, so that a kernel that crashes or hangs costs only
that op.

A worker is a ``spawn``-context process by default (a fresh interpreter: no CUDA or device state inherited). With
``start="fork"`` (``--start-method fork``), the sweep imports ``op_db`` once and forks each worker from itself, so
that a worker, and each restart after a crash, starts in a fraction of a second instead of seconds: for devices
whose runtime survives a fork (the CPU, sim), never CUDA. A worker imports ``op_db``, then the ``--setup`` modules
(what registers an out-of-tree device, e.g. ``ditorch.sim:register``), checks that the device exists, sends the
catalogue of OpInfos, then runs one task at a time. Before each device call it reports ``(sample, direction)``, so
that the sweep can say where a worker died or hung. Its stdout and stderr go to a log file whose tail explains a
crash.

The sweep side (``WorkerPool``) gives each task a deadline (``--timeout``): a worker past it is killed,
one that dies is noticed by its process sentinel, and both mark the task ``crash`` and start a fresh
worker for the next task.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

STARTUP_TIMEOUT = 300.0  # seconds for a worker to import torch, the setup modules and op_db
START_METHODS = ("spawn", "fork")  # multiprocessing's; "fork": after this process imported op_db (see above)
_LOG_TAIL = 400          # characters of a worker's log quoted in a crash's detail


class SweepError(RuntimeError):
    """The sweep cannot go on at all (the device or a setup module does not work); the message says why."""


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    device: str                     # "sim", "cuda:0"
    setup: tuple[str, ...] = ()     # "module" or "module:function", imported (and called) first
    log_dir: str = ""               # where each worker's stdout/stderr go ("": inherited)
    threads: int | None = None      # torch.set_num_threads in the worker
    start: str = "spawn"            # a START_METHODS entry

    def __post_init__(self) -> None:
        if self.start not in START_METHODS:
            raise ValueError(f"start method {self.start!r}: expected one of {', '.join(START_METHODS)}")


@dataclasses.dataclass(frozen=True)
class Task:
    op: str
    dtype: str


@dataclasses.dataclass
class TaskResult:
    task: Task
    rows: list[dict] | None              # None: the worker crashed (see crash)
    comparisons: list[dict] = dataclasses.field(default_factory=list)
    crash: str = ""                      # how the worker died or hung, or how the tool failed
    status: str = "crash"                # the rows' status: "unchecked" where the tool itself failed on the op
    sample: int | None = None            # the sample it was running then
    direction: str = ""


# --- the setup modules ---

def run_setup(specs: tuple[str, ...]) -> None:
    """Import each ``module`` or ``module:function`` (and call the function); ValueError names a bad one."""
    for spec in specs:
        module_name, _, function = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(f"--setup {spec!r}: cannot import {module_name!r} ({e})") from None
        if function:
            target = getattr(module, function, None)
            if not callable(target):
                raise ValueError(f"--setup {spec!r}: {module_name} has no function {function!r}")
            target()


# --- the worker process ---

def worker_main(conn, config: WorkerConfig, log_path: str) -> None:
    """The child process: set up, report the catalogue, then run tasks until told to stop."""
    if log_path:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    warnings.filterwarnings("ignore")  # OpInfo samples call deprecated forms on purpose
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the sweep's to handle: it stops the workers
    try:
        import torch

        from ...numerics.comparison import ToleranceSpec
        from .opinfos import catalogue, import_op_db, load_op_db

        # op_db first: its import calls torch.cuda APIs that a setup such as ditorch's CUDA-to-device transfer maps
        # elsewhere; the setup then sees op_db (and may add to it) before the table of OpInfos is made
        import_op_db()
        run_setup(config.setup)
        if config.threads:
            torch.set_num_threads(config.threads)
        device = torch.device(config.device)
        torch.empty(0, device=device)  # the device exists
        entries = catalogue(device.type)
        db = load_op_db()
        tolerance = ToleranceSpec.from_env()
    except Exception as e:  # noqa: BLE001 - reported to the sweep, which stops with this message
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", [dataclasses.asdict(e) for e in entries]))
    from .case import run_case

    while True:
        message = conn.recv()
        if message[0] == "stop":
            return
        _, task, options = message
        try:
            result = run_case(db[task.op], getattr(torch, task.dtype), device, options, tolerance,
                              progress=lambda sample, direction: conn.send(("progress", sample, direction)))
        except Exception as e:  # noqa: BLE001 - a failure of the sweep itself: its traceback goes to the log
            traceback.print_exc()
            sys.stderr.flush()
            conn.send(("failed", f"{type(e).__name__}: {e}".splitlines()[0][:300]))
            continue
        conn.send(("done", [r.to_dict() for r in result.rows], result.comparisons))


# --- the sweep side ---

class _Worker:
    """One worker process, as the sweep sees it."""

    _count = 0

    def __init__(self, config: WorkerConfig) -> None:
        fork = config.start == "fork"
        context = multiprocessing.get_context("fork") if fork else multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        _Worker._count += 1
        self.log_path = os.path.join(config.log_dir, f"worker{_Worker._count}.log") if config.log_dir else ""
        self.process = context.Process(target=worker_main, args=(child, config, self.log_path), daemon=True,
                                       name=f"conformance-worker-{_Worker._count}")
        self.process.start()
        child.close()  # the child holds the only write end now: its death is an EOF here
        self.ready = False
        self.task: Task | None = None
        self.deadline = time.monotonic() + STARTUP_TIMEOUT
        self.sample: int | None = None
        self.direction = ""
        self.log_offset = 0

    def send(self, task: Task, options, timeout: float) -> None:
        self.task, self.sample, self.direction = task, None, ""
        self.deadline = time.monotonic() + timeout
        self.log_offset = os.path.getsize(self.log_path) if self.log_path and os.path.exists(self.log_path) else 0
        self.conn.send(("task", task, options))

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)
        if not self.conn.closed:
            self.conn.close()

    def stop(self) -> None:
        if not self.conn.closed:
            try:
                self.conn.send(("stop",))
            except (OSError, ValueError):
                pass
        self.process.join(10)
        if self.process.is_alive():
            self.kill()
        elif not self.conn.closed:
            self.conn.close()

    def death(self) -> str:
        """How the process ended, with the tail of its log since the task began."""
        self.process.join(10)
        code = self.process.exitcode
        if code is None:
            how = "the worker stopped answering"
        elif code < 0:
            try:
                how = f"the worker died from signal {signal.Signals(-code).name}"
            except ValueError:
                how = f"the worker died from signal {-code}"
        else:
            how = f"the worker exited with status {code}"
        tail = self.log_tail()
        return how + (f"; its last output: {tail}" if tail else "")

    def log_tail(self) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(self.log_offset)
            text = f.read().decode("utf-8", "replace")
        text = " | ".join(line.strip() for line in text.strip().splitlines()[-6:] if line.strip())
        return text if len(text) <= _LOG_TAIL else "..." + text[-_LOG_TAIL:]


def where(sample: int | None, direction: str) -> str:
    return f"in sample {sample} ({direction})" if sample is not None else "before its first sample"


class WorkerPool:
    """``jobs`` worker processes running tasks, each within ``timeout`` seconds.

    >>> with WorkerPool(WorkerConfig("sim", ("ditorch.sim:register",)), jobs=1, timeout=60) as pool:
    ...     entries = pool.catalogue()
    ...     for result in pool.run([Task("add", "float32")], options): ...
    """

    def __init__(self, config: WorkerConfig, jobs: int = 1, timeout: float = 300.0) -> None:
        if config.log_dir:
            os.makedirs(config.log_dir, exist_ok=True)
        self.config, self.jobs, self.timeout = config, jobs, timeout
        self.workers: list[_Worker] = []
        self._catalogue: list[dict] | None = None
        self.on_progress = lambda task, sample, direction: None
        self.restarts = 0

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the idle workers, kill the busy ones (an interrupted sweep does not wait for their op); a second
        Ctrl-C while waiting for them kills them all."""
        try:
            for worker in self.workers:
                if worker.task is not None:
                    worker.kill()
                elif not worker.conn.closed:
                    try:
                        worker.conn.send(("stop",))
                    except (OSError, ValueError):
                        pass
            for worker in self.workers:
                worker.stop()
        except KeyboardInterrupt:
            for worker in self.workers:
                worker.kill()
            raise
        finally:
            self.workers = []

    def _start(self) -> _Worker:
        if self.config.start == "fork":
            from .opinfos import MissingDependencyError, import_op_db

            try:
                import_op_db()  # once, here: each forked worker has it then (cached after the first call)
            except MissingDependencyError as e:
                raise SweepError(f"a worker cannot run on {self.config.device!r}: {type(e).__name__}: {e}") \
                    from None
        worker = _Worker(self.config)
        self.workers.append(worker)
        return worker

    def _await_ready(self, worker: _Worker, block: bool = True) -> bool:
        """Take ``worker``'s first message (waiting for it unless ``block`` is false): whether it is ready.
        SweepError if it cannot set up."""
        if worker.ready:
            return True
        remaining = max(0.0, worker.deadline - time.monotonic()) if block else 0.0
        if not multiprocessing.connection.wait([worker.conn, worker.process.sentinel], timeout=remaining):
            if not block:
                return False
            worker.kill()
            raise SweepError(f"a worker did not start within {STARTUP_TIMEOUT:g} s on {self.config.device}")
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            raise SweepError(f"a worker died while starting: {worker.death()}") from None
        if message[0] == "error":
            worker.stop()
            raise SweepError(f"a worker cannot run on {self.config.device!r}: {message[1]}")
        worker.ready = True
        if self._catalogue is None:
            self._catalogue = message[1]
        return True

    def catalogue(self) -> list[dict]:
        """Every OpInfo and the dtypes it claims on the device (from the first worker)."""
        if self._catalogue is None:
            self._await_ready(self.workers[0] if self.workers else self._start())
        assert self._catalogue is not None  # the first worker to start sends it, or starting raised
        return self._catalogue

    def _idle_worker(self, busy: dict) -> _Worker:
        """A worker ready for a task: one already started if any is, else the first to finish starting."""
        idle = [w for w in self.workers if id(w) not in busy]
        ready = next((w for w in idle if self._await_ready(w, block=False)), None)
        if ready is None:
            self._await_ready(idle[0])
            ready = idle[0]
        return ready

    def run(self, tasks: list[Task], options) -> Iterator[TaskResult]:
        """Each task's result, in the order they finish; a crash or hang is a result too.

        From the second crash on, one spare worker is kept started, so that the next crash costs no start-up: a
        device that crashed twice tends to again (the spare costs a process, and CPU while it starts).
        """
        queue = collections.deque(tasks)
        busy: dict[int, _Worker] = {}
        while queue or busy:
            wanted = min(self.jobs, len(queue) + len(busy)) + (1 if self.restarts >= 2 and queue else 0)
            while len(self.workers) < wanted:
                self._start()
            while queue and len(busy) < self.jobs:
                worker = self._idle_worker(busy)
                worker.send(queue.popleft(), options, self.timeout)
                busy[id(worker)] = worker
            waiting: dict[Any, _Worker] = {w.conn: w for w in busy.values()}  # pipes and process sentinels
            waiting |= {w.process.sentinel: w for w in busy.values()}
            timeout = max(0.0, min(w.deadline for w in busy.values()) - time.monotonic())
            for handle in multiprocessing.connection.wait(list(waiting), timeout=timeout):
                worker = waiting[handle]
                if id(worker) not in busy:
                    continue  # both its pipe and its sentinel fired
                result = self._receive(worker)
                if result is not None:
                    del busy[id(worker)]
                    yield result
            now = time.monotonic()
            for worker in [w for w in busy.values() if w.deadline <= now]:
                del busy[id(worker)]
                worker.kill()
                place = where(worker.sample, worker.direction)
                yield self._replace(worker, f"timed out after {self.timeout:g} s {place} (the worker was killed)")

    def _receive(self, worker: _Worker) -> TaskResult | None:
        """The worker's next message: a finished task, a crash, or None for a progress mark."""
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            return self._replace(worker, f"{worker.death()} {where(worker.sample, worker.direction)}")
        kind = message[0]
        if kind == "progress":
            worker.sample, worker.direction = message[1], message[2]
            self.on_progress(worker.task, worker.sample, worker.direction)
            return None
        task, worker.task = worker.task, None
        assert task is not None  # only a busy worker, which holds a task, is read from
        if kind == "failed":
            log = f"; traceback in {worker.log_path}" if worker.log_path else ""
            return TaskResult(task, None, crash=f"the conformance tool failed on this op ({message[1]}{log})",
                              sample=worker.sample, direction=worker.direction, status="unchecked")
        return TaskResult(task, message[1], message[2])

    def _replace(self, worker: _Worker, crash: str) -> TaskResult:
        """The crashed task's result; the dead worker is dropped (``run`` starts a fresh one if work remains)."""
        assert worker.task is not None  # only a busy worker, which holds a task, crashes or times out here
        result = TaskResult(worker.task, None, crash=crash, sample=worker.sample, direction=worker.direction)
        self.workers.remove(worker)
        worker.kill()
        self.restarts += 1
        return result
