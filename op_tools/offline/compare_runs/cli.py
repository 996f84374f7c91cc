"""The command line of compare_runs: read, compare, print, save the CSV and the HTML view, exit 0/3/4/2/5/1."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import traceback

from ...config.variables import CommonConfig
from ...output import reporting, result_files
from ...output.exit_status import ExitStatus, status_of, worst
from ...output.run_recording import RecordingFormatError, recording_ranks
from .comparison import Comparison, compare
from .html_view import render
from .report import console_report, csv_rows, where


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m op_tools.compare_runs",
        description="Align two run recordings (OP_CAPTURE_MODE=stats) and report where they first diverge. "
                    "Exit status: 0 every aligned pair compared and none diverges, 3 a divergence, 2 an unreadable "
                    "recording or a usage error, 4 no divergence but some calls not compared (a call a run could "
                    "not record, damaged lines, a failure of this tool, calls past the other run's end, a recording "
                    "cut short or partial or of a run ended by SIGTERM or an exception, no pair at all), 5 the CSV "
                    "or the HTML view cannot be written (--csv, --html or OP_TOOLS_RESULTS_DIR names a folder this "
                    "process cannot write; checked before comparing), 1 compare_runs itself failed.")
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
    unwritable = _unwritable_output(args)
    if unwritable:
        print(f"compare_runs: {unwritable}", file=sys.stderr)
        return ExitStatus.NOT_WRITTEN
    if args.rank is None and args.rank_b is None:
        ranks_a, ranks_b = recording_ranks(args.run_a), recording_ranks(args.run_b)
        if len(ranks_a) > 1 or len(ranks_b) > 1:
            return _rank_by_rank(args, ranks_a, ranks_b)
    return _compare_one(args, args.rank, args.rank_b, args.csv, args.html)


def _results_folder() -> str:
    return result_files.results_path(CommonConfig.from_env(), "compare_runs")


def _unwritable_output(args) -> str:
    """Why the CSV's or the HTML view's folder cannot be written, naming the path and what chose it ('' when both
    can): tried before comparing, which can take minutes, by creating the folder and a file in it."""
    try:
        csv_folder = os.path.dirname(args.csv) if args.csv else _results_folder()
    except ValueError as e:  # OP_TOOLS_RESULTS_DIR names a file, or is malformed: the message names it
        return f"cannot write the CSV: {e}"
    html_folder = os.path.dirname(args.html) if args.html else csv_folder
    for what, folder in (("the CSV", csv_folder), ("the HTML view", html_folder)):
        try:
            os.makedirs(folder or ".", exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=folder or ".", prefix=".probe-")
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            return _cannot_write(what, folder or ".", args, e)
    return ""


def _cannot_write(what: str, path: str, args, error: OSError) -> str:
    """The one-line message for an output that cannot be written: the path, the option or variable that chose it."""
    if what == "the HTML view" and args.html:
        chosen_by = f"--html {args.html}"
    elif args.csv:  # the HTML view goes beside the CSV unless --html says otherwise
        chosen_by = f"--csv {args.csv}"
    else:
        chosen_by = f"OP_TOOLS_RESULTS_DIR={CommonConfig.from_env().results_dir!r}"
    in_the_way = " (a file stands where a folder should be)" if isinstance(
        error, (FileExistsError, NotADirectoryError)) else ""
    return (f"cannot write {what} in {path} ({chosen_by}): {type(error).__name__}: {error.strerror or error}"
            f"{in_the_way}; choose a folder this process can write")


def _compare_one(args, rank: int | None, rank_b: int | None, csv_path: str | None, html_path: str | None,
                 title: str = "", compared: list | None = None) -> ExitStatus:
    """Compare, report and save one pair of recordings; ``compared``: where to append the ``Comparison``."""
    try:
        result = compare(args.run_a, args.run_b, rank=rank, rank_b=rank_b)
        if compared is not None:
            compared.append(result)
    except (RecordingFormatError, ValueError, OSError) as e:
        print(f"compare_runs: {title}{e}", file=sys.stderr)
        return ExitStatus.USAGE
    except Exception:  # a failure of this tool: nothing compared, no verdict; the status of a crash
        traceback.print_exc()
        print(f"compare_runs: {title}the comparison failed (a bug of compare_runs): nothing compared",
              file=sys.stderr)
        return ExitStatus.RAISED
    suffix = "" if rank is None else f"_rank{rank}" + ("" if rank_b is None else f"_rank{rank_b}")
    csv_path = csv_path or os.path.join(_results_folder(), f"compare_{result_files.session_stem()}{suffix}.csv")
    html_path = html_path or os.path.splitext(csv_path)[0] + ".html"
    saved: list[str] = []
    try:
        result_files.write_csv(csv_path, csv_rows(result))
        saved.append(csv_path)
        result_files.write_text(html_path, render(result))
        saved.append(html_path)
    except OSError as e:  # the folders passed their trial before comparing and failed since (a full disk)
        reporting.console(title + console_report(result, saved))  # the verdict, though a file is missing
        what, path = ("the HTML view", html_path) if saved else ("the CSV", csv_path)
        print(f"compare_runs: {title}{_cannot_write(what, path, args, e)}", file=sys.stderr)
        return ExitStatus.NOT_WRITTEN
    reporting.console(title + console_report(result, saved))
    return status_of(result.verdict())


def _rank_by_rank(args, ranks_a: list[int], ranks_b: list[int]) -> int:
    """Two runs' folders of per-rank recordings, compared rank by rank; the exit status is the worst rank's
    (``exit_status.worst``: a divergence, then a failure of compare_runs, an unreadable or missing rank, files not
    written, then calls not compared)."""
    statuses: dict[int, ExitStatus] = {}
    results: dict[int, Comparison] = {}
    missing: dict[int, str] = {}  # rank -> the run without a recording of it
    for rank in sorted(set(ranks_a) | set(ranks_b)):
        if rank not in ranks_a or rank not in ranks_b:
            missing[rank] = "A" if rank not in ranks_a else "B"
            print(f"compare_runs: rank {rank}: run {missing[rank]} has no recording for it", file=sys.stderr)
            statuses[rank] = ExitStatus.USAGE
            continue
        csv_path = html_path = None
        if args.csv:
            csv_path = f"{os.path.splitext(args.csv)[0]}_rank{rank}.csv"
        if args.html:
            html_path = f"{os.path.splitext(args.html)[0]}_rank{rank}.html"
        compared: list[Comparison] = []
        statuses[rank] = _compare_one(args, rank, None, csv_path, html_path, title=f"rank {rank}: ",
                                      compared=compared)
        if compared:
            results[rank] = compared[0]
    verdicts = ", ".join(f"rank {rank} " + (f"missing in run {missing[rank]}" if rank in missing else
                                             STATUS_WORDS[status]) for rank, status in statuses.items())
    reporting.console(f"compare_runs: {len(statuses)} ranks compared rank by rank: {verdicts}{_first_rank(results)}")
    return worst(statuses.values())


def _first_rank(results: dict[int, Comparison]) -> str:
    """Where the runs part first over all ranks: the rank whose first divergence comes earliest (its step, then run
    A's clock when the call started), with its step, phase, module and op; '' when no rank diverged."""
    firsts = [(row.step, row.record.get("time", 0.0), rank, row) for rank, result in results.items()
              if (row := result.first_divergence()) is not None]
    if not firsts:
        return ""
    _, _, rank, row = min(firsts, key=lambda first: first[:3])
    return f"; the first divergence: rank {rank}, {where(row)}" + (
        f" (the earliest of {len(firsts)} ranks diverged, by run A's clock)" if len(firsts) > 1 else "")


# A rank's status as the closing line says it.
STATUS_WORDS = {ExitStatus.FOUND: "diverged", ExitStatus.RAISED: "comparison failed", ExitStatus.USAGE: "unreadable",
                ExitStatus.NOT_WRITTEN: "files not written", ExitStatus.INCOMPLETE: "not fully compared",
                ExitStatus.CLEAN: "agree"}
