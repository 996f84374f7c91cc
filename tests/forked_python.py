"""Python children forked from an interpreter that has imported torch already: the suite's children start in
about 0.1 s instead of 4 (importing torch, DTensor and transformers' Llama is most of a child's time; issue 36).

``tests/conftest.py`` sends ``subprocess.run([sys.executable, ...])`` here when the command is a script, ``-c``
code or ``-m`` a module other than torchrun and pytest, and its output is captured; anything else, and any test
marked ``fresh_interpreter`` (what an import does, what an import costs), gets a real new interpreter.

A forked child is a real process with its own environment, working directory, arguments, ``sys.path`` (rebuilt
from its ``PYTHONPATH`` as a new interpreter builds it) and exit status; it shuts down as an interpreter does
(``atexit`` handlers, buffers flushed). What it shares with the server: modules imported before the fork. None of
ditorch or op_tools is among them, so everything they read at import is read in the child. OpenMP read
``OMP_NUM_THREADS`` when torch was loaded, so the child sets it through ``torch.set_num_threads``.

torchrun (``-m torch.distributed.run``) is forked too, and so are its workers: before the agent runs, it forks one
standby per local rank while it is still single-threaded (the rendezvous store's thread comes later). The agent's
``SubprocessHandler._popen``, the one place torchrun starts a worker, hands the worker's command line and environment
to a standby instead of starting an interpreter. A worker is still the agent's own child in a session of its own, with
torchrun's environment and ``-u`` output, polled, signalled and reaped by the agent as a ``Popen`` is. A command the
standbys cannot run (not this Python, interpreter options) or a restart beyond the standbys gets a real interpreter.

The server is this file run as a script: it reads one request per line (JSON) on its stdin, forks, answers the
child's pid and then its exit status on its stdout. One server per pytest process, used by one test at a time.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import select
import signal
import subprocess
import sys
import tempfile

# What every sim child imports (sim's first tensor imports DTensor): nothing more, so a child's modules are what a new
# interpreter's would be after its first sim tensor. (transformers would import torch._dynamo, which the tools
# load only when a script compiles: test_compile_under_tools checks that.)
PRELOAD = ("torch", "torch.distributed.tensor")
_SKIPPED_MODULES = ("pytest",)
_TORCHRUN = "torch.distributed.run"


# ---- the server, in its own process ------------------------------------------------------------------------------


def _serve() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    own_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base_path = [p for p in sys.path[1:] if p not in own_path]  # the interpreter's own entries (site-packages)
    sys.stdout.flush()
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            sys.exit(_child(request, base_path))  # an interpreter's exit: atexit handlers, flushed buffers
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


def _child(request: dict, base_path: list) -> int:
    """Run one request in this (forked) process. ``in``/``out``/``err`` None: inherited (a torchrun worker's default);
    ``session``: a session of its own (torchrun's ``start_new_session``), else a process group of its own;
    ``unbuffered``: ``python -u``'s unbuffered standard streams, a line at a time."""
    import runpy
    import types

    if request.get("session"):
        os.setsid()
    else:
        os.setpgid(0, 0)  # a timeout kills the child and whatever it started
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for fd, path, mode in ((0, request["in"], os.O_RDONLY), (1, request["out"], os.O_WRONLY),
                           (2, request["err"], os.O_WRONLY)):
        if path is None:
            continue
        target = os.open(path, mode)
        os.dup2(target, fd)
        os.close(target)
    if request.get("unbuffered"):
        for name, fd in (("stdout", 1), ("stderr", 2)):
            old = getattr(sys, name)
            # unbuffered as `python -u`'s, but each line written whole: -u writes print's text and its newline
            # apart, and two workers started in the same instant would cut into each other's lines
            stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=old.encoding, errors=old.errors,
                                      line_buffering=True)
            setattr(sys, name, stream)
            setattr(sys, f"__{name}__", stream)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    first = os.path.dirname(os.path.abspath(argv[0])) if argv[0] not in ("-c", "-m") else ""
    sys.path[:] = [first, *pythonpath, *base_path]
    if os.environ.get("OMP_NUM_THREADS"):
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if argv[:2] == ["-m", _TORCHRUN]:
        _standby_workers(argv, base_path)
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as done:
        code = done.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        return 130
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


# ---- torchrun's workers, forked by its agent ----------------------------------------------------------------------


def _local_ranks(argv: list) -> int:
    """``--nproc_per_node``/``--nproc-per-node`` from a torchrun command line when it is a number, else 1."""
    for i, arg in enumerate(argv):
        for flag in ("--nproc_per_node", "--nproc-per-node"):
            value = arg[len(flag) + 1:] if arg.startswith(flag + "=") else (
                argv[i + 1] if arg == flag and i + 1 < len(argv) else None)
            if value is not None:
                return int(value) if value.isdigit() else 1
    return 1


def _worker_argv(args: tuple) -> list | None:
    """The worker's arguments after the interpreter and ``-u`` when a standby can run them, else None."""
    if not args or args[0] != sys.executable:
        return None
    rest = [str(a) for a in args[1:]]
    if rest[:1] == ["-u"]:
        rest = rest[1:]
    if not rest or not (rest[0] in ("-c", "-m") or (not rest[0].startswith("-") and rest[0].endswith(".py"))):
        return None
    return rest


class _ForkedWorker:
    """What torchrun's agent uses of a worker's ``Popen``: ``pid``, ``returncode``, ``poll``, ``wait``, signals."""

    def __init__(self, pid: int, args: list) -> None:
        self.pid, self.args = pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _standby_workers(argv: list, base_path: list) -> None:
    """Fork one standby per local rank (each waits for a worker's request on a pipe, then runs it as ``_child``
    runs a request) and send torchrun's worker starts to them."""
    standbys: list[tuple[int, int]] = []
    for _ in range(_local_ranks(argv)):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(write)
            for _, other in standbys:
                os.close(other)
            with os.fdopen(read) as pipe:
                line = pipe.readline()
            if not line:
                os._exit(0)  # the agent ended without this worker: nothing of the agent's to shut down
            sys.exit(_child(json.loads(line), base_path))
        os.close(read)
        standbys.append((pid, write))
    # imported after the forks: a worker's modules are those a new interpreter has before its script
    from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler

    original = SubprocessHandler._popen

    def _popen(handler, args, env):
        rest = _worker_argv(args)
        if rest is None or not standbys:
            return original(handler, args, env)
        pid, write = standbys.pop(0)
        paths = [getattr(stream, "name", None) for stream in (handler._stdout, handler._stderr)]
        request = {"argv": rest, "env": dict(env), "cwd": os.getcwd(), "in": None, "out": paths[0],
                   "err": paths[1], "session": True, "unbuffered": args[1] == "-u"}
        with os.fdopen(write, "w") as pipe:
            pipe.write(json.dumps(request) + "\n")
        return _ForkedWorker(pid, list(args))

    SubprocessHandler._popen = _popen  # type: ignore[method-assign]


# ---- the client, in the test process ----------------------------------------------------------------------------


class _Server:
    def __init__(self) -> None:
        from subprocess_env import child_env

        self.process = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=child_env(), text=True, bufsize=1)
        atexit.register(self.close)

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()  # the server's loop ends
        self.process.wait(timeout=30)
        if self.process.stdout is not None:
            self.process.stdout.close()

    def alive(self) -> bool:
        return self.process.poll() is None

    def _answer(self, deadline: float | None) -> dict:
        import time

        stdout = self.process.stdout
        assert stdout is not None
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([stdout], [], [], timeout)
        if not ready:
            raise TimeoutError
        line = stdout.readline()
        if not line:
            raise RuntimeError("the fork server ended")
        return json.loads(line)

    def run(self, argv: list, env: dict, cwd: str, stdin_path: str | None, out: str, err: str,
            timeout: float | None) -> int:
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        stdin = self.process.stdin
        assert stdin is not None
        stdin.write(json.dumps({"argv": argv, "env": env, "cwd": cwd, "in": stdin_path or os.devnull, "out": out,
                                "err": err})
                    + "\n")
        stdin.flush()
        pid = self._answer(None)["pid"]
        try:
            return self._answer(deadline)["rc"]
        except TimeoutError:
            os.killpg(pid, signal.SIGKILL)
            self._answer(None)
            raise


_server: _Server | None = None


def _forkable(args, kwargs: dict) -> bool:
    if not isinstance(args, (list, tuple)) or len(args) < 2 or args[0] != sys.executable:
        return False
    if set(kwargs) - {"env", "cwd", "capture_output", "text", "timeout", "stdout", "stderr", "input", "check",
                      "encoding", "universal_newlines"}:
        return False
    captured = kwargs.get("capture_output") or (kwargs.get("stdout") == subprocess.PIPE and
                                                kwargs.get("stderr") in (subprocess.PIPE, subprocess.STDOUT))
    if not captured:
        return False
    first = str(args[1])
    if first == "-m":
        return len(args) > 2 and args[2] not in _SKIPPED_MODULES
    return first == "-c" or (not first.startswith("-") and first.endswith(".py"))


ENABLED = True  # False: every child a new interpreter (a test marked fresh_interpreter)


def run(real_run, args, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(args, **kwargs)`` through the fork server where it can be (see the module's doc), else
    ``real_run``."""
    global _server
    if not ENABLED or not _forkable(args, kwargs):
        return real_run(args, **kwargs)
    if _server is None or not _server.alive():
        _server = _Server()
    text = bool(kwargs.get("text") or kwargs.get("universal_newlines") or kwargs.get("encoding"))
    with tempfile.TemporaryDirectory(prefix="forked-python-") as folder:
        out, err = os.path.join(folder, "out"), os.path.join(folder, "err")
        if kwargs.get("stderr") == subprocess.STDOUT:
            err = out
        for path in {out, err}:
            open(path, "wb").close()
        stdin_path = None
        if kwargs.get("input") is not None:
            stdin_path = os.path.join(folder, "in")
            data = kwargs["input"]
            with open(stdin_path, "w" if isinstance(data, str) else "wb") as f:
                f.write(data)
        env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
        cwd = os.fspath(kwargs.get("cwd") or os.getcwd())
        argv = [str(a) for a in args[1:]]
        try:
            code = _server.run(argv, env, cwd, stdin_path, out, err, kwargs.get("timeout"))
        except TimeoutError:
            raise subprocess.TimeoutExpired(list(args), kwargs.get("timeout") or 0) from None
        stdout, stderr = _read(out, text, kwargs), (None if err == out else _read(err, text, kwargs))
    done = subprocess.CompletedProcess(list(args), code, stdout, stderr)
    if kwargs.get("check"):
        done.check_returncode()
    return done


def _read(path: str, text: bool, kwargs: dict):
    with open(path, "rb") as f:
        data = f.read()
    if not text:
        return data
    # as subprocess's text mode: universal newlines, "\r" included (progress bars)
    return data.decode(kwargs.get("encoding") or "utf-8").replace("\r\n", "\n").replace("\r", "\n")


if __name__ == "__main__":
    _serve()
