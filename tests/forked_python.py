"""Python children forked from an interpreter that has imported torch already: the suite's children start in
about 0.1 s instead of 4 (importing torch, DTensor and transformers' Llama is most of a child's time; issue 36).

``tests/conftest.py`` replaces ``subprocess.Popen`` for the session with ``RoutingPopen``: a command that is this
Python running a script, ``-c`` code or ``-m`` a module other than pytest starts as a child forked from this
server (``ForkedPopen``, what the suite uses of a ``Popen``); anything else, and the children of a test marked
``fresh_interpreter`` (what an import does, what an import costs), gets a real new interpreter. ``subprocess.run``
and ``check_output`` start their children through ``subprocess.Popen``, so they are routed the same way. A forked
child's own Python children (a benchmark's torchrun, a command that runs a script) are forked by the same server,
through a socket of the child's own, unless the child's environment sets ``TESTS_FORKED_PYTHON=0``; a process forked
from a forked child (a multiprocessing worker) starts new interpreters.

A forked child is a real process with its own environment, working directory, arguments, ``sys.path`` (rebuilt
from its ``PYTHONPATH`` as a new interpreter builds it), standard streams (the caller's pipes or files, passed over
a Unix socket), exit status and signals; it shuts down as an interpreter does (``atexit`` handlers, buffers
flushed). What it shares with the server: modules imported before the fork. None of ditorch or op_tools is among
them, so everything they read at import is read in the child. OpenMP read ``OMP_NUM_THREADS`` when torch was
loaded, so the child sets it through ``torch.set_num_threads``.

torchrun (``-m torch.distributed.run``) is forked too, and so are its workers: before the agent runs, it forks one
standby per local rank while it is still single-threaded (the rendezvous store's thread comes later). The agent's
``SubprocessHandler._popen``, the one place torchrun starts a worker, hands the worker's command line and environment
to a standby instead of starting an interpreter. A worker is still the agent's own child in a session of its own, with
torchrun's environment and ``-u`` output, polled, signalled and reaped by the agent as a ``Popen`` is. A command the
standbys cannot run (not this Python, interpreter options) or a restart beyond the standbys gets a real interpreter.

The server is this file run as a script with the modules it imports as arguments, one per pytest process and set
of modules: the first imports ``PRELOAD``, and one that imports more is forked from it (torch already imported).
After its imports it freezes the garbage collector (``gc.freeze()``): a child's collections skip what it inherited,
which a full collection scanned (0.28 s each with transformers) and copied, page by page, as it wrote their headers.
Over ``SOCK_SEQPACKET`` sockets (the test process's, and one per forked child) it takes one request per message
(JSON, with the child's three standard streams as file descriptors), forks, answers the child's pid, and reports
each child's exit status to the socket that asked when it reaps it: several children can run at once.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading

# What every sim child imports (sim's first tensor imports DTensor): nothing more, so a child's modules are what a new
# interpreter's would be after its first sim tensor. (transformers would import torch._dynamo, which the tools
# load only when a script compiles: test_compile_under_tools checks that.)
PRELOAD = ("torch", "torch.distributed.tensor")
# The children of a module marked ``children_import(name)`` come from another server, which has imported these too:
# - transformers' Llama and GPT-2 (4.7 s of CPU a child otherwise). Its cached answers about the machine
#   (``is_torch_npu_available`` and the like) are cleared after the import, so that a child asks them again after
#   ``import ditorch`` as it would in a new interpreter; transformers' import itself reads nothing ditorch changes
#   on sim (sdpa_attention's module-level ``is_torch_npu_available()`` is False either way without torch_npu);
# - PyTorch's operator database, which the conformance sweep imports before anything else (5.3 s): its workers,
#   forked (``--start-method fork``), then start at once.
CHILDREN_IMPORT = {
    "transformers": ("transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2"),
    "op_db": ("torch.testing._internal.common_methods_invocations",),
}
_SKIPPED_MODULES = ("pytest",)
_TORCHRUN = "torch.distributed.run"


# ---- the server, in its own process ------------------------------------------------------------------------------


_MESSAGE_BYTES = 1 << 20  # a request: argv, environment and folder as JSON


def _serve(sock_fd: int, preload: list) -> None:
    import importlib

    for name in preload:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - not importable here (transformers on a torch it does not support, a
            pass  # NameError in its import): each child fails as a new interpreter would, importing it itself
    if "transformers" in sys.modules:
        from transformers.utils import import_utils

        for name, function in vars(import_utils).items():
            if name.startswith("is_") and hasattr(function, "cache_clear"):
                function.cache_clear()
    gc.freeze()  # the children's collections skip what they inherit (the module's docstring)
    own_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base_path = [p for p in sys.path[1:] if p not in own_path]  # the interpreter's own entries (site-packages)
    test_process = socket.socket(fileno=sock_fd)
    # Each child gets a socket of its own to this server, through which its own Python children are forked from here
    # too (a benchmark's torchrun, a command's subprocess); an exit status goes to the socket that asked for the child.
    clients = {test_process}
    owners: dict[int, socket.socket] = {}  # pid -> the socket its request came from
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that SIGCHLD writes to the wakeup pipe
    signal.set_wakeup_fd(wake_write)
    while True:
        ready, _, _ = select.select([*clients, wake_read], [], [])
        if wake_read in ready:
            os.read(wake_read, 4096)
            _reap(owners, clients)
        for client in [c for c in ready if c in clients]:
            message, fds, _, _ = socket.recv_fds(client, _MESSAGE_BYTES, 3)
            if not message:
                if client is test_process:
                    return  # the test process closed its end
                clients.discard(client)  # a child (and whatever it forked) closed its end
                client.close()
                continue
            request = json.loads(message)
            if "serve" in request:  # another server, which imports more: forked from this one, torch imported
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    for fd in (*(c.detach() for c in clients), wake_read, wake_write):
                        os.close(fd)
                    _serve(fds[0], request["serve"])
                    os._exit(0)
                os.close(fds[0])
                owners[pid] = client
                client.send(json.dumps({"id": request["id"], "pid": pid}).encode())
                continue
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (*(c.detach() for c in clients), ours.detach(), wake_read, wake_write):
                    os.close(fd)
                # an interpreter's exit: atexit handlers, flushed buffers
                sys.exit(_child(request, base_path, fds, theirs.detach()))
            for fd in fds:
                os.close(fd)
            theirs.close()
            clients.add(ours)
            owners[pid] = client
            client.send(json.dumps({"id": request["id"], "pid": pid}).encode())


def _reap(owners: dict, clients: set) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return
        owner = owners.pop(pid, None)
        if owner in clients:
            with contextlib.suppress(OSError):  # the child that asked for it may be gone: nobody waits then
                owner.send(json.dumps({"exited": pid, "rc": os.waitstatus_to_exitcode(status)}).encode())


def _child(request: dict, base_path: list, fds: list | None = None, server_fd: int | None = None) -> int:
    """Run one request in this (forked) process: its standard streams are ``fds`` when given, else the files named
    by ``in``/``out``/``err`` (None: inherited, a torchrun worker's default); ``session``: a session of its own
    (``start_new_session``); ``umask``: ``Popen``'s (-1: the server's); ``unbuffered``: ``python -u``'s unbuffered
    standard streams, a line at a time; ``server_fd``: its socket to the server, through which its own Python
    children are forked (unless its environment sets ``TESTS_FORKED_PYTHON=0``)."""
    import runpy
    import types

    if request.get("session"):
        os.setsid()
    if request.get("umask", -1) >= 0:
        os.umask(request["umask"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if fds is not None:
        for fd, source in enumerate(fds):
            os.dup2(source, fd)
        for source in set(fds) - {0, 1, 2}:
            os.close(source)
    else:
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
    if server_fd is not None and os.environ.get("TESTS_FORKED_PYTHON") != "0":
        _attach(socket.socket(fileno=server_fd))
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
        _uncaught()
        return 130
    except BaseException:
        _uncaught()
        return 1
    return 0


def _uncaught() -> None:
    """What an interpreter does with an exception no one caught: ``sys.last_*`` set (exit handlers read them),
    then ``sys.excepthook``."""
    kind, error, traceback = sys.exc_info()
    sys.last_type, sys.last_value, sys.last_traceback = kind, error, traceback
    if sys.version_info >= (3, 12):
        sys.last_exc = error
    sys.excepthook(kind, error, traceback)


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


class _Signalled:
    """``Popen``'s signals for a child known by ``pid`` whose ``poll`` says whether it still runs."""

    pid: int

    def poll(self) -> int | None:
        raise NotImplementedError

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _ForkedWorker(_Signalled):
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

_REAL_POPEN = subprocess.Popen  # the class this module was imported with (conftest replaces subprocess.Popen)
ENABLED = True  # False: every child a new interpreter (a test marked fresh_interpreter)
ALSO_IMPORTED: tuple = ()  # a CHILDREN_IMPORT entry: children from a server that has imported it too


class _Server:
    """The server process (None in a forked child, which only has its socket to it), the socket to it, and a thread
    that files its answers (pids, exit statuses)."""

    def __init__(self, preload: tuple = (), sock: socket.socket | None = None, parent: _Server | None = None) -> None:
        """A new server importing ``preload`` (forked by ``parent``, a server that imported part of it, when given),
        or, with ``sock``, a forked child's socket to the server that forked it."""
        self.process: subprocess.Popen | None = None  # None: not this process's child
        if sock is None:
            sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            if parent is None:
                from subprocess_env import child_env

                self.process = _REAL_POPEN([sys.executable, os.path.abspath(__file__), str(theirs.fileno()),
                                            *preload], pass_fds=[theirs.fileno()], env=child_env())
            else:
                parent.start({"serve": list(preload)}, [theirs.fileno()])
            theirs.close()
            atexit.register(self.close)
        self.sock = sock
        self.lock = threading.Lock()  # one request at a time
        self.answered = threading.Condition()
        self.pids: dict[int, int] = {}  # request id -> pid
        self.exits: dict[int, int] = {}  # pid -> exit status
        self.next_id = 0
        threading.Thread(target=self._read_answers, name="forked-python-answers", daemon=True).start()

    def _read_answers(self) -> None:
        while True:
            try:
                message = self.sock.recv(_MESSAGE_BYTES)
            except OSError:
                message = b""
            with self.answered:
                if not message:
                    self.exits.setdefault(-1, 0)  # the server is gone: every wait ends
                    self.answered.notify_all()
                    return
                answer = json.loads(message)
                if "pid" in answer:  # sent before the child can be reaped: an older child's status is stale
                    self.pids[answer["id"]] = answer["pid"]
                    self.exits.pop(answer["pid"], None)
                else:
                    self.exits[answer["exited"]] = answer["rc"]
                self.answered.notify_all()

    def alive(self) -> bool:
        return (self.process is None or self.process.poll() is None) and -1 not in self.exits

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # the server's loop ends; so does the answers thread's recv
        except OSError:
            pass
        self.sock.close()
        if self.process is not None:
            self.process.wait(timeout=30)

    def start(self, request: dict, fds: list) -> int:
        with self.lock:
            self.next_id += 1
            request = {**request, "id": self.next_id}
            socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
            with self.answered:
                self.answered.wait_for(lambda: request["id"] in self.pids or -1 in self.exits)
                if -1 in self.exits:
                    raise RuntimeError("the fork server ended")
                return self.pids.pop(request["id"])

    def exit_status(self, pid: int, timeout: float | None) -> int | None:
        """The child's exit status, waiting up to ``timeout`` seconds (None: as long as it runs, 0: not at all)."""
        with self.answered:
            self.answered.wait_for(lambda: pid in self.exits or -1 in self.exits, timeout)
            if pid not in self.exits and -1 in self.exits:
                raise RuntimeError("the fork server ended")
            return self.exits.get(pid)


_servers: dict[tuple, _Server] = {}  # by what they preload, each started on its first child


_attached: tuple[int, _Server] | None = None  # in a forked child: its pid and its socket to the server that forked it


def _attach(sock: socket.socket) -> None:
    """In a forked child: its own Python children are forked by the server too, through ``sock``."""
    global _attached
    _attached = (os.getpid(), _Server(sock=sock))
    subprocess.Popen = RoutingPopen  # type: ignore[misc]


def _running_server() -> _Server:
    if _attached is not None and _attached[0] == os.getpid():
        return _attached[1]
    return _server_for(PRELOAD + ALSO_IMPORTED)


def _server_for(preload: tuple) -> _Server:
    """The running server that imported ``preload``, started if need be: one that imports more than ``PRELOAD`` is
    forked from ``PRELOAD``'s (2.5 s of CPU less than a new interpreter importing torch again)."""
    server = _servers.get(preload)
    if server is None or not server.alive():
        parent = _server_for(PRELOAD) if preload != PRELOAD else None
        server = _servers[preload] = _Server(preload, parent=parent)
    return server


_POPEN_KEYWORDS = {"stdin", "stdout", "stderr", "env", "cwd", "text", "universal_newlines", "encoding", "errors",
                   "bufsize", "close_fds", "start_new_session", "umask"}


def _forkable(args, kwargs: dict) -> bool:
    if not isinstance(args, (list, tuple)) or len(args) < 2 or args[0] != sys.executable:
        return False
    if set(kwargs) - _POPEN_KEYWORDS or kwargs.get("close_fds") is False:
        return False
    first = str(args[1])
    if first == "-m":
        return len(args) > 2 and args[2] not in _SKIPPED_MODULES
    return first == "-c" or (not first.startswith("-") and first.endswith(".py"))


class ForkedPopen(_Signalled):
    """A child forked by the server, with what the suite uses of ``subprocess.Popen``: ``args``, ``pid``,
    ``returncode``, ``stdin``/``stdout``/``stderr`` (PIPE, DEVNULL, STDOUT, a file or None: inherited),
    ``poll``, ``wait``, ``communicate``, signals, and ``with``."""

    def __init__(self, args, stdin=None, stdout=None, stderr=None, env=None, cwd=None, text=None,
                 universal_newlines=None, encoding=None, errors=None, bufsize=-1, close_fds=True,
                 start_new_session=False, umask=-1) -> None:
        self.args, self.returncode = args, None
        self.text_mode = bool(text or universal_newlines or encoding or errors)
        self._encoding, self._errors = encoding or "utf-8", errors or "strict"
        self.stdin = self.stdout = self.stderr = None
        self._readers: dict[str, threading.Thread] = {}
        self._read: dict[str, bytes] = {}
        ours: list[int] = []  # the child's ends this process opened: closed once the server holds them
        fds = []
        for name, spec, inherited in (("stdin", stdin, 0), ("stdout", stdout, 1), ("stderr", stderr, 2)):
            if spec is None:
                fds.append(inherited)
            elif spec == subprocess.STDOUT and name == "stderr":
                fds.append(fds[1])
            elif spec == subprocess.DEVNULL:
                fd = os.open(os.devnull, os.O_RDONLY if name == "stdin" else os.O_WRONLY)
                ours.append(fd)
                fds.append(fd)
            elif spec == subprocess.PIPE:
                read, write = os.pipe()
                child, mine = (read, write) if name == "stdin" else (write, read)
                ours.append(child)
                fds.append(child)
                setattr(self, name, self._stream(mine, "wb" if name == "stdin" else "rb", bufsize))
            else:
                fds.append(spec if isinstance(spec, int) else spec.fileno())
        request = {"argv": [str(a) for a in args[1:]], "env": dict(os.environ if env is None else env),
                   "cwd": os.fspath(cwd or os.getcwd()), "session": bool(start_new_session), "umask": umask}
        self._server = _running_server()  # the one that reaps this child: a server's end ends its waits
        try:
            self.pid = self._server.start(request, fds)
        finally:
            for fd in ours:
                os.close(fd)

    def _stream(self, fd: int, mode: str, bufsize: int):
        raw = open(fd, mode, buffering=-1 if bufsize in (-1, 1) else bufsize)
        if not self.text_mode:
            return raw
        return io.TextIOWrapper(raw, encoding=self._encoding, errors=self._errors, write_through=mode == "wb",
                                line_buffering=bufsize == 1)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_status(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.exit_status(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def communicate(self, input=None, timeout: float | None = None):
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        if self.stdin is not None and "stdin" not in self._readers:
            self._readers["stdin"] = threading.Thread(target=self._feed, args=(input,), daemon=True)
            self._readers["stdin"].start()
        for name in ("stdout", "stderr"):
            if getattr(self, name) is not None and name not in self._readers:
                self._readers[name] = threading.Thread(target=self._drain, args=(name,), daemon=True)
                self._readers[name].start()
        for thread in self._readers.values():
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return tuple(self._result(name) for name in ("stdout", "stderr"))

    def _feed(self, data) -> None:
        assert self.stdin is not None
        try:
            if data:
                self.stdin.write(data)
            self.stdin.close()
        except BrokenPipeError:
            pass

    def _drain(self, name: str) -> None:
        stream = getattr(self, name)
        self._read[name] = stream.read()
        stream.close()

    def _result(self, name: str):
        return self._read.get(name) if getattr(self, name) is not None else None

    def __enter__(self) -> ForkedPopen:
        return self

    def __exit__(self, *exc) -> None:
        for stream in (self.stdout, self.stderr, self.stdin):
            if stream is not None and not stream.closed and not self._readers:
                stream.close()
        self.wait()


class RoutingPopen(_REAL_POPEN):  # type: ignore[misc, valid-type]
    """``subprocess.Popen`` for the session: a ``ForkedPopen`` where the command can be forked (see the module's
    doc), else a real ``Popen``."""

    def __new__(cls, args, *positional, **kwargs):
        # a process forked from a forked child (a torchrun standby, a multiprocessing worker) has no thread reading
        # its parent's socket: its children are new interpreters
        nested = _attached is not None and _attached[0] != os.getpid()
        if ENABLED and not nested and not positional and _forkable(args, kwargs):
            return ForkedPopen(args, **kwargs)
        return super().__new__(cls)


if __name__ == "__main__":
    _serve(int(sys.argv[1]), sys.argv[2:])
    os._exit(0)  # nothing to flush: an interpreter's shutdown would take seconds to free torch's (and op_db's) modules
