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

The server is this file run as a script: it reads one request per line (JSON) on its stdin, forks, answers the
child's pid and then its exit status on its stdout. One server per pytest process, used by one test at a time.
"""

from __future__ import annotations

import atexit
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
_SKIPPED_MODULES = ("torch.distributed.run", "pytest")


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
    import runpy
    import types

    os.setpgid(0, 0)  # a timeout kills the child and whatever it started
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for fd, path, mode in ((0, request["in"] or os.devnull, os.O_RDONLY), (1, request["out"], os.O_WRONLY),
                           (2, request["err"], os.O_WRONLY)):
        target = os.open(path, mode)
        os.dup2(target, fd)
        os.close(target)
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
        stdin.write(json.dumps({"argv": argv, "env": env, "cwd": cwd, "in": stdin_path, "out": out, "err": err})
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


def run(real_run, args, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(args, **kwargs)`` through the fork server where it can be (see the module's doc), else
    ``real_run``."""
    global _server
    if not _forkable(args, kwargs):
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
