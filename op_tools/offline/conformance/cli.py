"""``python -m op_tools.conformance``: which operators does this device get right?

Runs the sample inputs of PyTorch's OpInfos on the device and on the CPU, forward and backward, and gives
each op x dtype x direction one status (pass, mismatch, unsupported, crash, unchecked, skipped) by
OpAutoCompare's verdict. Writes ``results.jsonl``, ``conformance.csv`` and ``conformance.html`` in the output
folder and prints the pass rate per dtype and the failing ops. Exit status (``op_tools.output.exit_status``): 0
when every row that ran was checked and passed, 3 when a row failed (mismatch, unsupported, crash: the op killed or
hung its worker), 4 when none failed but some were not checked (unchecked: no CPU reference, the tool failed, the
sweep stopped), 2 for bad usage, 5 when the reports cannot be written, 130 when interrupted (``--resume``
continues).

    python -m op_tools.conformance --device sim --ops 'nn.functional.*' --dtypes float32   # sim: its setup implied
    DITORCH_BACKEND=sim python -m op_tools.conformance --ops 'nn.functional.*' --dtypes float32,bfloat16
    python -m op_tools.conformance --device cuda --compare npu_run/conformance.csv
    python -m op_tools.conformance --resume op_tools_results/op_conformance_result/sim_pid42_...
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import re
import shlex
import sys
import time

import torch

from ...config.variables import CommonConfig
from ...numerics.comparison import ToleranceSpec
from ...output import reporting, result_files
from ...output.exit_status import ExitStatus, status_of
from . import html, known_gaps, report
from .case import CaseOptions
from .opinfos import DEFAULT_DTYPES, OpEntry, parse_dtypes, select
from .results import (
    CSV_FILE,
    DIRECTIONS,
    HTML_FILE,
    RESULTS_FILE,
    ResultsFile,
    Row,
    find_results_file,
    read_rows,
    write_csv,
)
from .workers import START_METHODS, SweepError, Task, TaskResult, WorkerConfig, WorkerPool, run_setup

RESULTS_FOLDER = "op_conformance_result"
DEFAULT_TIMEOUT = 300.0
_DEVICE_LAYER_ENV = re.compile(r"^DITORCH_\w+$")  # the device layer's variables: they shape a replay too
_REPRODUCE_ENV = re.compile(r"^(DITORCH_\w+|(\w+_)?AUTOCOMPARE_ERROR_TOLERANCE\w*)$")
_OUTPUT_ONLY = frozenset({"DITORCH_QUIET"})  # they change what is printed, not what runs
# Settings a resumed run takes from its results file unless given again.
_RESUMED = ("device", "setup", "ops", "dtypes", "limit_samples", "backward")
# Devices whose registering setup is known: --device (or, without it, DITORCH_BACKEND) naming one implies its --setup.
DEVICE_SETUPS = {"sim": "ditorch.sim:register"}
BACKEND_VARIABLE = "DITORCH_BACKEND"  # ditorch's choice of device, which a user running on sim has already set


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m op_tools.conformance",
        description="Run PyTorch's OpInfo sample inputs on a device and on the CPU; report, per op, dtype and "
                    "direction, whether the device gets them right (OpAutoCompare's verdict). Exit status: 0 every "
                    "row that ran was checked and passed, 3 a row failed (mismatch, unsupported, crash), 4 none "
                    "failed but some were not checked (unchecked), 2 bad usage, 5 the reports cannot be written, "
                    "130 interrupted.")
    parser.add_argument("--device", help=f"the device to test (sim, cuda, npu, ...); default: {BACKEND_VARIABLE} "
                                         f"where it names {', '.join(DEVICE_SETUPS)}, else the accelerator "
                                         "torch.accelerator reports")
    parser.add_argument("--setup", action="append", metavar="MODULE[:FUNCTION]",
                        help="import this module (and call FUNCTION) in every worker (after op_db) and, to detect "
                             "the device, in this process: what makes an out-of-tree device known, e.g. 'torch_npu'; "
                             "repeatable; implied for "
                             + ", ".join(f"{d} ({s})" for d, s in DEVICE_SETUPS.items()))
    parser.add_argument("--ops", action="append", metavar="NAMES",
                        help="comma-separated: OpInfo names (softmax: that one), stems of variants (max: all "
                             "its variants), or shell-style patterns (nn.functional.*); repeatable; default: every "
                             "OpInfo")
    parser.add_argument("--dtypes", metavar="LIST",
                        help=f"comma-separated dtypes, or 'all' (each op's claimed dtypes); default: "
                             f"{','.join(DEFAULT_DTYPES)}")
    parser.add_argument("--limit-samples", type=int, metavar="N", help="run only the first N samples of each op")
    parser.add_argument("--sample", type=int, metavar="K",
                        help="run only sample K of one op in one dtype, print every comparison, save its inputs "
                             "for run_op_from_data")
    parser.add_argument("--no-backward", dest="backward", action="store_false", default=None,
                        help="compare forward results only")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                        help=f"per op x dtype; a worker past it is killed and the op marked crash "
                             f"(default {DEFAULT_TIMEOUT:g})")
    parser.add_argument("--jobs", type=int, default=1, metavar="N", help="worker processes at once (default 1)")
    parser.add_argument("--start-method", choices=START_METHODS, default="spawn",
                        help="how a worker starts: spawn (default), a new interpreter that imports PyTorch's "
                             "operator database (seconds); fork, forked from this process once it has imported "
                             "it (a fraction of a second, a restart after a crash too): the CPU and sim, not CUDA")
    parser.add_argument("--output", metavar="DIR",
                        help=f"the run's folder (default: <OP_TOOLS_RESULTS_DIR>/{RESULTS_FOLDER}/"
                             "<device>_pid<pid>_<time>_<n>)")
    parser.add_argument("--resume", metavar="RUN",
                        help=f"continue the run in this folder (or its {RESULTS_FILE}): what is done is skipped, "
                             "settings not given again are the run's")
    parser.add_argument("--compare", metavar="OTHER",
                        help="another run's conformance.csv (or its folder): both side by side in the summary "
                             "and the HTML report")
    parser.add_argument("--report", metavar="RUN",
                        help="run nothing: write the CSV and HTML report and print the summary of this run's "
                             "results")
    parser.add_argument("--list", action="store_true", help="list the selected OpInfos and their dtypes, run nothing")
    return parser


# --- settings ---

@dataclasses.dataclass
class Settings:
    device: str
    setup: tuple[str, ...]
    ops: list[str] | None
    dtypes: tuple[str, ...] | None   # None: each op's claimed dtypes
    limit_samples: int | None
    backward: bool
    implied_by: str = ""             # "--device sim", "DITORCH_BACKEND=sim": what added the device's own setup

    def header(self) -> dict:
        return {"device": self.device, "setup": list(self.setup), "ops": self.ops,
                "dtypes": "all" if self.dtypes is None else list(self.dtypes), "limit_samples": self.limit_samples,
                "backward": self.backward, "torch": torch.__version__,
                "started": time.strftime("%Y-%m-%d %H:%M:%S")}


class UsageError(ValueError):
    """A bad command line or environment; printed with the program's name, exit status 2 (``ExitStatus.USAGE``)."""


def _ops(values: list[str] | None) -> list[str] | None:
    if not values:
        return None
    return [name.strip() for value in values for name in value.split(",") if name.strip()]


def settings_from(args, resumed: dict | None) -> Settings:
    """The run's settings: the command line, else (resuming) the run's header, else the defaults."""
    given = {"device": args.device, "setup": tuple(args.setup) if args.setup else None, "ops": _ops(args.ops),
             "dtypes": args.dtypes, "limit_samples": args.limit_samples, "backward": args.backward}
    if resumed:
        for name in _RESUMED:
            if given[name] is None:
                value = resumed.get(name)
                given[name] = ",".join(value) if name == "dtypes" and isinstance(value, list) else value
            elif name == "device" and resumed.get("device") and str(given[name]) != resumed["device"]:
                raise UsageError(f"--device {given[name]} but the run being resumed ran on {resumed['device']}")
    try:
        dtypes = parse_dtypes(given["dtypes"] or ",".join(DEFAULT_DTYPES))
    except ValueError as e:
        raise UsageError(f"--dtypes {given['dtypes']!r}: {e}") from None
    if given["limit_samples"] is not None and given["limit_samples"] < 1:
        raise UsageError("--limit-samples must be at least 1")
    device, source = given["device"], f"--device {given['device']}"
    backend = os.environ.get(BACKEND_VARIABLE, "").strip().lower()
    if not device and backend in DEVICE_SETUPS:
        device, source = backend, f"{BACKEND_VARIABLE}={backend}"
    setup = tuple(given["setup"] or ())
    implied = implied_setup(device, setup, source)
    return Settings(_device(device, (*implied, *setup)), (*implied, *setup), given["ops"], dtypes,
                    given["limit_samples"], given["backward"] is not False, source if implied else "")


def implied_setup(device: str | None, setup: tuple[str, ...], source: str) -> tuple[str, ...]:
    """The setup ``device`` needs (``DEVICE_SETUPS``) where ``setup`` lacks it: ``("ditorch.sim:register",)`` for
    sim; UsageError, naming ``source``, when its package is not installed."""
    needed = DEVICE_SETUPS.get((device or "").split(":")[0])
    if needed is None or needed in setup:
        return ()
    package = needed.partition(":")[0].partition(".")[0]
    if importlib.util.find_spec(package) is None:  # looked up, not imported: op_tools never imports ditorch itself
        raise UsageError(f"{source}: the device is registered by {needed}, and {package} is not installed here; "
                         f"install it (pip install {package}), or name another --device")
    return (needed,)


def _device(name: str | None, setup: tuple[str, ...]) -> str:
    """The device to test: the one named, else the current accelerator (after the setup, run here for that);
    UsageError when there is none."""
    if name:
        try:
            return str(torch.device(name))
        except RuntimeError as e:
            if setup:  # a device the setup registers: the workers check it after running the setup
                return name
            raise UsageError(f"--device {name!r} is not a device torch knows; a device that a package registers "
                             f"needs --setup naming that package (e.g. --setup torch_npu). torch says: {e}") from None
    run_setup(setup)
    accelerator = None
    if hasattr(torch, "accelerator"):
        # a CUDA build of torch names cuda as its accelerator also where no GPU or driver is present
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    elif torch.cuda.is_available():
        accelerator = torch.device("cuda")
    if accelerator is None:
        raise UsageError("no accelerator found: name the device with --device (e.g. --device cuda, or --device sim "
                         f"for ditorch's simulated device, as {BACKEND_VARIABLE}=sim does), and with --setup the "
                         "package that registers it where torch does not know it (e.g. --setup torch_npu)")
    return accelerator.type


def reproduce_command(row: Row, settings: Settings) -> str:
    """The command that reruns ``row``'s sample alone (the variables that shape a run included)."""
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items())
           if _REPRODUCE_ENV.match(k) and k not in _OUTPUT_ONLY]
    implied = DEVICE_SETUPS.get(settings.device.split(":")[0])  # --device implies it again
    setup = [f"--setup {shlex.quote(s)}" for s in settings.setup if s != implied]
    sample = [] if row.sample is None else [f"--sample {row.sample}"]
    return " ".join([*env, "python -m op_tools.conformance", f"--device {shlex.quote(settings.device)}", *setup,
                     f"--ops {shlex.quote(row.op)}", f"--dtypes {row.dtype}", *sample])


def replay_command(folder: str, device: str) -> str:
    """run_op_from_data on saved inputs; it runs on the device ditorch detects, so a device other than CUDA is
    named to it by DITORCH_BACKEND."""
    variables = {k: v for k, v in os.environ.items() if _DEVICE_LAYER_ENV.match(k)}
    kind = device.split(":")[0]
    if kind not in ("cuda", "cpu"):
        variables.setdefault("DITORCH_BACKEND", kind)
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(variables.items())]
    return " ".join([*env, "python -m op_tools.run_op_from_data", shlex.quote(folder), "--acc_check"])


# --- running ---

def tasks_for(entries: list[OpEntry], settings: Settings) -> list[Task]:
    selected = select(entries, settings.ops)
    if settings.dtypes is None:
        return [Task(e.name, d) for e in selected for d in e.dtypes]
    return [Task(e.name, d) for e in selected for d in settings.dtypes]


def crash_rows(result: TaskResult, settings: Settings, gradients: bool) -> list[Row]:
    """The rows of an op x dtype whose worker crashed (or whose tool failed, or that never ran): forward, and
    backward where it would have run."""
    task = result.task
    directions = DIRECTIONS if gradients and settings.backward else ("forward",)
    rows = [Row(task.op, task.dtype, d, result.status, sample=result.sample, detail=result.crash,
                device=settings.device) for d in directions]
    dtype = getattr(torch, task.dtype)
    if len(rows) == 1 and (dtype.is_floating_point or dtype.is_complex):  # floating dtypes always have both rows
        reason = "--no-backward" if not settings.backward else \
            f"backward not claimed: the OpInfo lists no {task.dtype} gradients (or no autograd)"
        rows.append(Row(task.op, task.dtype, "backward", "skipped", detail=reason, device=settings.device))
    return rows


def _progress_bar(total: int, device: str):
    return reporting.progress_bar(total, f"conformance on {device}", unit="op")  # a terminal only, not under CI


def sweep(settings: Settings, folder: str, resume: bool, timeout: float, jobs: int, sample: int | None,
          start: str = "spawn") -> tuple[list[Row], list[dict], bool]:
    """Run the selected ops; return every row of the run (resumed ones included), the comparisons of
    ``--sample``, and whether the sweep was interrupted."""
    results = ResultsFile(os.path.join(folder, RESULTS_FILE))
    done: list[Row] = []
    if resume:
        results.repair()
        done = results.read()[1]
    options = CaseOptions(limit_samples=settings.limit_samples, sample=sample, backward=settings.backward,
                          save_dir=os.path.join(folder, "inputs"), details=sample is not None)
    config = WorkerConfig(settings.device, settings.setup, os.path.join(folder, "workers"),
                          threads=max(1, (os.cpu_count() or 1) // jobs) if jobs > 1 else None, start=start)
    rows_by_task: dict[tuple[str, str], list[Row]] = {}
    for row in done:
        rows_by_task.setdefault((row.op, row.dtype), []).append(row)
    details: list[dict] = []
    tasks: list[Task] = []
    interrupted = False
    try:
        with WorkerPool(config, jobs=jobs, timeout=timeout) as pool:
            entries = [OpEntry.from_dict(e) for e in pool.catalogue()]
            claims_gradients = {(e.name, d) for e in entries for d in e.gradients}
            tasks = tasks_for(entries, settings)
            if sample is not None and len(tasks) != 1:
                raise UsageError(f"--sample needs exactly one op and one dtype; --ops and --dtypes select "
                                 f"{len(tasks)}")
            todo = [t for t in tasks if (t.op, t.dtype) not in rows_by_task]
            if not resume:
                results.start(settings.header())
            reporting.console(f"conformance: {len(todo)} op x dtype to run on {settings.device}"
                              + (f" ({len(tasks) - len(todo)} done before)" if resume else "")
                              + f"; results in {folder}")
            try:
                for result in _progress(pool, todo, options, settings.device):
                    if result.rows is None:
                        rows = crash_rows(result, settings, (result.task.op, result.task.dtype) in claims_gradients)
                    else:
                        rows = [Row.from_dict(r) for r in result.rows]
                        details += result.comparisons
                    for row in rows:
                        if row.status in report.FAILING:
                            row.reproduce = reproduce_command(row, settings)
                    results.append(rows)
                    rows_by_task[(result.task.op, result.task.dtype)] = rows
            except SweepError as e:  # no worker starts any more: what did not run is reported, not checked
                left = [t for t in todo if (t.op, t.dtype) not in rows_by_task]
                reporting.logger.warning("conformance: the sweep stopped: %s; %d op x dtype not run (--resume %s "
                                         "runs them)", e, len(left), folder)
                for task in left:  # in the reports only: the results file leaves them to --resume
                    result = TaskResult(task, None, crash=f"not run: the sweep stopped: {e}", status="unchecked")
                    rows_by_task[(task.op, task.dtype)] = crash_rows(result, settings,
                                                                     (task.op, task.dtype) in claims_gradients)
    except KeyboardInterrupt:  # what finished is in the results file, and goes into the reports
        interrupted = True
    # This selection's rows in op_db's order, then those the results file holds beyond it (nothing dropped).
    keys = dict.fromkeys([(task.op, task.dtype) for task in tasks] + list(rows_by_task))
    return [row for key in keys for row in rows_by_task.get(key, [])], details, interrupted


def _progress(pool: WorkerPool, todo: list[Task], options: CaseOptions, device: str):
    """``pool.run``'s results, with a progress bar (current op, sample, direction, ETA) and a line per crash."""
    bar = _progress_bar(len(todo), device)
    if bar is not None:
        pool.on_progress = lambda task, s, d: bar.set_postfix_str(f"{task.op} {task.dtype} sample {s} {d}",
                                                                  refresh=False)
    try:
        for result in pool.run(todo, options):
            if result.rows is None:
                message = f"crash: {result.task.op} {result.task.dtype}: {result.crash}"
                bar.write(message, file=sys.stderr) if bar is not None else reporting.logger.warning(message)
            yield result
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()


class ReportsNotWrittenError(Exception):
    """The CSV or the HTML report could not be written: exit status 5 (``ExitStatus.NOT_WRITTEN``)."""


def write_reports(rows: list[Row], folder: str, title: str, other: list[Row] | None, other_label: str) -> str:
    known_gaps.mark(rows)
    try:
        write_csv(os.path.join(folder, CSV_FILE), rows)
        result_files.write_text(os.path.join(folder, HTML_FILE), html.render(rows, title, other, other_label))
    except OSError as e:  # 5, not a traceback: the rows were read or run, only their reports are missing
        raise ReportsNotWrittenError(f"cannot write the reports in {folder}: {type(e).__name__}: {e.strerror or e}; "
                                f"--report RUN --output DIR writes them elsewhere from the run's {RESULTS_FILE}"
                                ) from None
    text = report.summary(rows, title, other, other_label,
                          (f"CSV: {os.path.join(folder, CSV_FILE)}", f"HTML: {os.path.join(folder, HTML_FILE)}"))
    reporting.console(text)
    return text


def _print_sample(rows: list[Row], details: list[dict], device: str) -> None:
    columns = ("sample", "direction", "name", "verdict", "device_error", "cpu_error", "error_ratio", "max_abs_diff",
               "error_info")
    if details:
        reporting.console(reporting.table(details, columns).get_string())
    saved = next((r.inputs for r in rows if r.inputs), "")
    if saved and os.path.isdir(saved):
        reporting.console(f"inputs saved in OpCapture's format: {saved}\nreplay: {replay_command(saved, device)}")
    elif saved:
        reporting.console(f"inputs {saved}")


def _rows_of(option: str, path: str) -> list[Row]:
    """The rows of the run ``option`` names (its CSV, its results file or its folder); a UsageError naming ``option``
    for one that cannot be read (before, a missing one was a FileNotFoundError's traceback under --report)."""
    try:
        return read_rows(path)
    except FileNotFoundError:
        where = f"no {RESULTS_FILE} there" if os.path.isdir(path) else "no such file or folder"
        raise UsageError(f"{option} {path!r}: {where}") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"{option} {path!r}: {e}") from None


def _other(path: str | None) -> tuple[list[Row] | None, str]:
    if not path:
        return None, ""
    rows = _rows_of("--compare", path)
    label = rows[0].device if rows and rows[0].device else "other"
    return rows, f"{label} ({os.path.basename(os.path.normpath(path))})"


def _title(device: str) -> str:
    return f"Operator conformance of {device} against the CPU (torch {torch.__version__})"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _main(args)
    except (UsageError, SweepError, ValueError) as e:
        print(f"conformance: {e}", file=sys.stderr)
        return ExitStatus.USAGE
    except ReportsNotWrittenError as e:
        print(f"conformance: {e}", file=sys.stderr)
        return ExitStatus.NOT_WRITTEN
    except KeyboardInterrupt:  # before the sweep began, or while its reports were written
        print("conformance: interrupted", file=sys.stderr)
        return ExitStatus.INTERRUPTED


def _main(args) -> int:
    if args.timeout <= 0 or args.jobs < 1:
        raise UsageError("--timeout must be positive and --jobs at least 1")
    if args.sample is not None and args.sample < 0:
        raise UsageError("--sample must be 0 or more")
    ToleranceSpec.from_env()  # a malformed tolerance variable is an error now, not in every worker
    other, other_label = _other(args.compare)
    if args.report:
        rows = _rows_of("--report", args.report)
        folder = args.output or os.path.dirname(find_results_file(args.report)) or "."
        write_reports(rows, folder, _title(rows[0].device if rows else "?"), other, other_label)
        return status_of(report.verdict(rows))
    resumed = None
    if args.resume:
        path = find_results_file(args.resume)
        if not os.path.isfile(path):
            raise UsageError(f"--resume {args.resume!r}: no {RESULTS_FILE} there")
        resumed = ResultsFile(path).read()[0]
    settings = settings_from(args, resumed)
    if settings.implied_by:
        reporting.console(f"conformance: {settings.implied_by}: each worker runs --setup "
                          f"{DEVICE_SETUPS[settings.device.split(':')[0]]} (what registers the device)")
    if args.start_method == "fork" and settings.device.split(":")[0] == "cuda":
        raise UsageError("--start-method fork cannot run CUDA: importing PyTorch's operator database asks the CUDA "
                         "runtime whether CUDA is available, after which CUDA fails in a forked process; use spawn")
    if args.list:
        return _list(settings, args.start_method)
    if args.resume:
        folder = os.path.dirname(find_results_file(args.resume)) or "."
    else:
        folder = args.output or result_files.results_path(
            CommonConfig.from_env(), RESULTS_FOLDER,
            f"{settings.device.replace(':', '')}_{result_files.session_stem()}")
    rows, details, interrupted = sweep(settings, folder, bool(args.resume), args.timeout, args.jobs, args.sample,
                                       args.start_method)
    write_reports(rows, folder, _title(settings.device), other, other_label)
    if args.sample is not None:
        _print_sample(rows, details, settings.device)
    if interrupted:
        reporting.console(f"interrupted: continue with --resume {folder}")
        return ExitStatus.INTERRUPTED
    return status_of(report.verdict(rows))


def _list(settings: Settings, start: str) -> int:
    with WorkerPool(WorkerConfig(settings.device, settings.setup, start=start)) as pool:
        entries = [OpEntry.from_dict(e) for e in pool.catalogue()]
    selected = select(entries, settings.ops)
    reporting.console(reporting.table([{"op": e.name, "dtypes": ",".join(e.dtypes)} for e in selected]).get_string())
    reporting.console(f"{len(selected)} OpInfos")
    return 0
