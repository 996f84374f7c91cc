"""The command line of the run report: read a results folder, analyse, print, save the CSV and the HTML view."""

from __future__ import annotations

import argparse
import glob
import os
import sys
import traceback

from ...output import reporting, result_files
from ...output.exit_status import ExitStatus, status_of
from .. import monitor_page
from .analysis import analyse
from .html_view import render
from .readers import ResultsError, read_results
from .report import console_report, csv_rows

OUTPUT_FOLDER = "op_run_report"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m op_tools.report",
        description="Read what every op_tools tool wrote on every rank of a run and say what went wrong first (which "
                    "rank, step, op, module and phase), which ranks only received it (and through which "
                    "collective), whether the data-parallel replicas agreed after each step, and the time skew "
                    "between ranks. Exit status: 0 no anomaly in what the tools wrote, 3 an anomaly or a replica "
                    "desync, 4 no anomaly but some file could not be read (nothing concluded), 2 the folder cannot "
                    "be read (or a usage error), 5 the report could not be written, 1 the report itself failed.")
    parser.add_argument("results_dir", help="the run's OP_TOOLS_RESULTS_DIR (holding op_overflow_check_result/, "
                        "op_autocompare_result/, op_time_measure_result/, op_replica_fingerprints/, "
                        "op_training_monitor/)")
    parser.add_argument("--csv", help=f"where to write the CSV (default: RESULTS_DIR/{OUTPUT_FOLDER}/report.csv)")
    parser.add_argument("--html", help="where to write the HTML view (default: beside the CSV)")
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        report = analyse(read_results(args.results_dir))
    except ResultsError as e:
        print(f"op_tools.report: {e}", file=sys.stderr)
        return ExitStatus.USAGE
    except Exception:  # a failure of this tool: no verdict, neither clean nor found; the status of a crash
        traceback.print_exc()
        print("op_tools.report: the report failed (a bug of op_tools.report): nothing concluded", file=sys.stderr)
        return ExitStatus.RAISED
    csv_path = args.csv or os.path.join(args.results_dir, OUTPUT_FOLDER, "report.csv")
    html_path = args.html or os.path.splitext(csv_path)[0] + ".html"
    monitor = _monitor_page(args.results_dir)  # first: the report's page links to it
    linked = monitor[0] if monitor else _existing_monitor_page(args.results_dir)
    link = os.path.relpath(linked, os.path.dirname(os.path.abspath(html_path))) if linked else None
    try:
        result_files.write_csv(csv_path, csv_rows(report))
        result_files.write_text(html_path, render(report, link))
    except OSError as e:
        reporting.console(console_report(report))  # the verdict still, though its files are missing
        print(f"op_tools.report: cannot write the report: {type(e).__name__}: {e.strerror or e} ({e.filename})",
              file=sys.stderr)
        return ExitStatus.NOT_WRITTEN
    written = [csv_path, html_path, *monitor]
    reporting.console(console_report(report) + f"\nwritten: {', '.join(written)}")
    return status_of(report.verdict())


def _existing_monitor_page(results_dir: str) -> str | None:
    """The newest TrainingMonitor page in the results folder (the one written at the run's stop), if any."""
    pages = glob.glob(os.path.join(results_dir, monitor_page.FOLDER, "**", "monitor_*.html"), recursive=True)
    return os.path.abspath(max(pages, key=os.path.getmtime)) if pages else None


def _monitor_page(results_dir: str) -> list[str]:
    """TrainingMonitor's page over every rank's files, rewritten now that every rank has finished (the page written at
    rank 0's stop holds only what the other ranks had written by then)."""
    folder = os.path.join(results_dir, monitor_page.FOLDER)
    if not glob.glob(os.path.join(folder, "**", "monitor_*.csv"), recursive=True):
        return []
    try:
        return [monitor_page.write_monitor_page(folder)]
    except (ValueError, OSError) as e:
        print(f"op_tools.report: the training monitor's page was not written: {e}", file=sys.stderr)
        return []
