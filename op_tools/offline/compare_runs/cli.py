"""The command line of compare_runs: read, compare, print, save the CSV and the HTML view, exit 0/1/2/4."""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from ...config.variables import CommonConfig
from ...output import reporting, result_files
from ...output.run_recording import RecordingFormatError
from .comparison import compare
from .html_view import render
from .report import console_report, csv_rows

# Comparison.verdict() -> exit status; 2 is an unreadable recording or a usage error (as argparse's own).
EXIT_STATUS = {"clean": 0, "found": 1, "unchecked": 4}
EXIT_UNREADABLE = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m op_tools.compare_runs",
        description="Align two run recordings (OP_CAPTURE_MODE=stats) and report where they first diverge. "
                    "Exit status: 0 every aligned pair compared and none diverges, 1 a divergence, 2 an unreadable "
                    "recording or a usage error, 4 no divergence but some calls not compared (a call a run could "
                    "not record, damaged lines, a failure of this tool).")
    parser.add_argument("run_a", help="recording of run A: a run_*.jsonl file, or a folder holding one")
    parser.add_argument("run_b", help="recording of run B, likewise")
    parser.add_argument("--rank", type=int, help="under torchrun: compare the recordings of this rank (rank<N>/)")
    parser.add_argument("--csv", help="where to write the CSV (default: under OP_TOOLS_RESULTS_DIR/compare_runs)")
    parser.add_argument("--html", help="where to write the HTML view (default: beside the CSV)")
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        result = compare(args.run_a, args.run_b, rank=args.rank)
    except (RecordingFormatError, ValueError, OSError) as e:
        print(f"compare_runs: {e}", file=sys.stderr)
        return EXIT_UNREADABLE
    except Exception:  # a failure of this tool: nothing was compared, which is no divergence found (exit 1)
        traceback.print_exc()
        print("compare_runs: the comparison failed (a bug of compare_runs): nothing compared", file=sys.stderr)
        return EXIT_STATUS["unchecked"]
    stem = result_files.results_path(CommonConfig.from_env(), "compare_runs", f"compare_{result_files.session_stem()}")
    csv_path = args.csv or stem + ".csv"
    html_path = args.html or os.path.splitext(csv_path)[0] + ".html"
    result_files.write_csv(csv_path, csv_rows(result))
    result_files.write_text(html_path, render(result))
    reporting.console(console_report(result, [csv_path, html_path]))
    return EXIT_STATUS[result.verdict()]
