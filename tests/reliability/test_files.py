"""Files: written atomically (a killed process leaves whole files or none), pending summaries flushed on normal
exit and on SIGTERM, two processes sharing a results folder never overwrite each other. Subprocesses run at once."""

from __future__ import annotations

import csv
import json
import os
import signal
import time

import pytest
import torch
from conftest import start_script

from op_tools.tools.capture import load_op_args

pytestmark = pytest.mark.children_import("transformers")  # their scripts train transformers models


def _wait_for_line(process, text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if text in line:
            return
        if not line and process.poll() is not None:
            raise AssertionError(f"exited {process.returncode} before {text!r}: {process.stderr.read()[-2000:]}")
    raise AssertionError(f"no {text!r} within {timeout} s")


def _files(root, suffix: str) -> list[str]:
    return [os.path.join(d, n) for d, _, names in os.walk(root) for n in names if n.endswith(suffix)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Start every subprocess of this module at once; each test waits for the one it checks. Those still running at
    the module's end (a test that failed before stopping its child, or was not selected: the ``loop`` and
    ``sigterm-in-call`` children never end by themselves) are killed, not left to load the machine."""
    base = tmp_path_factory.mktemp("files")
    folders = {name: str(base / name) for name in ("killed", "sigterm", "in-call", "exit", "shared")}
    processes = {
        "killed": start_script("train_under_tools.py", "loop", OP_TOOLS_RESULTS_DIR=folders["killed"],
                               OP_TOOLS_VERBOSE="0"),
        "sigterm": start_script("train_under_tools.py", "sigterm", OP_TOOLS_RESULTS_DIR=folders["sigterm"],
                                OP_TOOLS_VERBOSE="0"),
        "in-call": start_script("train_under_tools.py", "sigterm-in-call", OP_TOOLS_RESULTS_DIR=folders["in-call"],
                                OP_TOOLS_VERBOSE="0", GO_FILE=str(base / "in-call-go")),
        "exit": start_script("train_under_tools.py", "exit", OP_TOOLS_RESULTS_DIR=folders["exit"],
                             OP_TOOLS_VERBOSE="0"),
        "shared": [start_script("train_under_tools.py", "both", OP_TOOLS_RESULTS_DIR=folders["shared"],
                                OP_TOOLS_VERBOSE="0") for _ in range(2)],
    }
    yield folders, processes
    for process in [p for v in processes.values() for p in (v if isinstance(v, list) else [v])]:
        if process.poll() is None:
            process.kill()
        process.communicate()  # its pipes closed, the process reaped


def test_a_killed_process_leaves_only_whole_captures_and_csvs(runs, sim):
    folders, processes = runs
    process = processes["killed"]
    _wait_for_line(process, "round")  # a whole round written: captures and time-measure files exist
    time.sleep(0.7)  # kill in the middle of the next round's writing
    process.send_signal(signal.SIGKILL)
    process.wait(30)
    captures, tables, traces = (_files(folders["killed"], s) for s in (".pth", ".csv", ".json"))
    assert len(captures) > 100 and len(tables) >= 2 and traces
    for path in captures:  # whole files, loadable the safe way (references resolved)
        if not os.path.basename(path).startswith(".tmp-"):
            data = load_op_args(path)
            assert set(data) >= {"name", "args", "kwargs"}
            torch.load(path, weights_only=True)
    for path in tables:
        if not os.path.basename(path).startswith(".tmp-"):
            with open(path, newline="") as f:
                rows = list(csv.reader(f))
            assert len(rows) > 1 and all(len(r) == len(rows[0]) for r in rows), path
    for path in traces:
        if not os.path.basename(path).startswith(".tmp-"):
            json.load(open(path))


def _time_measure_and_autocompare_files(root) -> tuple[list, list]:
    return (_files(os.path.join(root, "op_time_measure_result"), ".csv"),
            _files(os.path.join(root, "op_autocompare_result"), ".csv"))


def test_sigterm_flushes_the_summaries_of_tools_never_stopped_and_ends_as_sigterm(runs):
    folders, processes = runs
    process = processes["sigterm"]
    _wait_for_line(process, "ready")
    assert _time_measure_and_autocompare_files(folders["sigterm"]) == ([], [])  # nothing written before
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    assert process.returncode == -signal.SIGTERM, err[-2000:]  # died of the signal, as with no handler
    timings, comparisons = _time_measure_and_autocompare_files(folders["sigterm"])
    assert len(timings) == 3 and len(comparisons) == 1, err[-2000:]  # per call, per op, per module
    assert "OpTimeMeasure:" in out and "OpAutoCompare summary" in out


def test_a_call_sigterm_cuts_short_is_said_to_be_and_blamed_on_no_bug(runs):
    """SIGTERM in the middle of a handled call: the summary counts that call as cut short (NOT CHECKED, with its op),
    not as a call the tool forgot ("an OpAutoCompare bug", which it said before), and the unchecked file says it."""
    folders, processes = runs
    process = processes["in-call"]
    _wait_for_line(process, "ready")
    open(os.path.join(os.path.dirname(folders["in-call"]), "in-call-go"), "w").close()  # its products begin
    time.sleep(1.0)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    assert process.returncode == -signal.SIGTERM, err[-2000:]
    assert "NOT CHECKED: 1 call running when SIGTERM ended the run, with no verdict (torch." in out, out[-2000:]
    assert "bug" not in out
    unchecked = _files(folders["in-call"], ".json")
    assert len(unchecked) == 1 and "SIGTERM" in json.load(open(unchecked[0]))["not_checked"]


def test_normal_exit_flushes_the_summaries_of_tools_never_stopped(runs):
    folders, processes = runs
    process = processes["exit"]
    out, err = process.communicate(timeout=180)
    assert process.returncode == 0, err[-2000:]
    timings, comparisons = _time_measure_and_autocompare_files(folders["exit"])
    assert len(timings) == 3 and len(comparisons) == 1
    with open(comparisons[0], newline="") as f:
        assert len(list(csv.DictReader(f))) > 50


def test_two_processes_sharing_a_results_folder_keep_every_file(runs):
    folders, processes = runs
    reports = []
    for process in processes["shared"]:
        out, err = process.communicate(timeout=180)
        assert process.returncode == 0, err[-2000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    root = folders["shared"]
    captures = _files(os.path.join(root, "op_capture_results"), ".pth")
    assert len(captures) == sum(r["capture_files"] for r in reports)  # none overwritten
    pids = {p.split(os.sep)[-4] for p in captures}  # <op>/<pid>/<forward_id>/<time>/<file>
    assert len(pids) == 2
    written = [f for r in reports for f in r["time_files"]]
    assert len(set(written)) == 8 and all(os.path.exists(f) for f in written)  # 2 x (3 CSV, a trace)
