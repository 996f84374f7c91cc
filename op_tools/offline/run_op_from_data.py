"""Rerun captured ops on this machine's device: ``python op_tools/run_op_from_data.py DIR [options]``.

Also ``python -m op_tools.run_op_from_data DIR`` and the console script ``op_tools_run_op_from_data DIR``.
DIR is a folder of captures (OpCapture's, or OpAutoCompare's for failing ops), one call's folder, or one call's
``input.pth``. Each call is loaded as data (``torch.load(weights_only=True)``), rerun ``--run_times`` times on the
device and backward with its captured upstream gradients (ones where none were captured; none for ops whose outputs
have no gradient), then summarised: op, input shapes and dtypes, device, verdict, mean/median/min times and the
step the call was captured in, with the torch and ditorch versions and the device's name (``--report md`` writes
it as Markdown; ``--failures-only`` shows on the console only the entries not ok or not checked). Exit status
(``op_tools.output.exit_status``): 0 every entry ok, 3 an entry failed ``--acc_check`` (mismatch) or its op raised on
the device, 4 none did but some entry was not replayed (a refused or broken capture), its CPU reference raised, or,
with ``--acc_check``, nothing of it could be checked (``not checked``), 2 bad usage or no captured call under DIR, 5
the summary could not be written.

    python op_tools/run_op_from_data.py op_tools_results/op_capture_results --sync_time_measure --run_times 20
    python op_tools/run_op_from_data.py op_tools_results/op_capture_results/torch.matmul --acc_check
"""

from __future__ import annotations

import argparse
import collections
import sys
from typing import Any

from ..config.variables import CommonConfig
from ..output import reporting, result_files
from ..output.exit_status import ExitStatus, status_of
from .replay import ReplayError, ReplayOptions, find_entries, replay, summary_row

RESULTS_FOLDER = "op_replay_result"
TIME_COLUMNS = ("forward_mean_ms", "forward_median_ms", "forward_min_ms", "backward_mean_ms", "backward_median_ms",
                "backward_min_ms")


def _flag(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="run_op_from_data",
        description="Run the operators captured by OpCapture (or saved by OpAutoCompare for a failing op) again on "
                    "this machine's device, and summarise each one: op, input shapes and dtypes, device, verdict, "
                    "times.",
        epilog="Exit status: 0 every entry ok, 3 a mismatch or an op that raised on the device, 4 none, but an "
               "entry not replayed, its CPU reference raised or nothing of it could be checked, 2 bad usage or no "
               "captured call, 5 the summary could not be written.")
    parser.add_argument("dir", help="What to replay: a folder of captures (e.g. op_tools_results/op_capture_results), "
                                    "one op's or one call's folder, or one call's input.pth file. Every folder below "
                                    "it that holds an input.pth is one entry.")
    parser.add_argument("--run_times", type=int, default=1,
                        help="How many times each op runs (default 1); with --sync_time_measure the summary gives "
                             "the mean, median and minimum of these runs.")
    # The original took `--flag True`; a bare `--flag` works too.
    flag: dict[str, Any] = {"nargs": "?", "const": True, "default": False, "type": _flag, "metavar": "BOOL"}
    parser.add_argument("--only_run_forward", **flag,
                        help="Run forward only. By default backward runs too, with the captured upstream gradients, "
                             "for ops whose outputs have a gradient.")
    parser.add_argument("--sync_time_measure", **flag,
                        help="Time each run between device synchronisations, after one untimed warm-up run; the "
                             "per-run times are written to a CSV file.")
    parser.add_argument("--acc_check", **flag,
                        help="Compare each output and input gradient with a float64 CPU run (OpAutoCompare's "
                             "verdict), and the output with the one saved at capture time.")
    parser.add_argument("--device", default=None,
                        help="The device to run on (default: the device ditorch detects when it is installed, else "
                             "cuda if available, else cpu).")
    parser.add_argument("--allow_module", action="append", default=[], metavar="PACKAGE",
                        help="Also run functions of this non-torch package named in captures (e.g. flash_attn); "
                             "repeatable.")
    parser.add_argument("--failures-only", "--failures_only", dest="failures_only", **flag,
                        help="On the console, show only the entries that are not ok (mismatch, reference error, "
                             "error, not checked) or, with --acc_check, whose values were not compared (random draws: "
                             "their finiteness only), and count the ok ones "
                             "left out; the summary CSV and the Markdown report keep every entry.")
    parser.add_argument("--report", metavar="md|PATH.md", default=None,
                        help="Also write the summary as a Markdown report, with the torch and ditorch versions and "
                             "the device's name: 'md' writes it beside the summary CSV, a path ending in .md "
                             "writes it there.")
    return parser


def active_device() -> str:
    """The device a user script would get: ditorch's choice where installed, else CUDA, else the CPU."""
    try:
        import ditorch  # the replay is a user script: pick the device as one would
    except ImportError:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return ditorch.backend.device_type


def environment(device: str) -> dict[str, str]:
    """What a bug report needs beside the numbers: versions and the device's name."""
    import torch

    try:
        import ditorch

        ditorch_version = getattr(ditorch, "__version__", "unknown")
    except ImportError:
        ditorch_version = "not installed"
    return {"torch": torch.__version__, "ditorch": ditorch_version, "device": device,
            "device name": device_name(device), "python": sys.version.split()[0]}


def device_name(device: str) -> str:
    """``torch.<type>.get_device_name(index)`` where the device's module has it (CUDA, vendor backends), else the
    host's processor for the CPU, else the device type."""
    import platform

    import torch

    where = torch.device(device)
    if where.type == "cpu":
        return platform.processor() or platform.machine() or "cpu"
    module = getattr(torch, where.type, None)
    try:
        return str(module.get_device_name(where.index or 0))  # type: ignore[union-attr]  # None: caught below
    except Exception:  # noqa: BLE001 - a backend without the query, or one that cannot answer: the type says enough
        return where.type


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.run_times < 1:
        print("run_op_from_data: --run_times must be at least 1", file=sys.stderr)
        return ExitStatus.USAGE
    if args.report is not None and args.report != "md" and not args.report.endswith(".md"):
        print(f"run_op_from_data: --report {args.report}: expected md or a path ending in .md", file=sys.stderr)
        return ExitStatus.USAGE
    try:
        common = CommonConfig.from_env()  # a malformed variable (OP_TOOLS_RESULTS_DIR) said now, not after the replay
    except ValueError as e:
        print(f"run_op_from_data: {e}", file=sys.stderr)
        return ExitStatus.USAGE
    try:
        entries = find_entries(args.dir)
    except ReplayError as e:
        print(f"run_op_from_data: {e}", file=sys.stderr)
        return ExitStatus.USAGE
    if not entries:  # nothing to replay is a wrong folder, as one that does not exist
        print(f"run_op_from_data: no captured call under {args.dir} (looked for folders holding input.pth)",
              file=sys.stderr)
        return ExitStatus.USAGE
    device = args.device or active_device()
    import torch

    try:
        torch.device(device)
    except RuntimeError as e:  # a vendor device whose backend this process has not imported
        print(f"run_op_from_data: --device {device}: {e}. A vendor device needs its backend imported first: with "
              "ditorch installed, DITORCH_BACKEND=<its name> (sim for ditorch's simulated device)", file=sys.stderr)
        return ExitStatus.USAGE
    options = ReplayOptions(run_times=args.run_times, backward=not args.only_run_forward,
                            time=args.sync_time_measure, acc_check=args.acc_check,
                            allowed_modules=tuple(args.allow_module))
    env = environment(device)
    reporting.console(reporting.fit_line(
        f"run_op_from_data: {len(entries)} captured calls under {args.dir}, on {device} ({env['device name']}), "
        f"{args.run_times} run(s) each (times: their medians)" + ("" if options.backward else ", forward only")
        + f"; torch {env['torch']}, ditorch {env['ditorch']}"))
    bar = reporting.progress_bar(len(entries), "replay", unit=" calls")
    results, time_rows = [], []
    try:
        for entry in entries:
            if bar is not None:
                bar.set_postfix_str(entry.label, refresh=False)
            result = replay(entry, device, options)
            results.append(result)
            if bar is not None:
                bar.update()
            if result.status in ("error", "reference error"):  # said as it happens, above the bar
                _say(f"run_op_from_data: {entry.label}: {result.error}", bar)
            time_rows += [{"entry": entry.label, "name": result.name, "run": i + 1, "forward_elasped": round(f, 6),
                           "backward_elasped": round(result.backward_ms[i], 6) if i < len(result.backward_ms) else "",
                           "unit": "ms", "step": result.step}
                          for i, f in enumerate(result.forward_ms if options.time else ())]
    finally:
        if bar is not None:
            bar.close()
    return _finish(results, time_rows, options, env, args, common)


def _say(message: str, bar) -> None:
    if bar is not None:
        bar.write(message, file=sys.stderr)
    else:
        print(message, file=sys.stderr, flush=True)


def _finish(results, time_rows, options: ReplayOptions, env: dict, args, common: CommonConfig) -> int:
    stem = result_files.session_stem()
    summary = [summary_row(r) for r in results]
    shown = [console_row(row, options) for row in summary
             if not args.failures_only or needs_attention(row, options)]
    empty = {c for c in ("checks", "detail", "step") if all(row.get(c) in ("", None) for row in shown)}  # not shown
    lines = [reporting.table_text(shown, tuple(c for c in shown[0] if c not in empty))] if shown else []
    if args.failures_only:
        left_out = len(summary) - len(shown)
        lines.append(f"--failures-only: {left_out} ok {'entry' if left_out == 1 else 'entries'} not shown"
                     + ("" if shown else ", nothing else to show") + f" (the summary CSV has all {len(summary)})")
    not_written = ""
    try:
        summary_path = result_files.results_path(common, RESULTS_FOLDER, f"replay_summary_{stem}.csv")
        result_files.write_csv(summary_path, summary)
        lines.append(f"summary saved to {summary_path}")
        if time_rows:
            times_path = result_files.results_path(common, RESULTS_FOLDER, f"replay_times_{stem}.csv")
            result_files.write_csv(times_path, time_rows)
            lines.append(f"per-run times saved to {times_path}")
        if args.report is not None:
            report_path = (result_files.results_path(common, RESULTS_FOLDER, f"replay_report_{stem}.md")
                           if args.report == "md" else args.report)
            result_files.write_text(report_path, markdown_report(summary, options, env, args.dir))
            lines.append(f"Markdown report saved to {report_path}")
    except OSError as e:  # the verdict is still printed below; the status says the files are missing
        not_written = f"cannot write {e.filename or 'the summary'}: {type(e).__name__}: {e.strerror or e}"
    counts = collections.Counter(r.status for r in results)
    always = ("ok", "mismatch", "error", "not checked") if options.acc_check else ("ok", "mismatch", "error")
    lines.append(f"{len(results)} entries: " + ", ".join(f"{counts[s]} {s}" for s in STATUSES if counts[s] or s in
                                                          always))
    table = lines[:1] if shown else []  # fits the width by itself; the lines below wrap at it
    reporting.console("\n".join(table + [reporting.fit_line(line) for line in lines[len(table):]]))
    if not_written:
        print(f"run_op_from_data: {not_written}", file=sys.stderr)
        return ExitStatus.NOT_WRITTEN
    verdicts = {r.verdict() for r in results}
    return status_of(next((v for v in ("found", "unchecked") if v in verdicts), "clean"))


STATUSES = ("ok", "mismatch", "reference error", "error", "not checked")


# a random op's values are drawn again, not compared: only their finiteness, forward and backward
FINITE_CHECKS = ("output finite: pass", "grad finite: pass")


def finite_only(checks: str) -> bool:
    """Whether a summary row's checks are a random op's finiteness checks only, all passed."""
    return bool(checks) and all(check in FINITE_CHECKS for check in checks.split("; "))


def needs_attention(row: dict, options: ReplayOptions) -> bool:
    """A summary row ``--failures-only`` keeps: not ok, or ok without the accuracy check asked for (random draws)."""
    return row["status"] != "ok" or (options.acc_check and finite_only(row["checks"]))


def console_row(row: dict, options: ReplayOptions) -> dict:
    """A summary row as the console shows it (fitting the table width): the CSV and the Markdown report add the dtypes,
    the device, mean and minimum times, the checks' full names and the entry's folder."""
    shown = {"op": row["name"], "shapes": row["shapes"], "status": row["status"]}
    if options.time:
        # medians of the runs (the line above the table says how many); short names leave the checks room
        shown.update({"fwd ms": row["forward_median_ms"], "bwd ms": row["backward_median_ms"]})
    if options.acc_check:
        failed = [SHORT_CHECKS.get(name, name) for name, _, verdict in
                  (c.rpartition(": ") for c in row["checks"].split("; ") if c) if verdict != "pass"]
        shown["checks"] = ("FAIL: " + ", ".join(failed)) if failed else \
            "finite only" if finite_only(row["checks"]) else "all pass" if row["checks"] else ""
    shown["detail"] = row["detail"]
    shown["step"] = row["step"]
    return shown


SHORT_CHECKS = {"output vs cpu float64": "output", "grad vs cpu float64": "grad",
                "output vs captured output": "captured", "written vs cpu float64": "written",
                "written vs captured": "written captured", "grad vs captured grad": "captured grad",
                "output finite": "finite", "grad finite": "grad finite"}


def markdown_report(summary: list[dict], options: ReplayOptions, env: dict, source: str) -> str:
    """The summary as Markdown, ready to paste into a bug report: the environment, then one row per entry."""
    counts = collections.Counter(row["status"] for row in summary)
    columns = ["name", "shapes", "dtypes", "device", "status"]
    if options.time:
        columns += list(TIME_COLUMNS)
    if options.acc_check:
        columns.append("checks")
    columns += ["detail", "entry", "step"]
    lines = ["# run_op_from_data report", "",
             f"- torch {env['torch']}, ditorch {env['ditorch']}, Python {env['python']}",
             f"- device: {env['device']} ({env['device name']})",
             f"- captures: `{source}`; {options.run_times} run(s) per entry"
             + (", timed between synchronisations after a warm-up run" if options.time else "")
             + ("" if options.backward else ", forward only") + (", accuracy checked" if options.acc_check else ""),
             "- result: " + ", ".join(f"{counts[s]} {s}" for s in STATUSES if counts[s]), "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in summary:
        lines.append("| " + " | ".join(_md_cell(row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def _md_cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


if __name__ == "__main__":
    sys.exit(main())
