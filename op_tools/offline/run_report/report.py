"""The run report as console lines and CSV rows (the HTML view renders the same rows: html_view.py)."""

from __future__ import annotations

import os

from ...output import reporting
from .analysis import RunReport
from .readers import MONITOR, MONITOR_FOLDER, Event

CSV_COLUMNS = ("section", "rank", "step", "status", "kind", "op", "module", "phase", "tool", "detail", "through",
               "from_ranks", "ms", "value")
MONITOR_COLUMNS = ("rule", "rank", "step", "module", "phase", "value", "message")


def _ranks(ranks) -> str:
    return ",".join(map(str, sorted(ranks)))


def read_lines(report: RunReport) -> list[str]:
    results = report.results
    lines = [f"read: {results.files} file{'s' if results.files != 1 else ''} from "
             + "; ".join(f"{tool} (ranks {_ranks(ranks)})" for tool, ranks in sorted(results.tools.items()))]
    lines.extend(f"NOT READ: {problem}" for problem in results.unreadable)
    lines.extend(f"NOT CHECKED: {what}" for what in results.unchecked)
    lines.extend(f"ENDED EARLY: rank {rank}: {what}" for rank, what in sorted(results.ended_early.items()))
    lines.extend(f"NOTE: {note}" for note in results.notes)
    return lines


def value_text(value: float | None) -> str:
    return "" if value is None else f"{value:.6g}"


def monitor_rows(report: RunReport) -> list[dict]:
    """TrainingMonitor's anomalies, one row each (``MONITOR_COLUMNS``), in the order they came."""
    return [{"rule": e.kind, "rank": e.rank, "step": e.step, "module": e.module, "phase": e.phase,
             "value": value_text(e.value), "message": e.detail} for e in report.monitor_anomalies]


def monitor_lines(report: RunReport) -> list[str]:
    ranks = report.results.tools.get(MONITOR)
    if not ranks:
        return []
    rows = monitor_rows(report)
    if not rows:
        folder = os.path.join(report.results.folder, MONITOR_FOLDER)
        unread = any(problem.startswith(folder) for problem in report.results.unreadable)
        return [f"training monitor: no anomaly (ranks {_ranks(ranks)})" if not unread else
                f"training monitor: no anomaly in the files read (ranks {_ranks(ranks)}; some not read: above)"]
    return [f"training monitor: {len(rows)} anomal{'ies' if len(rows) != 1 else 'y'}",
            reporting.table_text(rows, MONITOR_COLUMNS, keep="module")]


def verdict_line(report: RunReport) -> str:
    if report.first is not None:
        return f"what went wrong first: {report.first.text()}"
    if report.desync is not None:
        return f"what went wrong first: the replicas {report.desync.text()}"
    if report.nonfinite is not None:  # seen only in the fingerprints: no tool saw where it was born
        return f"what went wrong first: not found by a tool; {report.nonfinite.text()}"
    received = [r for r in report.ranks if r.status == "received"]
    if received:
        return "what went wrong first: not found (no rank's anomaly was born there); " + received[0].text()
    ranks = len(report.results.ranks)
    if report.verdict() == "unread":
        unread, unchecked = len(report.results.unreadable), len(report.results.unchecked)
        early = sorted(report.results.ended_early)
        why = [f"{unread} file{'s' if unread != 1 else ''} could not be read"] if unread else []
        if unchecked:
            why.append(f"{unchecked} tool session{'s' if unchecked != 1 else ''} did not check every call")
        if early:
            why.append(f"the run of rank{'s' if len(early) > 1 else ''} {_ranks(early)} ended early")
        return (f"nothing concluded: no anomaly in what the tools wrote on {ranks} rank{'s' if ranks != 1 else ''}, "
                f"but {' and '.join(why)} (above)")
    return f"no anomaly in what the tools wrote on {ranks} rank{'s' if ranks != 1 else ''}"


def console_report(report: RunReport) -> str:
    lines = [f"op_tools.report: {report.results.folder}", *read_lines(report), "ranks:"]
    lines.extend(f"  {account.text()}" for account in report.ranks)
    lines.append(f"replicas: {report.replicas_text()}")
    if report.nonfinite is not None and not report.replicas_compared:  # else said on the replicas line
        lines.append(f"parameters: {report.nonfinite.text()}")
    if report.skew:
        lines.append("time skew (the calls OpTimeMeasure timed, collectives left out):")
        lines.extend(f"  {skew.text()}" for skew in report.skew)
    lines.extend(monitor_lines(report))
    lines.append(verdict_line(report))
    return "\n".join(lines)


def csv_rows(report: RunReport) -> list[dict]:
    rows = []
    for account in report.ranks:
        event = account.first
        through = account.through
        rows.append({"section": "rank", "rank": account.rank, "status": account.status,
                     "step": event.step if event else (through.step if through else ""),
                     "kind": event.kind if event else "", "op": event.op if event else "",
                     "module": event.module if event else "", "phase": event.phase if event else "",
                     "tool": event.tool if event else "", "detail": event.detail if event else "",
                     "through": f"{through.op} in {through.module}" if through and through.module else
                     (through.op if through else ""), "from_ranks": _ranks(account.from_ranks),
                     "value": _csv_value(event)})
    if report.desync is not None:
        d = report.desync
        rows.extend({"section": "replicas", "rank": rank, "step": d.step, "status": "desync", "kind": d.what,
                     "op": "", "module": d.name, "detail": f"checksum {value}"} for rank, value in d.checksums.items())
    if report.nonfinite is not None:
        n = report.nonfinite
        rows.extend({"section": "parameters", "rank": rank, "step": n.step, "status": "nonfinite",
                     "kind": "parameter", "module": n.names[0], "detail": f"{len(n.names)} parameters hold inf/nan"}
                    for rank in n.ranks)
    for skew in report.skew:
        for rank, ms in sorted(skew.ms.items()):
            detail = "; ".join(f"{op} {t:.3f} ms" for op, t in skew.top_ops) if rank == skew.slowest else ""
            rows.append({"section": "skew", "rank": rank, "step": skew.step,
                         "status": "slowest" if rank == skew.slowest else "", "ms": f"{ms:.3f}",
                         "detail": "; ".join(part for part in (skew.session, detail) if part)})
    rows.extend({"section": "training monitor", "rank": e.rank, "step": e.step, "kind": e.kind, "module": e.module,
                 "phase": e.phase, "tool": e.tool, "detail": e.detail, "value": _csv_value(e)}
                for e in report.monitor_anomalies)
    return [{c: row.get(c, "") for c in CSV_COLUMNS} for row in rows]


def _csv_value(event: Event | None) -> str:
    return "" if event is None or event.value is None else repr(event.value)  # whole, as the monitor's CSV
