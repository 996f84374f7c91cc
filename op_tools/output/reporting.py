"""The messages of op_tools: log records and prettytables, progress bars, source locations (files: ``result_files``).

Every message goes through ``logging``: logger ``op_tools`` and one child per tool (``op_tools.autocompare``,
``op_tools.capture``, ...), with the original ditorch's tables as the text. Levels: failures WARNING, summaries
and each tool's closing line INFO, per-call tables and ``apply <hook> on <op>`` lines DEBUG. ``OP_TOOLS_VERBOSE``
sets the ``op_tools`` logger's level (1: DEBUG, 0: INFO; unset: INFO unless the application set one).

While the application configured no handler that would take these records, op_tools' own handler writes them to
stdout in the original's plain form (no prefix; under torchrun each line starts with ``[rank<N>] ``, and
``OP_TOOLS_PRINT_RANKS`` chooses the ranks whose INFO and DEBUG lines are shown); once the application adds one
(``logging.basicConfig()``, a handler on ``op_tools``), op_tools' handler stays silent and the application's
decides. To silence the tools::

    logging.getLogger("op_tools").setLevel(logging.WARNING)   # failures only
    logging.getLogger("op_tools").setLevel(logging.CRITICAL)  # nothing

Files are ``result_files``'.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading

import torch
from prettytable import PrettyTable

from ..config.variables import PROGRESS
from ..ops.arguments import iter_items

logger = logging.getLogger("op_tools")

CONSOLE_WIDTH = 120  # console tables fit a terminal this wide; files keep every cell whole
FIRST_COLUMN_KEPT = 32  # characters of a console table's first column (the row's name) kept before others shrink
ARG_COLUMNS = ("name", "device", "dtype", "numel", "shape", "stride", "requires_grad", "layout", "data_ptr", "value")
CONSOLE_ARG_COLUMNS = ("name", "device", "dtype", "shape", "stride", "requires_grad", "value")  # fit 120 columns
_VALUE_WIDTH = 60
_print_lock = threading.RLock()  # re-entrant: a SIGTERM flush may print while the main thread holds it


# --- logging ---

class RankFormatter(logging.Formatter):
    """The message as it is; under torchrun (``rank`` set) every line of it, a table's and a traceback's included,
    starts with ``[rank<N>] ``."""

    def __init__(self, rank: int | None = None) -> None:
        super().__init__("%(message)s")
        self.prefix = "" if rank is None else f"[rank{rank}] "

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if not self.prefix:
            return text
        return "\n".join(self.prefix + line for line in text.split("\n"))


class ConsoleHandler(logging.StreamHandler):
    """op_tools' own handler: records as plain lines on the current ``sys.stdout`` (the original's console form),
    only while no other handler would take them (the application's configuration wins, with no duplicate).

    Under torchrun its lines carry the rank (``RankFormatter``); a rank not in ``print_ranks`` (``None``: every
    rank) shows WARNING and above only, so that a failure on any rank is never silent."""

    def __init__(self, rank: int | None = None, print_ranks: frozenset[int] | None = None) -> None:
        super().__init__(sys.stdout)
        self.set_rank(rank, print_ranks)
        self.addFilter(self._no_other_handler)
        self.addFilter(self._rank_shown)

    def set_rank(self, rank: int | None, print_ranks: frozenset[int] | None) -> None:
        """The rank this process prints as (``None`` outside torchrun) and the ranks whose INFO/DEBUG show."""
        self.setFormatter(RankFormatter(rank))
        self._quiet = rank is not None and print_ranks is not None and rank not in print_ranks

    def _rank_shown(self, record: logging.LogRecord) -> bool:
        return not self._quiet or record.levelno >= logging.WARNING

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


def configure_logging(verbose: bool | None, rank: int | None = None,
                      print_ranks: frozenset[int] | None = None) -> None:
    """At a tool's start: op_tools' handler on the ``op_tools`` logger (once), labelled with ``rank`` (torchrun's;
    ``None`` outside torchrun) and quiet below WARNING on ranks not in ``print_ranks`` (``OP_TOOLS_PRINT_RANKS``;
    ``None``: all), and the logger's level from ``OP_TOOLS_VERBOSE`` (1: DEBUG, 0: INFO); unset, INFO unless the
    application already set a level."""
    with _handler_lock:
        handler = next((h for h in logger.handlers if isinstance(h, ConsoleHandler)), None)
        if handler is None:
            logger.addHandler(ConsoleHandler(rank, print_ranks))
        else:
            handler.set_rank(rank, print_ranks)
        # setLevel clears every logger's level cache (transformers has hundreds): only when the level changes
        if verbose is not None and logger.level != (logging.DEBUG if verbose else logging.INFO):
            logger.setLevel(logging.DEBUG if verbose else logging.INFO)
        elif verbose is None and logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)


@functools.cache
def tool_logger(cls: type) -> logging.Logger:
    """``op_tools.<module name>`` for op_tools' own tools (``op_tools.autocompare``), ``op_tools.<class>`` otherwise."""
    module = cls.__module__
    # op_tools.tools.autocompare -> op_tools.autocompare: the names from before the layer folders (documented)
    return logging.getLogger(f"op_tools.{module.rpartition('.')[2]}" if module.startswith("op_tools.")
                             else f"op_tools.{cls.__name__}")


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
    for line in cells:
        result.add_row(line)
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

_SKIPPED_DIRS = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.dirname(__file__)) + os.sep)


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
