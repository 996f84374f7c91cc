"""The console summary of a conformance run: pass rate per dtype and direction, the failing ops, and, with
``--compare``, where two runs disagree. Tables go through ``op_tools.output.reporting``.
"""

from __future__ import annotations

import collections
import math

from ...output import reporting
from .known_gaps import gap_of
from .results import STATUSES, Row

# A row's account: compared (pass, mismatch), raised on the device (unsupported), killed or hung its worker (crash:
# the device's fault, found), not checked (unchecked: no CPU reference, the tool failed), skipped (why). Skipped rows
# are not in the pass rate.
COUNTED = ("pass", "mismatch", "unsupported", "crash", "unchecked")
FAILED = ("mismatch", "unsupported", "crash")  # the device found wrong
NOT_CHECKED = ("unchecked",)  # no verdict on the op's results
FAILING = FAILED + NOT_CHECKED  # rows that did not pass: listed, with the command that reruns them
_DETAIL_WIDTH = 110
# The order rows are read in (the HTML report's): what failed, known gaps after the other failures, then what was not
# checked, then skipped, then the passes.
_READING_RANK = {**dict.fromkeys(FAILED, 0), "unchecked": 2, "skipped": 3, "pass": 4}


def verdict(rows: list[Row]) -> str:
    """``"found"`` (a row failed), ``"unchecked"`` (none failed, some were not checked) or ``"clean"``: the exit
    status of the command (``exit_status.status_of``)."""
    statuses = {r.status for r in rows}
    if statuses & set(FAILED):
        return "found"
    # every row skipped (no dtype the op takes): nothing ran, which is no clean verdict
    return "unchecked" if statuses & set(NOT_CHECKED) or "pass" not in statuses else "clean"


def reading_order(rows: list[Row]) -> list[Row]:
    """``rows`` failures first (known gaps after the others), then unchecked, skipped, and passed rows; the sweep's
    order within each."""
    return sorted(rows, key=lambda r: _READING_RANK[r.status] + bool(r.known_gap and r.status in FAILED))


def first_failure(rows: list[Row]) -> Row | None:
    """The row the report leads with: the first failed row (in ``reading_order``), else the first not checked."""
    return next((r for r in reading_order(rows) if r.status in FAILING), None)


def closing_lines(rows: list[Row]) -> list[str]:
    """The account of the rows, and the verdict: "every op that ran passed" only when every row that ran was
    checked and passed; otherwise what failed and (a WARNING) what was not checked, the first named."""
    counts = collections.Counter(r.status for r in rows)
    lines = [f"{len(rows)} rows: " + ", ".join(f"{counts[s]} {s}" for s in STATUSES)]
    failed = sum(counts[s] for s in FAILED)
    if failed:
        known = sum(1 for r in rows if r.known_gap and r.status in FAILED)
        lines.append(f"{failed} rows failed ({counts['mismatch']} mismatch, {counts['unsupported']} unsupported, "
                     f"{counts['crash']} crash)" + (f", {known} of them known gaps" if known else ""))
    unchecked = [r for r in rows if r.status in NOT_CHECKED]
    if unchecked:
        first = unchecked[0]
        lines.append(f"WARNING: {len(unchecked)} rows not checked, the first {first.op} {first.dtype} "
                     f"{first.direction}: {_short(first.detail)}")
    if not failed and not unchecked:
        lines.append("every op that ran passed" if counts["pass"] else
                     "WARNING: no row ran (every one skipped): nothing was checked")
    return lines


def pass_rate(counts: collections.Counter) -> float:
    """Passes over the rows that ran (skipped rows excluded); nan when none ran."""
    ran = sum(counts[s] for s in COUNTED)
    return counts["pass"] / ran if ran else math.nan


def format_rate(rate: float) -> str:
    return "" if math.isnan(rate) else f"{100 * rate:.1f}%"


def counts_by(rows: list[Row], *fields: str) -> dict[tuple, collections.Counter]:
    """Status counts per value of ``fields`` (e.g. ``("dtype", "direction")``), in first-seen order."""
    groups: dict[tuple, collections.Counter] = {}
    for row in rows:
        groups.setdefault(tuple(getattr(row, f) for f in fields), collections.Counter())[row.status] += 1
    return groups


def summary_rows(rows: list[Row]) -> list[dict]:
    """One line per dtype x direction, and a total: how many rows of each status, and the pass rate."""
    lines = []
    groups = counts_by(rows, "dtype", "direction")
    for (dtype, direction), counts in groups.items():
        lines.append({"dtype": dtype, "direction": direction, "ops": sum(counts.values()),
                      **{s: counts[s] for s in STATUSES}, "pass rate": format_rate(pass_rate(counts))})
    total = collections.Counter(r.status for r in rows)
    lines.append({"dtype": "all", "direction": "both", "ops": len(rows), **{s: total[s] for s in STATUSES},
                  "pass rate": format_rate(pass_rate(total))})
    return lines


def _short(text: str, width: int = _DETAIL_WIDTH) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def summary(rows: list[Row], title: str, other: list[Row] | None = None, other_label: str = "",
            saved: tuple[str, ...] = ()) -> str:
    """The console text: the pass-rate table, the rows that did not pass, the differences with ``other``, the
    ``saved`` lines, then the closing lines (``closing_lines``)."""
    columns = ("dtype", "direction", "ops", *STATUSES, "pass rate")
    parts = [title, reporting.table(summary_rows(rows), columns).get_string()]
    failing = [r for r in rows if r.status in FAILING]
    if failing:
        table = [{"op": r.op, "dtype": r.dtype, "direction": r.direction,
                  "status": f"{r.status} (known gap)" if r.known_gap else r.status,
                  "sample": "" if r.sample is None else r.sample, "detail": _short(r.detail)} for r in failing]
        parts += [f"{len(failing)} rows did not pass (reproduce one: see the reproduce column of the CSV or HTML):",
                  reporting.table(table).get_string()]
        parts += known_gaps_text([r for r in failing if r.known_gap])
    if other is not None:
        parts.append(differences_text(rows, other, other_label))
    return "\n".join([*parts, *saved, *closing_lines(rows)])


def known_gaps_text(rows: list[Row]) -> list[str]:
    """The known gaps among ``rows`` (marked by ``known_gaps.mark``), each with its rows and why."""
    if not rows:
        return []
    groups: dict[str, list[Row]] = {}
    for row in rows:
        gap = gap_of(row)
        groups.setdefault(gap.label if gap is not None else row.op, []).append(row)
    lines = [f"{len(rows)} of them {'are known gaps' if len(rows) != 1 else 'is a known gap'} (not passes: the "
             "device's results do differ; docs/conformance.md#known-gaps):"]
    lines += [f"  {label} ({len(group)} row{'s' if len(group) != 1 else ''}): {group[0].known_gap}"
              for label, group in groups.items()]
    return lines


def differences(rows: list[Row], other: list[Row]) -> list[tuple[Row, Row]]:
    """Pairs (this run's row, the other run's) whose statuses differ, for the keys both runs have."""
    theirs = {r.key: r for r in other}
    return [(r, theirs[r.key]) for r in rows if r.key in theirs and theirs[r.key].status != r.status]


def differences_text(rows: list[Row], other: list[Row], other_label: str) -> str:
    pairs = differences(rows, other)
    mine = rows[0].device if rows and rows[0].device else "this run"
    common = len({r.key for r in rows} & {r.key for r in other})
    if not pairs:
        return f"compared with {other_label}: the same status on all {common} rows both runs have"
    table = [{"op": a.op, "dtype": a.dtype, "direction": a.direction, mine: a.status, other_label: b.status,
              "detail": _short(a.detail if a.status != "pass" else b.detail, 80)} for a, b in pairs]
    return (f"compared with {other_label}: {len(pairs)} of {common} rows differ\n"
            + reporting.table(table).get_string())
