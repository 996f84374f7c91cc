"""The messages of op_tools: log records and prettytables, progress bars, source locations (files: ``result_files``).

Every message goes through ``logging``: logger ``op_tools`` and one child per tool (``op_tools.autocompare``,
``op_tools.capture``, ...), with the original ditorch's tables as the text. Levels: failures WARNING, summaries
and each tool's closing line INFO, per-call tables and ``apply <hook> on <op>`` lines DEBUG. ``OP_TOOLS_VERBOSE``
sets the ``op_tools`` logger's level (1: DEBUG, 0: INFO; unset: INFO unless the application set one).

While the application configured no handler that would take these records, op_tools' own handler writes them to
stdout in the original's plain form (no prefix; under torchrun each line starts with ``[rank<N>] ``, and
``OP_TOOLS_PRINT_RANKS`` chooses the ranks whose INFO and DEBUG lines are shown); once the application adds one
(``logging.basicConfig()``, a handler on ``op_tools``), op_tools' handler stays silent and the application's
decides; under torchrun the records reach it with their ``[rank<N>] `` labels. To silence the tools::

    logging.getLogger("op_tools").setLevel(logging.WARNING)   # failures only
    logging.getLogger("op_tools").setLevel(logging.CRITICAL)  # nothing

Files are ``result_files``'.
"""

from __future__ import annotations

import dataclasses
import functools
import linecache
import logging
import os
import re
import sys
import threading
from types import FrameType
from typing import Callable

import torch
from prettytable import PrettyTable

from ..config.variables import MIN_TABLE_WIDTH, PROGRESS, TABLE_WIDTH, TERMINAL_WIDTH
from ..ops.arguments import iter_items

logger = logging.getLogger("op_tools")

CONSOLE_WIDTH = 100  # console lines' width where stdout and stderr are no terminal; files keep every cell whole
FIRST_COLUMN_KEPT = 32  # characters of a console table's first column (the row's name) kept before others shrink
MODULE_KEPT = 16  # characters of a module path kept before other columns shrink: …layers.1…act_fn fits
SHORT_CELL = 8  # cells this short (forward, backward, an index) stay whole while a kept column can give way
NUMBER_KEPT = 5  # characters of a number kept while text gives way: 3 significant digits (0.215)
ARG_COLUMNS = ("name", "device", "dtype", "numel", "shape", "stride", "requires_grad", "layout", "data_ptr", "value")
CONSOLE_ARG_COLUMNS = ("name", "device", "dtype", "shape", "stride", "requires_grad", "value")  # fit 100 columns
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
        self._labels = RankFormatter(rank)
        self.setFormatter(self._labels)
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
                self._label(record)
                return False
            if not current.propagate:
                break
            current = current.parent
        return True

    def _label(self, record: logging.LogRecord) -> None:
        """Under torchrun, the record's lines labelled with the rank for the application's handlers (its
        ``logging.basicConfig()``), which this handler, on the ``op_tools`` logger, comes before: without the label
        two ranks print identical lines."""
        if self._labels.prefix and not getattr(record, "op_tools_labelled", False):
            record.msg, record.args = self._labels.format(record), None
            record.exc_info = record.exc_text = record.stack_info = None  # formatted into the message
            record.op_tools_labelled = True


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


# --- result paths and closing lines ---

def shown_path(path: str) -> str:
    """``path`` relative to the working directory when it lies below it, else absolute: as short as it is exact."""
    absolute = os.path.abspath(path)
    relative = os.path.relpath(absolute)
    return absolute if relative.startswith("..") else relative


def shorten_path(path: str, width: int) -> str:
    """``path`` in ``width`` characters by leaving out its first folders (``…/results/op_capture_results``); its last
    name stays whole, however long."""
    if len(path) <= width:
        return path
    parts = path.split(os.sep)
    kept = parts[-1]
    for part in reversed(parts[:-1]):
        if len(f"…{os.sep}{part}{os.sep}{kept}") > width:
            break
        kept = f"{part}{os.sep}{kept}"
    return f"…{os.sep}{kept}"


def fit_path(line: str, path: str, width: int | None = None) -> str:
    """``line``, which names ``path`` (after a space), in ``width`` characters (default: ``console_width()``;
    ``None``: unchanged): on one line, its path shortened from the start as little as makes it fit; where its other
    words alone pass the width, wrapped at its clauses (``fit_line``), the path shortened as little as lets a line
    hold it with the word before it (``in``; else the path alone). A closing line names its results folder so;
    where it is not whole, the lines above it name the folder whole (``files_text``)::

        >>> print(fit_path("OpCapture: 9 calls of 2 ops handled; wrote 3 files in runs/2026/op_capture_results",
        ...                "runs/2026/op_capture_results", 75))
        OpCapture: 9 calls of 2 ops handled; wrote 3 files in …/op_capture_results
    """
    width = console_width() if width is None else width
    if width is None or len(line) <= width:
        return line
    if not path or f" {path}" not in line:
        return fit_line(line, width)
    before = line[:line.index(f" {path}")].rpartition(" ")[2]  # the word naming it: "in", "under"
    forms = _path_forms(path)
    named = [line.replace(f" {path}", f" {form}", 1) for form in forms]
    for text in named:
        if len(text) <= width:
            return text
    wrapped = [fit_line(text, width).split("\n") for text in named]
    for word in (f"{before} ", ""):  # with the word before it first: a line ending "in" reads badly
        for form, lines in zip(forms, wrapped):
            if any(word + form in part and len(part) <= width for part in lines):
                return "\n".join(lines)
    return "\n".join(wrapped[-1])


def _path_forms(path: str) -> list[str]:
    """``path``, then shorter by each of its first folders left out (``…/results/op_capture_results``), to its last
    name (``shorten_path``'s forms, longest first)."""
    parts = path.split(os.sep)
    forms = [path]
    for i in range(1, len(parts)):
        form = f"…{os.sep}{os.sep.join(parts[i:])}"
        if len(form) < len(forms[-1]):
            forms.append(form)
    return forms


# --- console lines: one too long for the width wrapped at its clauses ---

CONTINUATION = "  "  # a wrapped line's continuation lines start with its own indent and these two spaces more
_BREAKS = ("; ", ", ", " ")  # where a long line breaks: after a clause, then after a part of one, then a word


def fit_line(text: str, width: int | None = None) -> str:
    """``text`` with each of its lines longer than ``width`` (default: ``console_width()``; ``None``: full width,
    ``text`` unchanged) wrapped onto continuation lines, indented two spaces more than it: broken after a ``;``
    where a clause fits a line, else after a ``,``, else between words; a word longer than a line (a path) stays
    whole. Nothing is left out or added, the line's first words stay first (a closing line's verdict), and
    ``unwrapped`` joins the line back::

        >>> print(fit_line("OpCapture: 9 calls of 2 ops handled; wrote 3 files (1.2 KB) in results; "
        ...                "4 calls past 2 per op (OP_CAPTURE_MAX_CALLS_PER_OP) not saved", 80))
        OpCapture: 9 calls of 2 ops handled; wrote 3 files (1.2 KB) in results;
          4 calls past 2 per op (OP_CAPTURE_MAX_CALLS_PER_OP) not saved
    """
    width = console_width() if width is None else width
    if width is None:
        return text
    return "\n".join("\n".join(_wrapped_lines(line, width)) for line in text.split("\n"))


def unwrapped(text: str) -> str:
    """A line ``fit_line`` wrapped, joined back (its continuation lines: those starting with ``CONTINUATION`` more
    than its first): what it was before."""
    indent = text[:len(text) - len(text.lstrip(" "))]
    return text.replace("\n" + indent + CONTINUATION, " ")


def _wrapped_lines(line: str, width: int) -> list[str]:
    """``line`` as lines within ``width``, broken at ``_BREAKS`` (the coarsest that fits first), greedily."""
    if len(line) <= width:
        return [line]
    body = line.lstrip(" ")
    indent = line[:len(line) - len(body)]
    continuation = indent + CONTINUATION
    lines = [indent]
    started = False  # whether the last line holds a piece yet
    broken = False  # whether the last clause was broken over lines: the next starts a line of its own

    def place(piece: str, level: int) -> None:
        nonlocal started, broken
        after_broken, broken = broken and level == 0, broken and level > 0
        joined = lines[-1] + (" " if started else "") + piece
        if len(joined) <= width and not after_broken:
            lines[-1], started = joined, True
            return
        if started and len(continuation + piece) <= width:  # whole, on a line of its own
            lines.append(continuation + piece)
            return
        if started:  # broken or too long, it starts a line: a clause is read from its start
            lines.append(continuation)
            started = False
        for finer in range(level + 1, len(_BREAKS)):
            pieces = _pieces(piece, finer)
            if len(pieces) > 1:
                for part in pieces:
                    place(part, finer)
                broken = broken or level == 0
                return
        lines[-1], started = lines[-1] + piece, True  # a word longer than a line (a path): whole, passing it

    for piece in _pieces(body, 0):
        place(piece, 0)
    return lines


def _pieces(text: str, level: int) -> list[str]:
    """``text`` split at ``_BREAKS[level]``, clauses outside brackets only (a clause's ``(... in all; the largest:
    ...)`` stays whole), each piece but the last keeping the mark before the space (``;``, ``,``): joined by
    spaces, they are ``text`` again."""
    separator = _BREAKS[level]
    if separator == " ":  # words: a bracket's words too, where its clause is longer than a line
        return text.split(" ")
    pieces, start, depth = [], 0, 0
    for i, char in enumerate(text):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth = max(depth - 1, 0)
        elif depth == 0 and text.startswith(separator, i) and i >= start:
            pieces.append(text[start:i + len(separator) - 1])
            start = i + len(separator)
    return pieces + [text[start:]]


def files_text(tool: str, folder: str, files: list[tuple[str, str]], width: int | None = None) -> str:
    """``folder`` whole, and the files in it a user opens (``(what, path)`` each), a line each, named from the
    folder: the lines above a closing line, which names the folder only, shortened when long. Lines longer than
    ``width`` (default: ``console_width()``) are wrapped (``fit_line``): a folder too long for the first line goes
    on the next, whole::

        OpTimeMeasure results in op_tools_results/op_time_measure_result:
          summary: op_elasped_summary_pid1234_2026-11-28-08-29-12_1.csv
    """
    lines = [f"{tool} results in {folder}" + (":" if files else "")]
    lines += [f"  {what}: {os.path.relpath(os.path.abspath(path), os.path.abspath(folder))}" for what, path in files]
    return fit_line("\n".join(lines), width)


# --- tables ---

_UNRESOLVED = -1
_console_width: int | None = _UNRESOLVED  # set at each tool's start; None: full width


def terminal_width() -> int:
    """The columns of the terminal that stdout or stderr writes to (``COLUMNS`` first, as for
    ``shutil.get_terminal_size``), at least ``MIN_TABLE_WIDTH``; ``CONSOLE_WIDTH`` when neither is a terminal (a
    file, a pipe, a CI log)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if not stream.isatty():
                continue
            columns = int(os.environ.get("COLUMNS") or 0) or os.get_terminal_size(stream.fileno()).columns
        except (AttributeError, ValueError, OSError):  # a replaced stream (pytest's, a StringIO), a bad COLUMNS
            continue
        if columns > 0:  # a pseudo-terminal nobody sized says 0
            return max(columns, MIN_TABLE_WIDTH)
    return CONSOLE_WIDTH


def configure_tables(width: int | None, rank: int | None = None) -> None:
    """At a tool's start: the width console lines fit from now on, ``CommonConfig.table_width`` (the parsed
    ``OP_TOOLS_TABLE_WIDTH``): ``TERMINAL_WIDTH`` for the terminal's, read now; ``None`` for whole cells. Under
    torchrun (``rank`` set) the ``[rank<N>] `` label every line starts with is taken from it."""
    global _console_width
    columns = terminal_width() if width == TERMINAL_WIDTH else width
    label = len(RankFormatter(rank).prefix)
    _console_width = None if columns is None else max(columns - label, MIN_TABLE_WIDTH)


def console_width() -> int | None:
    """The width console tables and closing lines fit (``None``: whole cells). Where no tool started (the
    command-line tools), read from ``OP_TOOLS_TABLE_WIDTH`` and the terminal at the first table."""
    if _console_width == _UNRESOLVED:
        configure_tables(TABLE_WIDTH.read())
    return _console_width


def table(rows: list[dict], columns: tuple[str, ...] | None = None, width: int | None = None,
          keep: str | None = None) -> PrettyTable:
    """A prettytable of ``rows`` (dicts); columns default to the keys in first-seen order. With ``width``, the
    longest cells are shortened (``…`` where text was left out, each column in its own way: ``COLUMN_FORMS``) until
    the table fits that many characters, if it can with whole column names; column ``keep`` (default: the first,
    which names the row) keeps ``FIRST_COLUMN_KEPT`` characters longest, unless it holds dotted names (ops,
    module paths), which give way first (``_give_way``): ``table_text`` writes them whole under the table."""
    columns, cells = _cells(rows, columns)
    if width is not None:
        cells = _fit(columns, cells, width, columns.index(keep) if keep in columns else 0)
    return _pretty(columns, cells)


def table_text(rows: list[dict], columns: tuple[str, ...] | None = None, width: int | None = None,
               keep: str | None = None) -> str:
    """``table(...)`` as text fitting ``width`` characters (default: ``console_width()``, set at the tool's start
    from ``OP_TOOLS_TABLE_WIDTH`` or the terminal): the console's form. Console tables list the columns that tell
    the story (``CONSOLE_ARG_COLUMNS``, ...); the files keep every column and every cell whole. A name (a module
    path, an op) shortened to fit is written whole under the table, on a line of its own naming its rows::

        [2] module: model.layers.1.mlp.act_fn
        [1,2] op: torch.nn.functional.scaled_dot_product_attention
    """
    columns, cells = _cells(rows, columns)
    width = console_width() if width is None else width
    if width is None:
        return _pretty(columns, cells).get_string()
    shown = _fit(columns, cells, width, columns.index(keep) if keep in columns else 0)
    return "\n".join([_pretty(columns, shown).get_string(), *_whole_names(columns, cells, shown)])


def _cells(rows: list[dict], columns: tuple[str, ...] | None) -> tuple[tuple[str, ...], list[list[str]]]:
    """The columns (default: the keys in first-seen order) and each row's cells as text."""
    if columns is None:
        seen: dict[str, None] = {}
        for row in rows:
            seen.update(dict.fromkeys(row))
        columns = tuple(seen)
    return columns, [[_cell(row.get(c, "")) for c in columns] for row in rows]


def _pretty(columns: tuple[str, ...], cells: list[list[str]]) -> PrettyTable:
    result = PrettyTable()
    result.field_names = list(columns)
    for line in cells:
        result.add_row(line)
    return result


def _whole_names(columns: tuple[str, ...], cells: list[list[str]], shown: list[list[str]]) -> list[str]:
    """``  [<rows>] <column>: <name>`` for each name (a dotted path) that fitting the table shortened: the rows (from
    1) and the column it is in, and the name whole, so that no module or op is known only by its shortened form."""
    rows: dict[tuple[str, str], list[str]] = {}  # (column, name) -> its rows, in the order the table shows them
    for number, (whole, fitted) in enumerate(zip(cells, shown), 1):
        for column, cell, short in zip(columns, whole, fitted):
            if cell != short and COLUMN_FORMS.get(column, CELL).names:
                for line, cut in zip(cell.split("\n"), short.split("\n")):
                    if line != cut and _DOTTED.fullmatch(line):
                        rows.setdefault((column, line), []).append(str(number))
    return [f"  [{','.join(numbers)}] {column}: {name}" for (column, name), numbers in rows.items()]


def call_table(op: str, rows: list[dict], columns: tuple[str, ...] = CONSOLE_ARG_COLUMNS) -> str:
    """The console table of one call's values: the header line above it names the op, so the cells name only the
    value (``inputs[0]``, ``cpu_outputs[0]``, ``[alpha]``) where the original repeated the op in each."""
    prefix = op + " "
    shown = [{**row, "name": row["name"].removeprefix(prefix)} if isinstance(row.get("name"), str) else row
             for row in rows]
    return table_text(shown, columns)


def _fit(names, cells: list[list[str]], width: int, kept: int = 0) -> list[list[str]]:
    """Cap the cells of every column at one width (a column whose form takes a smaller share: that share of it),
    the largest that makes the table fit, never below the column's floor: the whole of a short cell
    (``SHORT_CELL``), what its form keeps (``ColumnForm.kept``, column ``kept``, which names the row:
    ``FIRST_COLUMN_KEPT``) and its cells' leads (``ColumnForm.lead``: a verdict's first clause, a file's name
    and line). Where the floors add up to more than the width holds, they give way (``_give_way``). Only the
    longest cells are shortened, each line of a cell on its own."""
    forms = [COLUMN_FORMS.get(name, CELL) for name in names]
    room = width - 3 * len(names) - 1  # "| " and " |" around each cell, "|" between
    headers = [len(n) for n in names]
    columns_in = [[row[i] for row in cells] for i in range(len(names))]
    natural = [max([header, *map(_longest_line, column)]) for header, column in zip(headers, columns_in)]
    if sum(natural) <= room:
        return cells
    floors = [min(w, max(h, SHORT_CELL, FIRST_COLUMN_KEPT if i == kept else form.kept,
                         *(form.lead(line) for cell in column for line in cell.split("\n"))))
              for i, (w, h, form, column) in enumerate(zip(natural, headers, forms, columns_in))]
    _give_way(floors, headers, natural, columns_in, forms, room, kept)

    def caps_at(cap: int) -> list[int]:
        return [min(w, max(int(cap * form.share), f)) for w, f, form in zip(natural, floors, forms)]

    cap, widest = 3, max(w / form.share for w, form in zip(natural, forms))
    while cap < widest and sum(caps_at(cap + 1)) <= room:
        cap += 1
    caps = caps_at(cap)
    columns = [_shorten_column(forms[i], columns_in[i], limit) for i, limit in enumerate(caps)]
    # A form that leaves out whole words or names can leave its cap partly unused: that room goes to the columns
    # still cut, first those that left the most (their next word may fit now), then the row's name.
    used = [max(len(name), *map(_longest_line, column)) for name, column in zip(names, columns)]
    spare = room - sum(used)
    for i in sorted(range(len(names)), key=lambda i: (used[i] - caps[i], i != kept, not forms[i].names, i)):
        if spare > 0 and used[i] < natural[i]:
            columns[i] = _shorten_column(forms[i], columns_in[i], used[i] + spare)
            spare += used[i] - max(len(names[i]), *map(_longest_line, columns[i]))
    return [list(row) for row in zip(*columns)]


def _give_way(floors: list[int], headers: list[int], natural: list[int], columns: list[list[str]],
              forms: list[ColumnForm], room: int, kept: int) -> None:
    """Lower ``floors`` (in place) until they fit ``room``, a character at a time, what is least missed first: the
    columns of names written whole under the table (``_whole_names``), the widest first, to their last names
    (``…gelu``; ``SHORT_CELL`` at most) or what their form keeps (a module path's index); numbers, to
    ``NUMBER_KEPT`` characters; the other columns' leads, the largest for its share first (a location before a
    verdict) and column ``kept`` last, to ``SHORT_CELL``; then the names, and last every column, to its header."""
    def lines(i: int) -> list[str]:
        return [line for cell in columns[i] if cell for line in cell.split("\n")]

    def lower(candidates: list[int], least: Callable[[int], int], first: Callable[[int], tuple]) -> None:
        while sum(floors) > room:
            lowered = [i for i in candidates if floors[i] > least(i)]
            if not lowered:
                return
            floors[max(lowered, key=first)] -= 1

    names = [i for i, form in enumerate(forms)
             if form.names and lines(i) and all(_DOTTED.fullmatch(line) for line in lines(i))]
    numbers = [i for i in range(len(floors))
               if i not in names and lines(i) and all(_NUMBER.fullmatch(line) for line in lines(i))]
    others = [i for i in range(len(floors)) if i not in names]
    last_names = {i: max(headers[i], min(natural[i], forms[i].kept),  # a module path keeps its layer's index
                         min(SHORT_CELL, max(len("…" + line.rpartition(".")[2]) for line in lines(i))))
                  for i in names}
    lower(names, last_names.__getitem__, lambda i: (floors[i],))
    lower(numbers, lambda i: max(headers[i], min(natural[i], NUMBER_KEPT)), lambda i: (natural[i],))
    lower(others, lambda i: max(headers[i], min(natural[i], SHORT_CELL)),
          lambda i: (i != kept, floors[i] / forms[i].share, natural[i]))
    lower(names, headers.__getitem__, lambda i: (floors[i],))
    lower(others, headers.__getitem__, lambda i: (i != kept, natural[i]))


def _shorten_column(form: ColumnForm, column: list[str], width: int) -> list[str]:
    """A column's cells in ``width`` characters, each line of a cell on its own."""
    return ["\n".join(form.shorten(line, width) for line in cell.split("\n")) for cell in column]


def _longest_line(text: str) -> int:
    return max(len(line) for line in text.split("\n"))


# --- shortening a cell: each keeps what tells most and says with "…" where text was left out ---

def shorten_middle(text: str, width: int) -> str:
    """Both ends of ``text`` in ``width`` characters, ``…`` for its middle."""
    if len(text) <= width:
        return text
    head = width // 2
    return text[:head] + "…" + text[len(text) - (width - 1 - head):]


_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?(?:inf|nan)")


def shorten_number(text: str, width: int) -> str:
    """A number with as many significant digits as fit (``0.00328157139`` -> ``0.00328``), never cut."""
    if len(text) <= width:
        return text
    value = float(text)
    for digits in range(6, 0, -1):
        rounded = f"{value:.{digits}g}"
        if len(rounded) <= width:
            return rounded
    return shorten_middle(text, width)


def shorten_words(text: str, width: int) -> str:
    """Every word, its dotted names by their last name (``torch.float16 -> torch.float32`` -> ``…float16 ->
    …float32``), where that fits; else whole words: as many from the start as fit, then from the end, `` … `` for
    those between (the start tells most: ``error 0.019 > 1 eps …``); the middle of the text where its first word
    alone does not fit."""
    if len(text) <= width:
        return text
    words = text.split(" ")
    lasts = " ".join("…" + word.rpartition(".")[2] if _DOTTED.fullmatch(word) else word for word in words)
    if len(lasts) <= width:
        return lasts

    def joined(head: int, tail: int) -> str:
        return " ".join([*words[:head], "…", *words[len(words) - tail:]])

    head = tail = 0
    while head < len(words) - 1 and len(joined(head + 1, 0)) <= width:
        head += 1
    while head and head + tail < len(words) - 1 and len(joined(head, tail + 1)) <= width:
        tail += 1
    return joined(head, tail) if head else shorten_middle(text, width)


_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.\w+)+")


def shorten_dotted(text: str, width: int) -> str:
    """A dotted path (a module path, an op name) in ``width`` characters, whole names left out: first those that
    name neither an index nor the end (the middle ones first), then the root, then the names of indexed containers
    (``layers``); indices and the last name stay: ``model.layers.1.mlp.act_fn`` -> ``model.layers.1…act_fn``,
    ``…layers.1…act_fn``, ``…1…act_fn``; narrower, the last name alone. Other text: ``shorten_words``."""
    if len(text) <= width:
        return text
    if not _DOTTED.fullmatch(text):
        return shorten_words(text, width)
    parts = text.split(".")
    last = len(parts) - 1

    def rank(i: int) -> int | None:  # the order names are left out in; None: never
        if parts[i].isdigit() or i == last:
            return None
        if parts[i + 1].isdigit():
            return 2
        return 1 if i == 0 else 0

    order = sorted((r, abs(i - last / 2), i) for i in range(last) if (r := rank(i)) is not None)
    kept = [True] * len(parts)
    shortened = text
    for _, _, i in order:
        kept[i] = False
        shortened = _join_kept(parts, kept)
        if len(shortened) <= width:
            return shortened
    return "…" + shorten_middle(parts[last], width - 1)  # no index at all rather than a cut one


def _join_kept(parts: list[str], kept: list[bool]) -> str:
    """The kept names joined by ``.``, with ``…`` where names were left out."""
    out, gap = "", False
    for part, keep in zip(parts, kept):
        if keep:
            out += ("…" if gap else "." if out else "") + part
        gap = not keep
    return out


_LOCATION = re.compile(r"(?P<file>[^\s:]+):(?P<line>\d+)(?P<rest>.*)")


def shorten_location(text: str, width: int) -> str:
    """``file:line function: code`` in ``width`` characters: the file's folders go first
    (``…/activations.py:103 forward: return …``), then the code's last words; the file's name and line stay while
    they fit."""
    if len(text) <= width:
        return text
    match = _LOCATION.fullmatch(text)
    if match is None:
        return shorten_words(text, width)
    path, line, rest = match.group("file", "line", "rest")
    name = os.path.basename(path)
    place = ("" if name == path else "…" + os.sep) + f"{name}:{line}"
    if len(place) > width:
        return "…" + place[len(place) - width + 1:]
    return shorten_words(place + rest, width)


_SIZE = re.compile(r"torch\.Size\((\[[^\]]*\])\)")
_COMMA_SPACE = re.compile(r",\s+")
_NEXT_VALUE = re.compile(r" (?=(?:\[[^\]\s]*\])+:)")  # the space before a value's label: [1]:, [0][2]:
_NUMBER_LIST = re.compile(r"([\[(])([^\[\]()]*,[^\[\]()]*)([\])])")


def shorten_values(text: str, width: int) -> str:
    """Shapes, strides or dtypes (``torch.Size([4, 16, 64])``; summary capture's ``[0]:[4, 16, 64] [1]:[64]``) in
    ``width`` characters, never cutting a number: the spaces after commas go first, then the last values
    (``…+2`` says how many), then the middle numbers of the one left (``[0]:[4,16,…,32]``, ``[0]:[4…32]``), then
    all of it (``…``)."""
    if len(text) <= width:
        return text
    tight = _COMMA_SPACE.sub(",", _SIZE.sub(r"\1", text))
    if len(tight) <= width:
        return tight
    values = _NEXT_VALUE.split(tight)
    for shown in range(len(values) - 1, 0, -1):
        candidate = " ".join(values[:shown]) + f" …+{len(values) - shown}"
        if len(candidate) <= width:
            return candidate
    first, more = values[0], (f" …+{len(values) - 1}" if len(values) > 1 else "")
    lists = list(_NUMBER_LIST.finditer(first))
    if lists:
        longest = max(lists, key=lambda m: len(m.group(2)))
        numbers = longest.group(2).split(",")
        inners = [",".join([*numbers[:(count + 1) // 2], "…", *numbers[len(numbers) - count // 2:]])
                  for count in range(len(numbers) - 1, 1, -1)] + [numbers[0] + "…" + numbers[-1]]
        for tail in dict.fromkeys((more, "…" if more else "")):  # "…+2" while it fits, then a bare "…"
            for inner in inners:
                candidate = first[:longest.start(2)] + inner + first[longest.end(2):] + tail
                if len(candidate) <= width:
                    return candidate
        return "…"
    return shorten_words(tight, width)


def shorten_cell(text: str, width: int) -> str:
    """A cell of a column with no form of its own, by what it holds: a number, a dotted path, words, other text."""
    if len(text) <= width:
        return text
    if _NUMBER.fullmatch(text):
        return shorten_number(text, width)
    if _DOTTED.fullmatch(text):
        return shorten_dotted(text, width)
    return shorten_words(text, width)


LEAD_KEPT = 16  # characters of a text cell's first clause kept before the longest cells shrink: "error 0.0865 > …"
_CLAUSE_END = re.compile(r"[,;] ")


def clause_lead(text: str) -> int:
    """The characters that show ``text``'s first clause (to its first ``,`` or ``;``) as ``shorten_words`` does,
    `` …`` after it where more follows (``FAIL: output, …``), at most ``LEAD_KEPT``: what a cell keeps while the
    longest cells give way."""
    if _NUMBER.fullmatch(text):  # numbers lose digits, not meaning: SHORT_CELL keeps enough
        return 0
    end = _CLAUSE_END.search(text)
    return min(end.end() + 1 if end else len(text), LEAD_KEPT)


def location_lead(text: str) -> int:
    """The characters of a location's file name and line (``…/modeling.py:123 …``): kept while others give way."""
    match = _LOCATION.fullmatch(text)
    if match is None:
        return clause_lead(text)
    name = os.path.basename(match.group("file"))
    place = len(name) + len(match.group("line")) + 1 + (0 if name == match.group("file") else 2)
    return place + (2 if match.group("rest") else 0)


@dataclasses.dataclass(frozen=True)
class ColumnForm:
    """How a column's cells are shortened, how many of their characters stay before other columns shrink (``kept``
    for any cell, ``lead`` for each), and the share of the other columns' width they get when the table must
    shrink."""

    shorten: Callable[[str, int], str]
    kept: int = 0
    share: float = 1.0
    names: bool = False  # its cells may be names (module paths, ops): one shortened is written whole under the table
    lead: Callable[[str], int] = lambda text: 0


CELL = ColumnForm(shorten_cell, names=True, lead=clause_lead)
# The columns whose cells hold one kind of text, by name; others: ``CELL``.
COLUMN_FORMS: dict[str, ColumnForm] = {
    "module": ColumnForm(shorten_dotted, MODULE_KEPT, names=True),
    # the files hold it whole; a header line names it too
    "location": ColumnForm(shorten_location, share=0.5, lead=location_lead),
    **dict.fromkeys(("shape", "stride", "shapes", "strides", "dtypes"), ColumnForm(shorten_values)),
}


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
# Device layers between the user's code and torch (sim's engine runs backward from ditorch/sim): never the user's
# line. Looked up among the loaded modules, not imported: op_tools runs without them.
_DEVICE_LAYERS = ("ditorch", "torch_npu", "torch_mlu")


_is_user: dict[str, bool] = {}  # file name -> whether it lies outside torch, op_tools and the device layers


def _user_file(filename: str) -> bool:
    """Asked once per file name: outside torch, op_tools and the loaded device layers."""
    skipped = list(_SKIPPED_DIRS)
    for name in _DEVICE_LAYERS:
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            skipped.append(os.path.dirname(path) + os.sep)
    return not filename.startswith((*skipped, "<frozen"))


def _user_frames(full_stack: bool) -> tuple:
    """(file, line, function) of the user's frames, innermost first (the innermost only, unless ``full_stack``)."""
    frames = []
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        user = _is_user.get(code.co_filename)
        if user is None:
            user = _is_user[code.co_filename] = _user_file(code.co_filename)
        if user:
            frames.append((code.co_filename, frame.f_lineno, code.co_name))
            if not full_stack:
                break
        frame = frame.f_back
    return tuple(frames)


class Site:
    """Where a call came from, taken cheaply (``user_site``: file, line and function of the user's frames) and
    formatted on first use (``text``, each line read once per process): the engine takes one per handled call that
    has backward hooks, whose user frames are gone by the time they run, and most are never shown."""

    __slots__ = ("_frames", "_text")

    def __init__(self, frames: tuple) -> None:
        self._frames = frames
        self._text: str | None = None

    def key(self) -> tuple:
        """The innermost user frame ``(file, line, function)``, unformatted: a call site to count by."""
        return self._frames[0] if self._frames else ()

    def text(self) -> str:
        """``file:line function: code`` of the innermost frame outside torch, op_tools and the device layers (of all
        such frames, innermost first, one per line, when taken with ``full_stack``)."""
        if self._text is None:
            frames = self._frames
            self._text = "\n".join(_frame_line(*frame) for frame in frames) if frames else "<unknown location>"
        return self._text


def user_site(full_stack: bool = False) -> Site:
    """Where the caller is, for ``Site.text()`` to format when shown."""
    return Site(_user_frames(full_stack))


@functools.lru_cache(maxsize=4096)
def _frame_line(filename: str, lineno: int, function: str) -> str:
    return f"{filename}:{lineno} {function}: {linecache.getline(filename, lineno).strip()}"


def short_location(location: str) -> str:
    """A location line with its file relative to the working directory when it lies below it (for the console)."""
    path, colon, rest = location.partition(":")
    if colon and os.path.isabs(path):
        relative = os.path.relpath(path)
        if not relative.startswith(".."):
            return relative + colon + rest
    return location
