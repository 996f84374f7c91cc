"""The one output layer of op_tools: log records and prettytables, CSV/JSON/torch files, source locations.

Every message goes through ``logging``: logger ``op_tools`` and one child per tool (``op_tools.autocompare``,
``op_tools.capture``, ...), with the original ditorch's tables as the text. Levels: failures WARNING, summaries
and each tool's closing line INFO, per-call tables and ``apply <hook> on <op>`` lines DEBUG. ``OP_TOOLS_VERBOSE``
sets the ``op_tools`` logger's level (1: DEBUG, 0: INFO; unset: INFO unless the application set one).

While the application configured no handler that would take these records, op_tools' own handler writes them to
stdout in the original's plain form (no prefix); once the application adds one (``logging.basicConfig()``, a
handler on ``op_tools``), op_tools' handler stays silent and the application's decides. To silence the tools::

    logging.getLogger("op_tools").setLevel(logging.WARNING)   # failures only
    logging.getLogger("op_tools").setLevel(logging.CRITICAL)  # nothing

Every file is written atomically (a temporary file, then ``os.replace``) with the mode the umask gives a new file.
"""

from __future__ import annotations

import csv
import functools
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
from .config import PROGRESS, CommonConfig

logger = logging.getLogger("op_tools")

CONSOLE_WIDTH = 120  # console tables fit a terminal this wide; files keep every cell whole
FIRST_COLUMN_KEPT = 32  # characters of a console table's first column (the row's name) kept before others shrink
ARG_COLUMNS = ("name", "device", "dtype", "numel", "shape", "stride", "requires_grad", "layout", "data_ptr", "value")
CONSOLE_ARG_COLUMNS = ("name", "device", "dtype", "shape", "stride", "requires_grad", "value")  # fit 120 columns
_VALUE_WIDTH = 60
_print_lock = threading.RLock()  # re-entrant: a SIGTERM flush may print while the main thread holds it


# --- logging ---

class ConsoleHandler(logging.StreamHandler):
    """op_tools' own handler: records as plain lines on the current ``sys.stdout`` (the original's console form),
    only while no other handler would take them (the application's configuration wins, with no duplicate)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)
        self.setFormatter(logging.Formatter("%(message)s"))
        self.addFilter(self._no_other_handler)

    @property
    def stream(self):  # looked up at each record: tests and applications replace sys.stdout
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        pass

    def _no_other_handler(self, record: logging.LogRecord) -> bool:
        # twin of ditorch/log.py's StderrHandler: the two packages import neither each other
        current: logging.Logger | None = logging.getLogger(record.name)
        while current is not None:
            if any(h is not self for h in current.handlers):
                return False
            if not current.propagate:
                break
            current = current.parent
        return True


_handler_lock = threading.Lock()


def configure_logging(verbose: bool | None) -> None:
    """At a tool's start: op_tools' handler on the ``op_tools`` logger (once), and its level from
    ``OP_TOOLS_VERBOSE`` (1: DEBUG, 0: INFO); unset, INFO unless the application already set a level."""
    with _handler_lock:
        if not any(isinstance(h, ConsoleHandler) for h in logger.handlers):
            logger.addHandler(ConsoleHandler())
        if verbose is not None:
            logger.setLevel(logging.DEBUG if verbose else logging.INFO)
        elif logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)


@functools.cache
def tool_logger(cls: type) -> logging.Logger:
    """``op_tools.<module>`` for op_tools' own tools (``op_tools.autocompare``), ``op_tools.<class>`` otherwise."""
    module = cls.__module__
    return logging.getLogger(module if module.startswith("op_tools.") else f"op_tools.{cls.__name__}")


def console(text: str) -> None:
    """A command-line tool's own report on stdout (run_op_from_data, conformance), written whole even when threads
    print at once. The tools' messages go through ``logging`` instead."""
    with _print_lock:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        sys.stdout.flush()


# --- tables ---

def table(rows: list[dict], columns: tuple[str, ...] | None = None, width: int | None = None,
          keep: str | None = None) -> PrettyTable:
    """A prettytable of ``rows`` (dicts); columns default to the keys in first-seen order. With ``width``, the
    longest cells are shortened (``…`` in their middle) until the table fits that many characters, if it can with
    whole column names; column ``keep`` (default: the first, which names the row) is shortened last."""
    if columns is None:
        seen: dict[str, None] = {}
        for row in rows:
            seen.update(dict.fromkeys(row))
        columns = tuple(seen)
    cells = [[_cell(row.get(c, "")) for c in columns] for row in rows]
    if width is not None:
        cells = _fit(columns, cells, width, columns.index(keep) if keep in columns else 0)
    result = PrettyTable()
    result.field_names = list(columns)
    for row in cells:
        result.add_row(row)
    return result


def table_text(rows: list[dict], columns: tuple[str, ...] | None = None, width: int = CONSOLE_WIDTH,
               keep: str | None = None) -> str:
    """``table(...)`` as text fitting ``width`` characters: the console's form. Console tables list the columns
    that tell the story (``CONSOLE_ARG_COLUMNS``, ...); the files keep every column and every cell whole."""
    return table(rows, columns, width, keep).get_string()


def call_table(op: str, rows: list[dict], columns: tuple[str, ...] = CONSOLE_ARG_COLUMNS) -> str:
    """The console table of one call's values: the header line above it names the op, so the cells name only the
    value (``inputs[0]``, ``cpu_outputs[0]``, ``[alpha]``) where the original repeated the op in each."""
    prefix = op + " "
    shown = [{**row, "name": row["name"].removeprefix(prefix)} if isinstance(row.get("name"), str) else row
             for row in rows]
    return table_text(shown, columns)


def _fit(names, cells: list[list[str]], width: int, kept: int = 0) -> list[list[str]]:
    """Cap the cells of every column at one width, the largest that makes the table fit (never below the column's
    name, nor column ``kept``, which names the row, below ``FIRST_COLUMN_KEPT``): only the longest cells are
    shortened."""
    floors = [len(n) for n in names]
    if cells:
        floors[kept] = max(floors[kept], min(FIRST_COLUMN_KEPT, max(len(row[kept]) for row in cells)))
    natural = [max([floor, *(len(row[i]) for row in cells)]) for i, floor in enumerate(floors)]
    room = width - 3 * len(names) - 1  # "| " and " |" around each cell, "|" between
    if sum(natural) <= room:
        return cells

    def used(cap: int) -> int:
        return sum(min(w, max(cap, f)) for w, f in zip(natural, floors))

    cap = 3
    while cap < max(natural) and used(cap + 1) <= room:
        cap += 1
    caps = [max(cap, f) for f in floors]
    return [[_shorten(c, caps[i]) for i, c in enumerate(row)] for row in cells]


def _shorten(text: str, width: int) -> str:
    if len(text) <= width:
        return text
    head = width // 2
    return text[:head] + "…" + text[len(text) - (width - 1 - head):]


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


# --- progress ---

def progress_bar(total: int | None, desc: str, unit: str = "it"):
    """A ``tqdm`` bar on stderr, or ``None``: shown only on a terminal, never under CI (``CI`` set), never with
    ``OP_TOOLS_PROGRESS=0``, never without tqdm installed."""
    if not PROGRESS.read() or os.environ.get("CI") or not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()):
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # optional: no bar
        return None
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=False)


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


def short_location(location: str) -> str:
    """A location line with its file relative to the working directory when it lies below it (for the console)."""
    path, colon, rest = location.partition(":")
    if colon and os.path.isabs(path):
        relative = os.path.relpath(path)
        if not relative.startswith(".."):
            return relative + colon + rest
    return location


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


def prepare_results_folder(config: CommonConfig, folder: str, tool: str) -> str:
    """Create ``<OP_TOOLS_RESULTS_DIR>/<folder>[/rank<N>]`` and probe it for writing, at a tool's start: a folder that
    cannot be written is an ``OSError`` naming the variable and the path before any work, not lost results at the
    end."""
    path = results_path(config, folder)
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise OSError(f"{tool} cannot write its results in {path} (OP_TOOLS_RESULTS_DIR={config.results_dir!r}): "
                      f"{type(e).__name__}: {e.strerror or e}; set OP_TOOLS_RESULTS_DIR to a folder this process "
                      "can write") from e
    return path


def _new_file_mode() -> int:
    """``0o666`` less the process umask, read once at import (setting the umask to read it is racy in threads;
    Linux shows it in /proc without changing it)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


FILE_MODE = _new_file_mode()


class Tally:
    """The files a tool session wrote: count, bytes, and the folder holding them (for its closing line): the tool's
    results folder ``root``, or the one holding it and every other folder written."""

    PROGRESS_AFTER = 2.0  # seconds of writing before a progress bar appears: short runs never show one
    PROGRESS_EVERY = 0.5  # seconds between redraws: a clock read per file, a redraw twice a second

    def __init__(self, root: str | None = None, label: str = "") -> None:
        self.files = 0
        self.bytes = 0
        self._folders: set[str] = {os.path.abspath(root)} if root else set()
        self._lock = threading.Lock()
        # with a label: a progress bar (progress_bar's conditions) once writing lasts; OP_TOOLS_PROGRESS read now
        self._label = label if label and PROGRESS.read() else ""
        self._next_draw = time.monotonic() + self.PROGRESS_AFTER
        self._bar = None

    def add(self, path: str, size: int) -> int:
        with self._lock:
            self.files += 1
            self.bytes += size
            self._folders.add(os.path.dirname(path))  # made absolute in describe(): a file costs ~1 µs here
            if self._label:
                now = time.monotonic()
                if now >= self._next_draw:
                    self._next_draw = now + self.PROGRESS_EVERY
                    self._draw()
        return size

    def _draw(self) -> None:
        if self._bar is None:
            self._bar = progress_bar(None, self._label, unit=" files")
            if self._bar is None:
                self._label = ""  # not shown here: no more clock reads
                return
        self._bar.n = self.files
        self._bar.set_postfix_str(human_size(self.bytes), refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        """Remove the progress bar, if one was shown."""
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None

    def describe(self) -> str:
        """``wrote 12 files (3.4 MB) in <folder>``, or ``wrote no file``."""
        if not self.files:
            return "wrote no file"
        with self._lock:
            folder = os.path.commonpath(sorted({os.path.abspath(f) for f in self._folders}))
        shown = os.path.relpath(folder) if not os.path.relpath(folder).startswith("..") else folder
        return f"wrote {self.files} file{'s' if self.files != 1 else ''} ({human_size(self.bytes)}) in {shown}"


def human_size(size: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return ""


def write_atomic(path: str, write: Callable[[Any], None], mode: str = "w") -> int:
    """Call ``write(file)`` on a temporary file beside ``path``, then move it into place; return the bytes written.
    The file gets the mode the umask gives a new file (``mkstemp`` makes its files 0600)."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        if hasattr(os, "fchmod"):
            os.fchmod(fd, FILE_MODE)
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


class JsonLinesFile:
    """A JSON-lines file written as a run goes, one object a line, safe across threads.

    It is ``<path>.partial`` until ``close()`` moves it to ``path``: a run that dies leaves a partial file whose
    complete lines still read.
    """

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        self.partial = path + ".partial"
        self.bytes_written = 0
        self._lock = threading.Lock()
        self._file = open(self.partial, "w", encoding="utf-8")  # noqa: SIM115 - closed by close()

    def write(self, obj) -> int:
        """Append ``obj`` as one line; return its size in bytes."""
        line = json.dumps(obj, separators=(",", ":"), default=str) + "\n"
        size = len(line.encode("utf-8"))
        with self._lock:
            if self._file is None:
                raise ValueError(f"{self.path} is closed")
            self._file.write(line)
            self.bytes_written += size
        return size

    def close(self) -> None:
        with self._lock:
            if self._file is None:
                return
            self._file.close()
            self._file = None
            os.replace(self.partial, self.path)
