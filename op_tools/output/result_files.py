"""The files op_tools writes: where (``OP_TOOLS_RESULTS_DIR``, per rank), how (atomically, with the mode the umask
gives a new file, in the background where a step should not wait) and the tally of a session's files for its
closing line. Messages and tables are ``reporting``'s.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import os
import queue
import tempfile
import threading
import time
from typing import Any, Callable, TextIO

import torch

from ..config.variables import PROGRESS, CommonConfig
from .reporting import files_text, logger, progress_bar, shown_path

_sessions = itertools.count(1)

# Appended to every per-call row a tool writes (docs/tools/README.md#ranks-steps-and-times): torchrun's rank ('' outside
# torchrun), the optimizer steps finished since the tool started (core/steps.py), and the wall-clock time the call
# started, seconds since the epoch to the microsecond. Appended after the original's columns, which keep their places.
RECORD_COLUMNS = ("rank", "step", "time")


def record_fields(rank: int | None, step: int, started: float) -> dict:
    """The ``RECORD_COLUMNS`` of one row."""
    return {"rank": "" if rank is None else rank, "step": step, "time": f"{started:.6f}"}


def session_stem() -> str:
    """``pid<pid>_<local time>_<n>``: names a tool session's files, unique per process and session (``n`` counts
    the sessions of this process, so sessions started within one second never overwrite each other)."""
    return f"pid{os.getpid()}_{time.strftime('%Y-%m-%d-%H-%M-%S', time.localtime())}_{next(_sessions)}"


def results_path(config: CommonConfig, folder: str, *parts: str) -> str:
    """``<OP_TOOLS_RESULTS_DIR>/<folder>[/rank<N>]/<parts...>``: the rank appears only under torchrun."""
    rank = () if config.rank is None else (f"rank{config.rank}",)
    return os.path.join(config.results_dir, folder, *rank, *parts)


def prepare_results_folder(config: CommonConfig, folder: str, tool: str, marker: tuple[str, str] | None = None) -> str:
    """Create ``<OP_TOOLS_RESULTS_DIR>/<folder>[/rank<N>]`` and probe it for writing, at a tool's start: a folder that
    cannot be written is an ``OSError`` naming the variable and the path before any work, not lost results at the
    end. ``marker``: ``(file name, text)`` written there as the probe, and kept (one small write, no temporary file:
    a tool started per step pays one file's creation either way)."""
    path = results_path(config, folder)
    try:
        os.makedirs(path, exist_ok=True)
        if marker is None:
            fd, probe = tempfile.mkstemp(dir=path, prefix=".probe-")
            os.close(fd)
            os.unlink(probe)
        else:
            fd = os.open(os.path.join(path, marker[0]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
            try:
                os.write(fd, marker[1].encode())
            finally:
                os.close(fd)
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
    results folder ``root``, or the one holding it and every other folder written; and, by what they hold, the
    files a user opens (``add(..., what=)``), listed above the closing line (``listing``)."""

    PROGRESS_AFTER = 2.0  # seconds of writing before a progress bar appears: short runs never show one
    PROGRESS_EVERY = 0.5  # seconds between redraws: a clock read per file, a redraw twice a second

    def __init__(self, root: str | None = None, label: str = "") -> None:
        self.files = 0
        self.bytes = 0
        self._folders: set[str] = {os.path.abspath(root)} if root else set()
        self.named: list[tuple[str, str]] = []  # (what it holds, path): the files listed by name
        self._lock = threading.Lock()
        # with a label: a progress bar (progress_bar's conditions) once writing lasts; OP_TOOLS_PROGRESS read now
        self._label = label if label and PROGRESS.read() else ""
        self._next_draw = time.monotonic() + self.PROGRESS_AFTER
        self._bar = None

    def add(self, path: str, size: int, what: str = "") -> int:
        """Count a file written (``size`` bytes); with ``what`` (``summary``, ``trace``), one named in ``listing``."""
        with self._lock:
            self.files += 1
            self.bytes += size
            self._folders.add(os.path.dirname(path))  # made absolute in folder(): a file costs ~1 µs here
            if what:
                self.named.append((what, path))
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

    def name(self, path: str, what: str) -> None:
        """Name ``path`` (a folder of files already counted) in ``listing`` as holding ``what``."""
        with self._lock:
            self.named.append((what, path))

    def folder(self) -> str:
        """The folder holding every file written, as the console shows it (``reporting.shown_path``); '' for none."""
        if not self.files:
            return ""
        with self._lock:
            folder = os.path.commonpath(sorted({os.path.abspath(f) for f in self._folders}))
        return shown_path(folder)

    def describe(self) -> str:
        """``wrote 12 files (3.4 MB) in <folder>``, or ``wrote no file``."""
        if not self.files:
            return "wrote no file"
        return f"wrote {self.files} file{'s' if self.files != 1 else ''} ({human_size(self.bytes)}) in {self.folder()}"

    def listing(self, tool: str) -> str:
        """The folder whole and the named files in it (``reporting.files_text``); '' where no file was written."""
        if not self.files:
            return ""
        with self._lock:
            named = list(self.named)
        return files_text(tool, self.folder(), named)


def human_size(size: float) -> str:
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
        binary = "b" in mode
        with os.fdopen(fd, mode, newline=None if binary else "", encoding=None if binary else "utf-8") as f:
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

    A write that fails is logged (with the file it was writing) and counted (``failed``, ``first_failure``: a
    tool's verdict says what it lost), and the others go on.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.failed = 0
        self.first_failure = ""  # "<file>: <error>"
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
            except Exception as error:  # noqa: BLE001 - one file lost is reported, the others are still written
                logger.exception("%s: writing %s failed", self.name, what)
                self.failed += 1  # this thread alone writes it
                if not self.first_failure:
                    self.first_failure = f"{what}: {type(error).__name__}: {error}"
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


def append_csv(path: str, rows: list[dict], columns: tuple[str, ...]) -> int:
    """Append ``rows`` to the CSV at ``path``, its header first when the file is new; return the bytes added. Not
    atomic, by design: a file written as a run goes, so that a run that dies keeps the rows written before (each
    call adds whole lines and flushes them)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a", newline="", encoding="utf-8") as f:
        start = f.tell()
        writer = csv.DictWriter(f, fieldnames=list(columns))
        if start == 0:
            writer.writeheader()
        writer.writerows(rows)
        f.flush()
        return f.tell() - start


def write_text(path: str, text: str) -> int:
    return write_atomic(path, lambda f: f.write(text))


# One encoder for every line, without the check for an object inside itself: a run recording writes a line per call.
# Standard JSON, which has no number for NaN nor the infinities: a line holding one is made again (json_line).
_LINE = json.JSONEncoder(separators=(",", ":"), default=str, check_circular=False, allow_nan=False)


def json_number(value: float) -> float | str:
    """``value`` as standard JSON holds it: NaN and the infinities as the strings JavaScript's ``Number()`` and
    Python's ``float()`` read (``"NaN"``, ``"Infinity"``, ``"-Infinity"``); the readers of our files take them back."""
    if math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"


def json_float(value) -> float:
    """A number as ``json_number`` wrote it (or a bare NaN, as files written before did), as a float; a
    ``ValueError`` for anything else."""
    if isinstance(value, str) and value in ("NaN", "Infinity", "-Infinity"):
        return float(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise ValueError(f"{value!r} is not a number")


def _json_numbers(obj):
    if isinstance(obj, float):
        return json_number(obj)
    if isinstance(obj, dict):
        return {k: _json_numbers(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_numbers(v) for v in obj]
    return obj


def json_line(obj) -> str:
    """``obj`` (a tree: no object inside itself) as the text of one standard JSON line, ASCII, without its newline:
    a NaN or an infinity in it as ``json_number`` writes it."""
    try:
        return _LINE.encode(obj)
    except ValueError:  # a non-finite float (rare): walked only then, so that a line per call costs no more
        return _LINE.encode(_json_numbers(obj))


class JsonLinesFile:
    """A JSON-lines file written as a run goes, one object a line, safe across threads.

    It is ``<path>.partial`` until ``close()`` moves it to ``path``: a run that dies leaves a partial file whose
    complete lines still read. Lines wait in the file's buffer until ``flush()``, which its writer calls when the
    lines it has matter to a reader after a kill (SIGKILL, the OOM killer): the run recording and the replica
    fingerprints once a step, the monitor's anomalies each line.
    """

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        self.partial = path + ".partial"
        self.bytes_written = 0
        self._lock = threading.RLock()  # re-entrant: a SIGTERM flush may close it while the main thread writes
        self._file: TextIO | None = open(self.partial, "w", encoding="utf-8")  # noqa: SIM115 - closed by close()

    def write(self, obj) -> int:
        """Append ``obj`` (a tree: no object inside itself) as one line; return its size in bytes."""
        return self.write_line(json_line(obj))

    def write_line(self, text: str) -> int:
        """Append ``text``, one JSON value's ASCII text (``json_line``'s), as one line; return its size in bytes."""
        line = text + "\n"
        size = len(line)  # ASCII: the encoder escapes every other character
        with self._lock:
            if self._file is None:
                raise ValueError(f"{self.path} is closed")
            self._file.write(line)
            self.bytes_written += size
        return size

    def flush(self) -> None:
        """Hand the lines written so far to the system (they outlive the process); nothing once closed."""
        with self._lock:
            if self._file is not None:
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is None:
                return
            self._file.close()
            self._file = None
            os.replace(self.partial, self.path)
