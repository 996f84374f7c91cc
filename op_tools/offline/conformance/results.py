"""What a conformance sweep records: one ``Row`` per op x dtype x direction, and the files that hold them.

``results.jsonl`` is the run's results file: a header line with the run's settings, then one line per
finished op x dtype (its forward and backward rows), appended and flushed as each finishes, so that a
sweep killed at any point loses at most the op it was running and ``--resume`` continues it. The CSV
(one row per op x dtype x direction) is written from it at the end, and read back by ``--compare``.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
from collections.abc import Iterable

STATUSES = ("pass", "mismatch", "unsupported", "crash", "unchecked", "skipped")
DIRECTIONS = ("forward", "backward")
RESULTS_FILE = "results.jsonl"
CSV_FILE = "conformance.csv"
HTML_FILE = "conformance.html"
FORMAT_VERSION = 1


@dataclasses.dataclass
class Row:
    """The verdict on one op in one dtype and one direction (forward or backward)."""

    op: str                      # the OpInfo's full name: "add", "max.reduction_with_dim"
    dtype: str                   # "float32"
    direction: str               # "forward" or "backward"
    status: str                  # one of STATUSES
    samples: int = 0             # samples run in this direction
    failing: int = 0             # of those, how many did not pass
    sample: int | None = None    # the sample shown: the worst mismatch, the first that raised, the one at a crash
    output: str = ""             # the output or gradient compared worst: "output[0]", "input.grad"
    device_error: float = math.nan   # OpAutoCompare's normalised errors (op_tools.numerics.comparison) of that output
    cpu_error: float = math.nan
    error_ratio: float = math.nan
    max_abs_diff: float = math.nan
    detail: str = ""             # the verdict's words, the device's exception, why skipped, how it crashed
    torch_name: str = ""         # the torch operator the OpInfo calls, as the replay names it ("" for a wrapper)
    inputs: str = ""             # the saved inputs (OpCapture's format) of the sample shown, if saved
    reproduce: str = ""          # the command that reruns the sample shown
    seconds: float = 0.0         # the op x dtype's time in the worker (both directions)
    device: str = ""             # the device it ran on: "sim", "cuda", "npu"
    known_gap: str = ""          # why the row is a known gap (known_gaps.py): still its status, not a pass

    @property
    def key(self) -> tuple[str, str, str]:
        return self.op, self.dtype, self.direction

    def to_dict(self) -> dict:
        """The row as strict JSON takes it: a nan or an inf as text (``"nan"``, ``"inf"``), which ``from_dict``
        reads back as the float (JSON has neither; a bare ``NaN`` breaks every reader but Python's)."""
        data = dataclasses.asdict(self)
        for name, value in data.items():
            if isinstance(value, float) and not math.isfinite(value):
                data[name] = str(value)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Row:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values = {}
        for name, value in data.items():
            if name not in fields:
                continue
            values[name] = _typed(fields[name].type, value)  # type: ignore[arg-type]  # postponed annotations: text
        return cls(**values)


def _typed(kind: str, value):
    """A CSV cell (text) or JSON value as the field's type."""
    if kind == "float":
        return math.nan if value in ("", None) else float(value)
    if kind == "int":
        return int(value or 0)
    if kind == "int | None":
        return None if value in ("", None) else int(value)
    return "" if value is None else str(value)


# --- the results file ---

class ResultsFile:
    """``results.jsonl``: a header with the run's settings, then the rows of each finished op x dtype."""

    def __init__(self, path: str) -> None:
        self.path = path

    def start(self, settings: dict) -> None:
        """Begin a new file (replacing one left there) with ``settings`` as its header."""
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "w", encoding="utf-8") as f:
            f.write(json.dumps({"kind": "run", "version": FORMAT_VERSION, **settings}) + "\n")

    def append(self, rows: Iterable[Row]) -> None:
        """Add one op x dtype's rows; on disk before this returns, so a killed sweep keeps them."""
        line = json.dumps({"kind": "rows", "rows": [r.to_dict() for r in rows]}, allow_nan=False)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def read(self) -> tuple[dict, list[Row]]:
        """The header and every row; a last line cut short by a kill is ignored, other damage is a ValueError."""
        header, rows, _ = self._parse()
        return header, rows

    def repair(self) -> None:
        """Cut a last line left incomplete by a kill, so that appending continues the file cleanly."""
        _, _, end = self._parse()
        with open(self.path, "rb+") as f:
            f.truncate(end)

    def _parse(self) -> tuple[dict, list[Row], int]:
        """The header, the rows, and the byte offset after the last complete line."""
        header: dict | None = None
        rows: list[Row] = []
        end = 0
        with open(self.path, "rb") as f:
            data = f.read()
        lines = data.split(b"\n")
        for number, line in enumerate(lines, 1):
            complete = number < len(lines)  # the last piece has no newline after it
            try:
                record = json.loads(line) if line.strip() else None
            except (json.JSONDecodeError, UnicodeDecodeError):
                if not complete:
                    break  # the line being written when the sweep was killed
                raise ValueError(f"{self.path}:{number}: not a results line of a conformance run") from None
            if not complete:
                break  # whole JSON but no newline yet: written again on resume
            end += len(line) + 1
            if record is None:
                continue
            if record.get("kind") == "run":
                header = record
            elif record.get("kind") == "rows":
                rows.extend(Row.from_dict(r) for r in record["rows"])
        if header is None:
            raise ValueError(f"{self.path}: no run header: not the results file of a conformance run")
        return header, latest(rows), end


def latest(rows: Iterable[Row]) -> list[Row]:
    """One row per key, the last one recorded, in first-recorded order."""
    by_key: dict[tuple, Row] = {}
    for row in rows:
        by_key.pop(row.key, None)
        by_key[row.key] = row
    return list(by_key.values())


def find_results_file(path: str) -> str:
    """``path`` itself, or the results file in the folder ``path``."""
    return os.path.join(path, RESULTS_FILE) if os.path.isdir(path) else path


# --- CSV ---

CSV_COLUMNS = tuple(f.name for f in dataclasses.fields(Row))


def measured(row: Row, field: str) -> bool:
    """Whether ``row``'s ``field``, where it is nan, is a nan measured (a nan output's error is nan) rather than no
    number at all: a row that names the output it compared (``output``) has its largest difference, and its device
    error is nan exactly where that difference is (an exact comparison of integers has none); a pass, a raise, a
    crash, and the CPU's error where the verdict did not need it, have none."""
    if not row.output:
        return False
    return field == "max_abs_diff" or (field == "device_error" and math.isnan(row.max_abs_diff))


def shown(row: Row, field: str) -> str:
    """``row``'s ``field`` as the CSV writes it: ``nan`` for a nan measured, empty for none (``measured``), never
    0 for a nan."""
    value = getattr(row, field)
    if isinstance(value, float):
        return ("nan" if measured(row, field) else "") if math.isnan(value) else f"{value:.6g}"
    return "" if value is None else str(value)


def write_csv(path: str, rows: list[Row]) -> None:
    from ...output import result_files  # the one writer of files (atomic)

    result_files.write_csv(path, [{c: shown(r, c) for c in CSV_COLUMNS} for r in rows])


def read_csv(path: str) -> list[Row]:
    """The rows of a conformance CSV (this tool's); a file without its columns is a ValueError naming it."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = {"op", "dtype", "direction", "status"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: not a conformance CSV (no column {', '.join(sorted(missing))})")
        return [Row.from_dict(r) for r in reader]


def read_rows(path: str) -> list[Row]:
    """Rows from a conformance CSV, a results file, or a run's folder."""
    path = find_results_file(path)
    if path.endswith(".csv"):
        return read_csv(path)
    return ResultsFile(path).read()[1]
