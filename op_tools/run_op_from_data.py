"""Rerun captured ops on this machine's device: ``python op_tools/run_op_from_data.py DIR [options]``.

Also ``python -m op_tools.run_op_from_data DIR`` and the console script ``op_tools_run_op_from_data DIR``.
DIR is a folder of captures (OpCapture's, or OpAutoCompare's for failing ops) or one call's folder.
Each call is loaded as data (``torch.load(weights_only=True)``), rerun ``--run_times`` times on the device
and backward with its captured upstream gradients (ones where none were captured), then summarised.
The exit status is 1 when any entry could not be replayed or failed ``--acc_check``, 2 for bad usage.

    python op_tools/run_op_from_data.py op_tools_results/op_capture_results --sync_time_measure --run_times 20
    python op_tools/run_op_from_data.py op_tools_results/op_capture_results/torch.matmul --acc_check
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a file: import the package, not the modules beside this file
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    sys.path.insert(0, os.path.dirname(_here))

from op_tools import reporting  # noqa: E402
from op_tools.config import CommonConfig  # noqa: E402
from op_tools.replay import Progress, ReplayError, ReplayOptions, find_entries, replay, summary_row  # noqa: E402

RESULTS_FOLDER = "op_replay_result"
PROGRESS_FROM = 10  # entries: fewer are quick enough to need no progress bar


def _flag(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="run_op_from_data", description="Run the operators captured by OpCapture (or saved by OpAutoCompare) "
                                             "again on this machine's device.")
    parser.add_argument("dir", help="a folder of captures, e.g. op_tools_results/op_capture_results, or one call's")
    parser.add_argument("--run_times", type=int, default=1, help="how many times each op runs (default 1)")
    # The original took `--flag True`; a bare `--flag` works too.
    flag = {"nargs": "?", "const": True, "default": False, "type": _flag, "metavar": "BOOL"}
    parser.add_argument("--only_run_forward", **flag, help="run forward only, no backward")
    parser.add_argument("--sync_time_measure", **flag,
                        help="time each run between device synchronisations; print and write the times")
    parser.add_argument("--acc_check", **flag,
                        help="compare with a float64 CPU run and with the output saved at capture time")
    parser.add_argument("--device", default=None,
                        help="device to run on (default: ditorch's detected device, else cuda if available, else cpu)")
    parser.add_argument("--allow_module", action="append", default=[], metavar="PACKAGE",
                        help="also run functions of this (non-torch) package named in captures; repeatable")
    return parser


def active_device() -> str:
    """The device a user script would get: ditorch's choice where installed, else CUDA, else the CPU."""
    try:
        import ditorch  # the replay is a user script: pick the device as one would
    except ImportError:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return ditorch.backend.device_type


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.run_times < 1:
        print("run_op_from_data: --run_times must be at least 1", file=sys.stderr)
        return 2
    try:
        entries = find_entries(args.dir)
    except ReplayError as e:
        print(f"run_op_from_data: {e}", file=sys.stderr)
        return 2
    if not entries:
        print(f"run_op_from_data: no captured call under {args.dir} (looked for folders holding input.pth)",
              file=sys.stderr)
        return 1
    device = args.device or active_device()
    options = ReplayOptions(run_times=args.run_times, backward=not args.only_run_forward,
                            time=args.sync_time_measure, acc_check=args.acc_check,
                            allowed_modules=tuple(args.allow_module))
    reporting.console(f"run_op_from_data: {len(entries)} captured calls under {args.dir}, on {device}, "
                      f"{args.run_times} run(s) each" + ("" if options.backward else ", forward only"))
    progress = Progress(len(entries)) if len(entries) >= PROGRESS_FROM else None
    results, time_rows = [], []
    for entry in entries:
        result = replay(entry, device, options)
        results.append(result)
        if progress:
            progress.advance(entry.label)
        if result.status == "error":
            reporting.logger.error("%s: %s", entry.label, result.error)
        if options.time and result.forward_ms:
            rows = [{"name": result.name, "run": i + 1, "forward_elasped": round(f, 6),
                     "backward_elasped": round(result.backward_ms[i], 6) if i < len(result.backward_ms) else "",
                     "unit": "ms"} for i, f in enumerate(result.forward_ms)]
            time_rows += [{"entry": entry.label, **row} for row in rows]
            if not progress:
                reporting.console(f"\n{result.name}    {entry.label}\n" + reporting.table(rows).get_string())
    return _finish(results, time_rows, options)


def _finish(results, time_rows, options: ReplayOptions) -> int:
    common = CommonConfig.from_env()
    stem = reporting.session_stem()
    summary = [summary_row(r) for r in results]
    columns = [c for c in summary[0] if (c != "checks" or options.acc_check)
               and (c not in ("forward_mean_ms", "backward_mean_ms") or options.time)]
    lines = [reporting.table(summary, tuple(columns)).get_string()]
    summary_path = reporting.results_path(common, RESULTS_FOLDER, f"replay_summary_{stem}.csv")
    reporting.write_csv(summary_path, summary)
    lines.append(f"summary saved to {summary_path}")
    if time_rows:
        times_path = reporting.results_path(common, RESULTS_FOLDER, f"replay_times_{stem}.csv")
        reporting.write_csv(times_path, time_rows)
        lines.append(f"per-run times saved to {times_path}")
    counts = {status: sum(r.status == status for r in results) for status in ("ok", "mismatch", "error")}
    lines.append(f"{len(results)} entries: {counts['ok']} ok, {counts['mismatch']} mismatch, {counts['error']} error")
    reporting.console("\n".join(lines))
    return 1 if any(r.failed for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
