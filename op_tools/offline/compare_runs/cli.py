"""The command line of compare_runs: read, compare, print, save the CSV and the HTML view, exit 0/1/2/4."""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from ...config.variables import CommonConfig
from ...output import reporting, result_files
from ...output.run_recording import RecordingFormatError, recording_ranks
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
    parser.add_argument("--rank", type=int, help="under torchrun: compare the recordings of this rank (rank<N>/); "
                        "without it, folders of per-rank recordings are compared rank by rank")
    parser.add_argument("--rank-b", type=int, help="run B's rank when it is another one: `RUN RUN --rank 0 --rank-b 1` "
                        "compares two ranks of one run (data-parallel replicas should agree)")
    parser.add_argument("--csv", help="where to write the CSV (default: under OP_TOOLS_RESULTS_DIR/compare_runs)")
    parser.add_argument("--html", help="where to write the HTML view (default: beside the CSV)")
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.rank is None and args.rank_b is None:
        ranks_a, ranks_b = recording_ranks(args.run_a), recording_ranks(args.run_b)
        if len(ranks_a) > 1 or len(ranks_b) > 1:
            return _rank_by_rank(args, ranks_a, ranks_b)
    return _compare_one(args, args.rank, args.rank_b, args.csv, args.html)


def _compare_one(args, rank: int | None, rank_b: int | None, csv_path: str | None, html_path: str | None,
                 title: str = "") -> int:
    try:
        result = compare(args.run_a, args.run_b, rank=rank, rank_b=rank_b)
    except (RecordingFormatError, ValueError, OSError) as e:
        print(f"compare_runs: {title}{e}", file=sys.stderr)
        return EXIT_UNREADABLE
    except Exception:  # a failure of this tool: nothing was compared, which is no divergence found (exit 1)
        traceback.print_exc()
        print(f"compare_runs: {title}the comparison failed (a bug of compare_runs): nothing compared",
              file=sys.stderr)
        return EXIT_STATUS["unchecked"]
    stem = result_files.results_path(CommonConfig.from_env(), "compare_runs", f"compare_{result_files.session_stem()}")
    suffix = "" if rank is None else f"_rank{rank}" + ("" if rank_b is None else f"_rank{rank_b}")
    csv_path = csv_path or stem + suffix + ".csv"
    html_path = html_path or os.path.splitext(csv_path)[0] + ".html"
    result_files.write_csv(csv_path, csv_rows(result))
    result_files.write_text(html_path, render(result))
    reporting.console(title + console_report(result, [csv_path, html_path]))
    return EXIT_STATUS[result.verdict()]


def _rank_by_rank(args, ranks_a: list[int], ranks_b: list[int]) -> int:
    """Two runs' folders of per-rank recordings, compared rank by rank; the exit status is the worst rank's (a
    divergence, then an unreadable or missing rank, then calls not compared)."""
    statuses = {}
    for rank in sorted(set(ranks_a) | set(ranks_b)):
        if rank not in ranks_a or rank not in ranks_b:
            missing = "A" if rank not in ranks_a else "B"
            print(f"compare_runs: rank {rank}: run {missing} has no recording for it", file=sys.stderr)
            statuses[rank] = EXIT_UNREADABLE
            continue
        csv_path = html_path = None
        if args.csv:
            csv_path = f"{os.path.splitext(args.csv)[0]}_rank{rank}.csv"
        if args.html:
            html_path = f"{os.path.splitext(args.html)[0]}_rank{rank}.html"
        statuses[rank] = _compare_one(args, rank, None, csv_path, html_path, title=f"rank {rank}: ")
    worst = next((status for status in RANK_ORDER if status in statuses.values()), EXIT_STATUS["clean"])
    verdicts = ", ".join(f"rank {rank} {STATUS_WORDS[status]}" for rank, status in statuses.items())
    reporting.console(f"compare_runs: {len(statuses)} ranks compared rank by rank: {verdicts}")
    return worst


# The worst first: what a whole run's exit status is when its ranks differ.
RANK_ORDER = (EXIT_STATUS["found"], EXIT_UNREADABLE, EXIT_STATUS["unchecked"], EXIT_STATUS["clean"])
STATUS_WORDS = {EXIT_STATUS["found"]: "diverged", EXIT_UNREADABLE: "unreadable",
                EXIT_STATUS["unchecked"]: "not fully compared", EXIT_STATUS["clean"]: "agree"}
