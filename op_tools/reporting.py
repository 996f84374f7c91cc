"""The one output layer of op_tools: console lines and prettytables, CSV/JSON/torch files, source locations.

Tables go to stdout in the original ditorch's console form; diagnostics go to ``logging``
(logger ``op_tools``). Every file is written atomically (a temporary file, then ``os.replace``).
"""

from __future__ import annotations

import csv
import itertools
import json
import logging
import os
import queue
import sys
import tempfile
import threading
import time
from typing import Any, Callable

import torch
from prettytable import PrettyTable

from .arguments import iter_items
from .config import CommonConfig

logger = logging.getLogger("op_tools")

ARG_COLUMNS = ("name", "device", "dtype", "numel", "shape", "stride", "requires_grad", "layout", "data_ptr", "value")
_VALUE_WIDTH = 60
_console_lock = threading.RLock()  # re-entrant: a SIGTERM flush may print while the main thread holds it


def console(text: str) -> None:
    """One block of console output, written whole even when threads print at once."""
    with _console_lock:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        sys.stdout.flush()


def table(rows: list[dict], columns: tuple[str, ...] | None = None) -> PrettyTable:
    """A prettytable of ``rows`` (dicts); columns default to the keys in first-seen order."""
    if columns is None:
        seen: dict[str, None] = {}
        for row in rows:
            seen.update(dict.fromkeys(row))
        columns = tuple(seen)
    result = PrettyTable()
    result.field_names = list(columns)
    for row in rows:
        result.add_row([_cell(row.get(c, "")) for c in columns])
    return result


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= _VALUE_WIDTH else text[: _VALUE_WIDTH - 3] + "..."


def tensor_row(name: str, t: torch.Tensor) -> dict:
    try:
        data_ptr = t.data_ptr()
    except RuntimeError:  # tensors without storage (meta, some subclasses)
        data_ptr = 0
    return {
        "name": name, "device": str(t.device), "dtype": str(t.dtype), "numel": t.numel(), "shape": str(t.shape),
        "stride": str(t.stride()), "requires_grad": t.requires_grad, "layout": str(t.layout),
        "data_ptr": data_ptr, "value": "",
    }


def value_rows(prefix: str, values, kwargs: dict | None = None) -> list[dict]:
    """Rows for a call's positional values (``<prefix>[i]``) and keyword values (``[key]``), the original's naming."""
    rows = []
    for path, v in iter_items(tuple(values)):
        rows.append(tensor_row(prefix + path, v) if isinstance(v, torch.Tensor) else {"name": prefix + path,
                                                                                       "value": _short(v)})
    for key, value in (kwargs or {}).items():
        for path, v in iter_items(value, f"[{key}]"):
            name = prefix.rsplit(" ", 1)[0] + " " + path
            rows.append(tensor_row(name, v) if isinstance(v, torch.Tensor) else {"name": name, "value": _short(v)})
    return rows


def as_tuple(result) -> tuple:
    return tuple(result) if isinstance(result, (list, tuple)) and not isinstance(result, torch.Size) else (result,)


def call_rows(name: str, args, kwargs, result=None, with_result: bool = True) -> list[dict]:
    rows = value_rows(f"{name} inputs", args, kwargs)
    if with_result:
        rows += value_rows(f"{name} outputs", as_tuple(result))
    return rows


def header(name: str, forward_id: int, location: str, phase: str = "") -> str:
    title = f"{name}    forward_id: {forward_id}" + (f"    {phase}" if phase else "")
    return f"\n{title}\n{location}"


# --- where a call comes from ---

_SKIPPED_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch,)) + (os.path.dirname(__file__) + os.sep,)


def _user_frames():
    frame = sys._getframe(0)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_SKIPPED_DIRS) and not filename.startswith("<frozen"):
            yield frame
        frame = frame.f_back


def user_location(full_stack: bool = False) -> str:
    """``file:line function: code`` of the innermost frame outside torch and op_tools (all such frames if asked)."""
    import linecache

    lines = []
    for frame in _user_frames():
        filename, lineno = frame.f_code.co_filename, frame.f_lineno
        code = linecache.getline(filename, lineno).strip()
        lines.append(f"{filename}:{lineno} {frame.f_code.co_name}: {code}")
        if not full_stack:
            break
    return "\n".join(lines) if lines else "<unknown location>"


# --- files ---

_sessions = itertools.count(1)


def session_stem() -> str:
    """``pid<pid>_<local time>_<n>``: names a tool session's files, unique per process and session (``n`` counts
    the sessions of this process, so sessions started within one second never overwrite each other)."""
    return f"pid{os.getpid()}_{time.strftime('%Y-%m-%d-%H-%M-%S', time.localtime())}_{next(_sessions)}"


def results_path(config: CommonConfig, folder: str, *parts: str) -> str:
    """``<OP_TOOLS_RESULTS_DIR>/<folder>[/rank<N>]/<parts...>``: the rank appears only under torchrun."""
    rank = () if config.rank is None else (f"rank{config.rank}",)
    return os.path.join(config.results_dir, folder, *rank, *parts)


def write_atomic(path: str, write: Callable[[Any], None], mode: str = "w") -> int:
    """Call ``write(file)`` on a temporary file beside ``path``, then move it into place; return the bytes written."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"newline": "", "encoding": "utf-8"})) as f:
            write(f)
        size = os.path.getsize(temp)
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise
    return size


class BackgroundWriter:
    """Runs file writes on a thread of its own, in order, so that a run is not stalled by them; ``drain()`` waits.

    A write that fails is logged (with the file it was writing) and the others go on.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, write: Callable[[], Any], what: str) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=f"op_tools {self.name} writer", daemon=True)
                self._thread.start()
        self._queue.put((write, what))

    def drain(self) -> None:
        """Wait until every submitted write is done."""
        if self._thread is not None:
            self._queue.join()

    def _run(self) -> None:
        while True:
            write, what = self._queue.get()
            try:
                write()
            except Exception:  # noqa: BLE001 - one file lost is reported, the others are still written
                logger.exception("%s: writing %s failed", self.name, what)
            finally:
                self._queue.task_done()


def save_torch(path: str, obj) -> int:
    return write_atomic(path, lambda f: torch.save(obj, f), "wb")


def write_json(path: str, obj) -> int:
    return write_atomic(path, lambda f: json.dump(obj, f, indent=2, default=str))


def write_csv(path: str, rows: list[dict]) -> int:
    columns: dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(row))

    def write(f) -> None:
        writer = csv.DictWriter(f, fieldnames=list(columns))
        writer.writeheader()
        writer.writerows(rows)

    return write_atomic(path, write)


def write_text(path: str, text: str) -> int:
    return write_atomic(path, lambda f: f.write(text))
