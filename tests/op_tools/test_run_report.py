"""``python -m op_tools.report``, on 2-rank DDP runs of a tiny Llama on sim (torchrun): the rank where a fault is born,
the rank that received it through DDP's gradient all-reduce, a replica desync named by step and parameter, the time
skew between ranks; a clean run is clean; the HTML view in a real browser; what is found exits 3, unreadable folders
exit 2."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys

import pytest
from browser import chromium, dump_dom, needs_browser, open_once, require_browser, top_rows
from handmade_results import BORN_AT, DOWN_PROJ, NAN_PARAMETER, NAN_STEP, RECEIVED_AT, nan_spreading_report_run
from subprocess_env import ROOT, child_env, torchrun_on_sim

from op_tools.offline.run_report.analysis import RunReport, account_ranks, analyse
from op_tools.offline.run_report.html_view import first_facts, skew_absent
from op_tools.offline.run_report.readers import Event, Results, read_results

pytestmark = pytest.mark.children_import("transformers")  # their scripts train transformers models

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "run_report.py")
SILU = "torch.nn.functional.silu in model.layers.0.mlp.act_fn (forward)"
BUCKET = "torch.distributed.all_reduce in DistributedDataParallel (gradient bucket 0)"


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    out = tmp_path_factory.mktemp("run_report")
    result = torchrun_on_sim(SCRIPT, out, "clean", "nan", "noise", "desync", "rerun", timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def report(folder, *args):
    return subprocess.run([sys.executable, "-m", "op_tools.report", str(folder), *map(str, args)],
                          env=child_env(drop=("OP_",)), capture_output=True, text=True, timeout=120, cwd=ROOT)


def verdicts(out):
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def test_a_clean_ddp_run_is_clean_on_both_ranks_and_in_the_report(out):
    for rank_verdicts in verdicts(out):
        assert {tool: v["verdict"] for tool, v in rank_verdicts["clean"].items()} == \
            {"OpOverflowCheck": "clean", "OpAutoCompare": "clean"}
    done = report(out / "clean")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "replicas: agree at each of the 2 steps compared" in done.stdout
    assert "\nno anomaly in what the tools wrote on 2 ranks\n" in done.stdout
    # DDP's gradient all-reduce was checked against both ranks' inputs, once per step, and passed
    for rank in (0, 1):
        rows = [row for path in (out / "clean" / "op_autocompare_result" / f"rank{rank}").glob("*.csv")
                for row in csv.DictReader(path.open())]
        buckets = [row for row in rows if row["op"] == "torch.distributed.all_reduce"]
        assert [(row["step"], row["verdict"], row["module"]) for row in buckets] == \
            [("0", "pass", "DistributedDataParallel (gradient bucket 0)"),
             ("1", "pass", "DistributedDataParallel (gradient bucket 0)")]


def test_a_nan_born_on_rank_1_is_named_there_and_received_by_rank_0_through_the_all_reduce(out):
    overflow = [v["nan"]["OpOverflowCheck"]["found"] for v in verdicts(out)]
    assert overflow[0].startswith(f"first inf/nan received from another rank (this rank sent finite values): {BUCKET}")
    assert overflow[1].startswith(f"first inf/nan from finite inputs: {SILU}")
    done = report(out / "nan")
    assert done.returncode == 3, done.stdout + done.stderr
    assert f"  rank 1: went wrong at step 1: inf/nan in {SILU}, found by OpOverflowCheck\n" in done.stdout
    assert (f"  rank 0: received it from rank 1 through {BUCKET} at step 1; OpOverflowCheck saw the inf/nan arrive "
            "there (backward)\n") in done.stdout
    assert done.stdout.splitlines()[-2].startswith("what went wrong first: rank 1: went wrong at step 1")
    rows = list(csv.DictReader((out / "nan" / "op_run_report" / "report.csv").open()))
    ranks = [(r["rank"], r["status"], r["step"], r["op"], r["from_ranks"]) for r in rows if r["section"] == "rank"]
    assert ranks == [("0", "received", "1", "torch.distributed.all_reduce", "1"),
                     ("1", "origin", "1", "torch.nn.functional.silu", "")]


def test_noise_on_rank_1_is_found_there_and_rank_0_is_marked_as_having_received_it(out):
    found = [v["noise"]["OpAutoCompare"]["verdict"] for v in verdicts(out)]
    assert found == ["clean", "found"]  # rank 0's own calls, the all-reduce included, are all correct
    done = report(out / "noise")
    assert done.returncode == 3, done.stdout + done.stderr
    assert f"  rank 1: went wrong at step 1: mismatch in {SILU}, found by OpAutoCompare (output[0]: error" \
        in done.stdout
    assert f"  rank 0: received it from rank 1 through {BUCKET} at step 1; no anomaly of its own\n" in done.stdout


def test_a_parameter_nudged_on_one_rank_is_named_with_the_step_the_replicas_stopped_agreeing(out):
    done = report(out / "desync")
    assert done.returncode == 3, done.stdout + done.stderr
    assert ("replicas: disagree from step 1 (before its optimizer update): parameter "
            "model.layers.0.mlp.up_proj.weight differs, rank 0 vs rank 1\n") in done.stdout


def test_a_later_run_into_the_same_folder_does_not_hide_an_earlier_runs_desync(out, tmp_path):
    # each rank's two fingerprints files were read as one, step by step: the clean rerun's steps replaced the
    # desynced run's, and the report said "agree at each of the 3 steps compared", no anomaly, exit 0
    import shutil

    for scenario in ("desync", "rerun"):
        shutil.copytree(out / scenario, tmp_path / "both", dirs_exist_ok=True)
    done = report(tmp_path / "both")
    assert done.returncode == 3, done.stdout + done.stderr
    (first,) = (out / "desync" / "op_replica_fingerprints" / "rank0").iterdir()  # the earlier session's
    assert (f"replicas: disagree from step 1 (before its optimizer update) in session 1 of 2 (rank 0's {first.name}): "
            "parameter model.layers.0.mlp.up_proj.weight differs, rank 0 vs rank 1\n") in done.stdout


def test_the_slowest_rank_and_where_its_time_goes_per_step(out):
    done = report(out / "desync")
    skew = [line for line in done.stdout.splitlines() if re.match(r"  step \d+: slowest rank", line)]
    assert len(skew) == 3, done.stdout
    for line in skew:  # rank 1's matmuls were made 8 ms slower each (2 ms lost to a loaded VM's 30 ms jitter once)
        assert "slowest rank 1" in line and "its time goes to torch.nn.functional.linear" in line, line


def test_two_runs_timed_into_one_folder_are_compared_session_by_session_not_added_up_per_step(out, tmp_path):
    # each rank's times of both runs' tool sessions were added together per step: the rerun's steps 0-2 fell on the
    # first run's
    import shutil

    alone = report(out / "desync").stdout
    for scenario in ("desync", "rerun"):
        shutil.copytree(out / scenario, tmp_path / "both", dirs_exist_ok=True)
    done = report(tmp_path / "both")
    lines = [line.strip() for line in done.stdout.splitlines()
             if re.match(r"  session \d of 2, step \d+: slowest", line)]
    assert [line.split(":")[0] for line in lines] == [f"session {k} of 2, step {step}" for k in (1, 2)
                                                      for step in range(3)], done.stdout
    for line in lines[:3]:  # the first run's, exactly as a report of its folder alone gives them
        assert f"  {line.removeprefix('session 1 of 2, ')}\n" in alone, (line, alone)
    # a rank whose later run left no times: which times go together cannot be told, and none is compared
    for path in (tmp_path / "both" / "op_time_measure_result" / "rank1").iterdir():
        if path.name not in {p.name for p in (out / "desync" / "op_time_measure_result" / "rank1").iterdir()}:
            path.unlink()
    done = report(tmp_path / "both")
    assert "slowest rank" not in done.stdout, done.stdout
    assert ("the ranks wrote different numbers of time files (rank 0: 2, rank 1: 1): which go together cannot be "
            "told, and no step is compared") in done.stdout, done.stdout


@needs_browser
def test_the_html_view_shows_each_rank_the_replicas_and_the_skew(out, tmp_path):
    for scenario in ("nan", "desync"):
        assert report(out / scenario).returncode == 3
    page = out / "nan" / "op_run_report" / "report.html"
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page.read_text())  # nothing fetched from elsewhere
    dom = dump_dom(chromium(), str(page), "", str(tmp_path / "profile"))
    assert re.search(r'<div class="rank origin" id="rank-1"><div class="label">rank 1: origin \(first\)</div>'
                     r'<div class="text">rank 1: went wrong at step 1: inf/nan in torch\.nn\.functional\.silu', dom)
    assert re.search(r'<div class="rank received" id="rank-0"><div class="label">rank 0: received</div>', dom)
    desync = dump_dom(chromium(), str(out / "desync" / "op_run_report" / "report.html"), "", str(tmp_path / "p2"))
    assert '<p id="replicas" class="desync">disagree from step 1' in desync
    slowest = re.findall(r'<tr class="slowest"><td>(\d+)</td><td>(\d+)</td>', desync)
    assert slowest == [("0", "1"), ("1", "1"), ("2", "1")]


def test_a_folder_with_nothing_op_tools_wrote_or_none_at_all_exits_2(tmp_path):
    for folder in (tmp_path, tmp_path / "missing"):
        done = report(folder)
        assert done.returncode == 2 and done.stdout == ""
        assert done.stderr.startswith("op_tools.report: "), done.stderr


def test_the_parent_of_the_results_folder_and_a_folder_of_saved_calls_say_what_they_hold(sim, tmp_path):
    # both said "holds nothing op_tools wrote (none of ...)": the calls OpCapture saved and the replay's summary
    # (a mismatch among them, maybe) unsaid, and the results folder below unnamed
    import torch

    import op_tools
    from op_tools.offline.run_op_from_data import main as replay

    results = tmp_path / "results"  # the OP_TOOLS_RESULTS_DIR tests/op_tools/conftest.py sets
    x = torch.randn(4, device=sim)
    with op_tools.OpCapture():
        torch.nn.functional.silu(x)
    assert replay([str(results / "op_capture_results")]) == 0
    held = (f"holds only what this report does not judge: 1 call OpCapture saved in op_capture_results/ (python -m "
            f"op_tools.run_op_from_data {results / 'op_capture_results'} reruns and judges them); 1 replay summary "
            "in op_replay_result/ (each holds its replay's verdicts, in its status column)\n")
    done = report(results)
    assert done.returncode == 2 and done.stderr == f"op_tools.report: {results} {held}", done.stderr
    done = report(tmp_path)
    assert done.returncode == 2 and done.stderr == \
        f"op_tools.report: {tmp_path} holds nothing op_tools wrote, but {results} {held}", done.stderr
    _write_anomalies(results, [])  # beside a tool the report judges: said on a NOTE line, and the verdict its own
    done = report(tmp_path)
    assert done.returncode == 2 and done.stderr == f"op_tools.report: {tmp_path} holds nothing op_tools wrote, " \
        f"but {results} holds op_training_monitor/, op_capture_results/, op_replay_result/: give that folder (the " \
        "run's OP_TOOLS_RESULTS_DIR)\n", done.stderr
    assert "\nNOTE: 1 replay summary in op_replay_result/ not judged here: each holds its replay's verdicts, in its " \
        "status column\n" in report(results).stdout


def test_a_damaged_file_is_named_and_the_rest_still_read(out, tmp_path):
    import shutil

    shutil.copytree(out / "nan", tmp_path / "nan")
    (tmp_path / "nan" / "op_overflow_check_result" / "rank1" / "overflow_damaged.json").write_text("{")
    done = report(tmp_path / "nan")
    assert done.returncode == 3
    assert "NOT READ: " in done.stdout and "overflow_damaged.json: JSONDecodeError" in done.stdout


def test_an_autocompare_csv_cut_inside_a_row_is_not_read_and_nothing_is_concluded(sim, tmp_path, monkeypatch):
    import torch

    import ditorch.sim
    import op_tools

    monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(tmp_path))
    x = torch.linspace(-2, 2, 64, device=sim)
    with ditorch.sim.faults("silu:noise=1e-2"), op_tools.OpAutoCompare():
        torch.nn.functional.silu(x).sum()
    (table,) = (tmp_path / "op_autocompare_result").glob("op_autocompare_info_*.csv")
    assert [e.op for e in read_results(str(tmp_path)).anomalies] == ["torch.nn.functional.silu"]  # intact: found
    text = table.read_text()
    failed = text.index(",FAIL,")
    line = text.count("\n", 0, failed) + 1
    table.write_text(text[:failed])  # a copy cut inside the failing row: its verdict and the rest lost
    done = report(tmp_path)
    assert done.returncode == 4, done.stdout + done.stderr  # not "no anomaly", exit 0
    header = len(next(csv.reader([text.splitlines()[0]])))
    fields = len(next(csv.reader([text[:failed].splitlines()[-1]])))
    assert f"NOT READ: {table}: ValueError: line {line}: {fields} fields, the header has {header} (a row cut short, " \
        "or run on)\n" in done.stdout
    assert "read: 0 files from OpAutoCompare (ranks 0)\n" in done.stdout
    # every field there, the last one cut: the line end is missing
    table.write_text(text.rstrip("\r\n")[:-1])
    (unread,) = read_results(str(tmp_path)).unreadable
    assert re.fullmatch(rf"{re.escape(str(table))}: ValueError: line \d+: cut short \(no line end\)", unread), unread


def test_a_tool_that_did_not_check_every_call_earns_the_run_no_clean_verdict(sim, tmp_path, monkeypatch):
    # OpAutoCompare said "unchecked" (calls inside torch.func transforms); its files held no anomaly, and the report
    # said "no anomaly", exit 0
    import torch

    import op_tools

    monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(tmp_path))
    x = torch.linspace(-2, 2, 64, device=sim)
    with op_tools.OpAutoCompare(), op_tools.OpOverflowCheck():
        torch.nn.functional.silu(x).sum()
    assert not list(tmp_path.glob("*/unchecked_*.json"))  # a clean session writes none
    assert report(tmp_path).returncode == 0
    with op_tools.OpAutoCompare() as compare:
        torch.nn.functional.silu(x).sum()
        torch.func.vmap(torch.nn.functional.silu)(x.reshape(8, 8))
    assert compare.verdict() == "unchecked"
    done = report(tmp_path)
    assert done.returncode == 4, done.stdout + done.stderr
    assert f"NOT CHECKED: rank 0: OpAutoCompare: {compare.not_checked()}\n" in done.stdout
    assert "but 1 tool session did not check every call (above)" in done.stdout


KILLED = """
import os, signal, torch, ditorch, op_tools
x = torch.linspace(-2, 2, 64, device="cuda")
with op_tools.OpAutoCompare() as compare, op_tools.OpOverflowCheck() as overflow:
    torch.nn.functional.gelu(x).sum()  # the fault: a failing call OpAutoCompare judges at its stop()
    assert len(os.listdir(os.path.join(os.environ["OP_TOOLS_RESULTS_DIR"], "op_overflow_check_result"))) == 1
    os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer: no exit handler runs
"""


def test_a_session_killed_before_its_verdict_earns_the_run_no_clean_verdict(tmp_path, monkeypatch):
    # OpAutoCompare's failing rows, judged at its stop, never written; OpOverflowCheck's folder alone said "ran and
    # found nothing": the report said "no anomaly", exit 0
    env = child_env({"DITORCH_BACKEND": "sim", "DITORCH_QUIET": "1", "OP_TOOLS_RESULTS_DIR": str(tmp_path),
                     "DITORCH_SIM_FAULTS": "gelu:noise=1e-2"}, drop=("OP_", "DITORCH_"))
    killed = subprocess.run([sys.executable, "-c", KILLED], env=env, capture_output=True, text=True, timeout=120,
                            cwd=tmp_path)
    assert killed.returncode == -9, killed.stdout + killed.stderr
    done = report(tmp_path)
    assert done.returncode == 4, done.stdout + done.stderr
    for tool in ("OpAutoCompare", "OpOverflowCheck"):
        assert re.search(rf"NOT CHECKED: rank 0: {tool}: its session \(pid \d+\) never stopped: the process was "
                         r"killed, or is still running \(running_pid\d+_[^)]*\.json\); its calls are not all judged\n",
                         done.stdout), done.stdout
    # a session that stopped leaves none
    import op_tools

    monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(tmp_path / "stopped"))
    with op_tools.OpOverflowCheck():
        (marker,) = (tmp_path / "stopped").glob("*/running_*.json")
    assert not marker.exists()


def _event(rank, step, op, **fields):
    return Event(rank, step, float(step), op, "", "forward", "OpOverflowCheck", "inf/nan", **fields)


def test_a_collective_that_itself_computed_wrong_is_an_origin_not_a_receiver():
    results = Results("x", ranks={0, 1})
    results.anomalies = [
        Event(0, 0, 1.0, "torch.distributed.all_reduce", "", "forward", "OpAutoCompare", "mismatch"),
        _event(1, 0, "torch.distributed.all_reduce", received=True)]
    accounts, first = account_ranks(results)
    assert [a.status for a in accounts] == ["origin", "received"]
    assert first is not None and first.rank == 0 and accounts[1].from_ranks == (0,)


def test_a_rank_that_read_another_ranks_fault_first_names_no_op_as_its_channel():
    # Tensor parallelism: rank 0 read rank 1's nan first in mse_loss, after the row-parallel all-reduce no tool sees.
    # The report said rank 0 "received it from rank 1 through torch.nn.functional.mse_loss"
    results = Results("x", ranks={0, 1})
    results.anomalies = [_event(1, 0, "torch.nn.functional.gelu"),
                         _event(0, 0, "torch.nn.functional.mse_loss", came_in=True)]
    accounts, first = account_ranks(results)
    assert [a.status for a in accounts] == ["received", "origin"] and first is not None and first.rank == 1
    assert accounts[0].text() == ("rank 0: received it from rank 1 through a collective no tool saw (a functional "
                                  "collective, as DTensor's, runs below the tools); inf/nan read first by "
                                  "torch.nn.functional.mse_loss (forward) at step 0")


def test_a_rank_with_no_collective_after_the_fault_is_not_said_to_have_received_it():
    results = Results("x", ranks={0, 1})
    results.anomalies = [_event(1, 0, "torch.nn.functional.silu")]
    accounts, _ = account_ranks(results)
    assert [a.status for a in accounts] == ["clean", "origin"]



def test_an_inf_nan_no_call_made_on_a_rank_was_received_where_another_rank_made_one():
    # Rank 0 read the NaN first in square, made by none of its calls (a DTensor all-reduce below the tools brought
    # it), earlier by its clock than rank 1's silu made it: rank 1 is the origin all the same.
    results = Results("x", ranks={0, 1})
    results.anomalies = [_event(0, 0, "torch.Tensor.square", came_in=True), _event(1, 1, "torch.nn.functional.silu")]
    accounts, first = account_ranks(results)
    assert [(a.status, a.from_ranks) for a in accounts] == [("received", (1,)), ("origin", ())]
    assert first is not None and first.rank == 1


def test_an_inf_nan_no_call_made_on_any_rank_is_where_it_came_in_with_the_data():
    results = Results("x", ranks={0, 1})
    results.anomalies = [_event(1, 2, "torch.Tensor.to", came_in=True)]
    accounts, first = account_ranks(results)
    assert [a.status for a in accounts] == ["clean", "origin"]
    assert first is not None and first.text() == (
        "rank 1: went wrong at step 2: inf/nan read first by torch.Tensor.to (forward), made by no call "
        "OpOverflowCheck checked (the program's data, or a write no tool saw)")

# --- TrainingMonitor's anomalies files (docs/tools/training_monitor.md), written by the monitor's own writer ---

SESSION = "pid1_2025-01-01-00-00-00_0"
ACT_FN = "model.layers.0.mlp.act_fn"
UP_PROJ = "model.layers.0.mlp.up_proj.weight"


def _anomaly(rank, step, time, rule, module, phase, value, message, **extra):
    return {"rank": rank, "time": time, "rule": rule, "step": step, "module": module, "phase": phase, "value": value,
            "message": message, **extra}


def _write_anomalies(folder, records, rank=None):
    from op_tools.output.result_files import JsonLinesFile

    path = folder / "op_training_monitor" / (f"rank{rank}" if rank is not None else "") / f"anomalies_{SESSION}.jsonl"
    anomalies = JsonLinesFile(str(path))
    for record in records:
        anomalies.write(record)
    anomalies.close()
    return path


@pytest.fixture
def monitor_run(tmp_path):
    """Rank 1's activation went NaN in forward at step 3; rank 0 saw its gradient non-finite only at the optimizer
    step (after DDP's all-reduce), by its own clock earlier; later rank 0's loss scale kept dropping."""
    _write_anomalies(tmp_path, [
        _anomaly(0, 3, 1000.25, "nonfinite", UP_PROJ, "optimizer", float("inf"),
                 f"first non-finite at step 3: gradient of {UP_PROJ} grad_norm = inf", statistic="grad_norm"),
        _anomaly(0, 5, 1002.0, "loss_scale_dropping", "", "optimizer", 128.0,
                 "loss scale dropping at step 5: 128 after 3 drops in a row", drops=3)], rank=0)
    _write_anomalies(tmp_path, [_anomaly(1, 3, 1000.5, "nonfinite", ACT_FN, "forward", float("nan"),
                                         f"first non-finite at step 3: activation of {ACT_FN} norm = nan",
                                         statistic="norm")], rank=1)
    return tmp_path


def test_monitor_anomalies_alone_name_the_rank_step_and_module_where_it_went_wrong_and_exit_3(monitor_run):
    done = report(monitor_run)
    assert done.returncode == 3, done.stdout + done.stderr
    origin = f"rank 1: went wrong at step 3: nonfinite in {ACT_FN} (forward), found by TrainingMonitor (value nan)"
    assert f"\n  {origin}\n" in done.stdout
    # rank 0's clock says first, but its non-finite came in a later phase of the same step: received
    assert (f"\n  rank 0: received it from rank 1 at step 3, in a later phase of the step (the monitor sees no "
            f"collective); its first anomaly: nonfinite in {UP_PROJ} (optimizer), found by TrainingMonitor "
            "(value inf)\n") in done.stdout
    assert done.stdout.splitlines()[-2] == f"what went wrong first: {origin}"
    assert "training monitor: 3 anomalies\n" in done.stdout
    rows = list(csv.DictReader((monitor_run / "op_run_report" / "report.csv").open()))
    assert [(r["kind"], r["rank"], r["step"], r["module"], r["phase"], r["value"], r["detail"][:24])
            for r in rows if r["section"] == "training monitor"] == [
        ("nonfinite", "0", "3", UP_PROJ, "optimizer", "inf", "first non-finite at step"),
        ("nonfinite", "1", "3", ACT_FN, "forward", "nan", "first non-finite at step"),
        ("loss_scale_dropping", "0", "5", "", "optimizer", "128.0", "loss scale dropping at s")]


def test_in_process_the_report_exits_3_found_5_files_not_written_1_its_own_failure(monitor_run, capsys):
    from unittest import mock

    from op_tools.offline.run_report import main

    assert main([str(monitor_run)]) == 3
    (monitor_run / "a_file").write_text("")  # a file where a folder should be: unwritable even for root
    capsys.readouterr()
    assert main([str(monitor_run), "--csv", str(monitor_run / "a_file" / "report.csv")]) == 5
    out, err = capsys.readouterr()
    assert "what went wrong first: rank 1" in out and err.startswith("op_tools.report: cannot write the report: ")
    with mock.patch("op_tools.offline.run_report.cli.analyse", side_effect=RuntimeError("a bug")):
        assert main([str(monitor_run)]) == 1  # the status of a crash, not a verdict
    assert "nothing concluded" in capsys.readouterr().err


def test_a_monitor_folder_with_an_empty_anomalies_file_is_clean(tmp_path):
    _write_anomalies(tmp_path, [])
    done = report(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "read: 1 file from TrainingMonitor (ranks 0)\n" in done.stdout
    assert "\ntraining monitor: no anomaly (ranks 0)\nno anomaly in what the tools wrote on 1 rank\n" in done.stdout


def test_run_recordings_in_the_folder_are_said_not_judged_here(tmp_path):
    # a folder of recordings alone "held nothing op_tools wrote"; beside another tool's files, the report judged
    # those and said nothing of the recordings it passed over
    recordings = tmp_path / "op_capture_results"
    for rank in (0, 1):
        os.makedirs(recordings / f"rank{rank}")
        (recordings / f"rank{rank}" / f"run_pid{rank}.jsonl").write_text("{}\n")
    done = report(tmp_path)
    assert done.returncode == 2 and done.stderr.strip() == (
        f"op_tools.report: {tmp_path} holds only what this report does not judge: 2 run recordings in "
        "op_capture_results/ (two runs' recordings are compared by python -m op_tools.compare_runs RUN_A RUN_B)"), \
        done.stderr
    _write_anomalies(tmp_path, [])
    done = report(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert ("NOTE: 2 run recordings in op_capture_results/ not judged here: two runs' recordings are compared by "
            "python -m op_tools.compare_runs RUN_A RUN_B\n") in done.stdout


def test_a_malformed_monitor_line_is_named_with_its_file_and_nothing_is_concluded(tmp_path):
    path = _write_anomalies(tmp_path, [_anomaly(None, 0, 1.0, "grad_norm_spike", UP_PROJ, "optimizer", 9.0, "spike")])
    with path.open("a") as f:
        f.write('{"rank": null, "time": 2.0, "rule": "nonfinite", "step": 1, "module": "", "phase": "optimiser", '
                '"value": NaN, "message": "loss = nan"}\n')
    done = report(tmp_path)
    assert done.returncode == 4, done.stdout + done.stderr  # incomplete: nothing found, not everything read
    assert f"NOT READ: {path}: ValueError: line 2: ValueError: phase is 'optimiser', not one of forward, " \
        "backward, optimizer\n" in done.stdout
    assert done.stdout.splitlines()[-2] == ("nothing concluded: no anomaly in what the tools wrote on 1 rank, but "
                                            "1 file could not be read (above)")


def test_a_partial_anomalies_file_of_a_run_that_died_reads_its_complete_lines(tmp_path):
    folder = tmp_path / "op_training_monitor"
    folder.mkdir()
    loss = _anomaly(None, 2, 5.0, "nonfinite", "", "optimizer", float("nan"), "loss = nan", statistic="loss")
    (folder / f"anomalies_{SESSION}.jsonl.partial").write_text(json.dumps(loss) + '\n{"rank": null, "ti')
    done = report(tmp_path)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "what went wrong first: rank 0: went wrong at step 2: nonfinite in the step (optimizer), found by " \
        "TrainingMonitor (value nan)\n" in done.stdout


def _monitor_nonfinite(rank, step, time, phase, module="model.layers.0"):
    return Event(rank, step, time, "", module, phase, "TrainingMonitor", "nonfinite", value=float("nan"))


def test_a_nonfinite_first_seen_on_two_ranks_in_the_same_phase_names_both_and_guesses_no_sender():
    results = Results("x", ranks={0, 1, 2})
    results.anomalies = [_monitor_nonfinite(0, 2, 10.2, "backward"), _monitor_nonfinite(1, 2, 10.1, "backward"),
                         _monitor_nonfinite(2, 2, 10.0, "optimizer")]
    accounts, first = account_ranks(results)
    assert [(a.status, a.first_seen_on, a.from_ranks) for a in accounts] == [
        ("origin", (0, 1), ()), ("origin", (0, 1), ()), ("received", (), (0, 1))]
    assert first is not None and first.text().startswith(
        "rank 1: first seen on ranks 0, 1 at step 2 (which one sent it cannot be told): nonfinite in model.layers.0 "
        "(backward), found by TrainingMonitor")


def test_an_inf_nan_overflow_check_found_from_finite_inputs_stays_the_origin_over_a_later_monitor_one():
    results = Results("x", ranks={0, 1})
    results.anomalies = [_event(0, 1, "torch.nn.functional.silu"), _monitor_nonfinite(1, 1, 0.5, "optimizer")]
    accounts, first = account_ranks(results)
    assert [(a.status, a.from_ranks) for a in accounts] == [("origin", ()), ("received", (0,))]
    assert first is not None and first.rank == 0


# --- the HTML view of a hand-made two-rank run (handmade_results.py), opened once in a browser ---

def test_the_first_anomalys_source_line_is_read_from_the_overflow_record_and_the_autocompare_row(tmp_path):
    nan_spreading_report_run(tmp_path)
    results = read_results(str(tmp_path))
    assert {(e.rank, e.tool, e.location) for e in results.anomalies} == {
        (1, "OpOverflowCheck", BORN_AT), (0, "OpOverflowCheck", RECEIVED_AT), (1, "TrainingMonitor", ""),
        (0, "TrainingMonitor", "")}  # the monitor watches modules, not calls
    assert first_facts(analyse(results)) == [
        ("rank", "1"), ("step", str(NAN_STEP)), ("module", DOWN_PROJ), ("op", "torch.nn.functional.linear"),
        ("phase", "backward"), ("found by", "OpOverflowCheck"), ("source", BORN_AT)]
    folder = tmp_path / "op_autocompare_result" / "rank1"  # a full stack is kept a frame a line: the innermost
    folder.mkdir(parents=True)
    (folder / "op_autocompare_info_s.csv").write_text(
        "op,forward_id,phase,module,name,verdict,error_info,location,rank,step,time\n"
        f'torch.add,3,forward,m,output[0],FAIL,err,"{BORN_AT}\n/home/user/train.py:50 main: step()",1,0,1.0\n')
    [mismatch] = [e for e in read_results(str(tmp_path)).anomalies if e.kind == "mismatch"]
    assert mismatch.location == BORN_AT


def test_a_report_without_the_skew_says_why_in_one_line():
    def why(times, tools=("OpTimeMeasure",)):
        results = Results("x", ranks={0, 1}, tools={tool: {0, 1} for tool in tools}, times=[times] if times else [])
        return skew_absent(RunReport(results, [], None, None, 0, []))

    assert why({}, tools=()) == "not measured: OpTimeMeasure did not run (op_time_measure_result/ is not in the folder)"
    assert why({0: {1: {"torch.add": 1.0}}}) == "nothing to compare: only rank 0's calls were timed, and the skew " \
        "compares ranks"
    assert why({0: {1: {"torch.add": 1.0}}, 1: {2: {"torch.add": 1.0}}}) == \
        "nothing to compare: ranks 0, 1 timed their calls, but no step on two of them"


@pytest.fixture(scope="module")
def handmade(tmp_path_factory):
    """(results folder, DOM of its report.html after its scripts ran, screenshot path), the report made in-process."""
    from op_tools.offline.run_report import main

    browser = require_browser()
    root = tmp_path_factory.mktemp("handmade")
    nan_spreading_report_run(root)
    assert main([str(root)]) == 3
    page = str(root / "op_run_report" / "report.html")
    png = str(root / "run_report.png")
    dom, _ = open_once(browser, page, png)
    return root, dom, png


@needs_browser
def test_the_banner_stays_at_the_top_with_the_first_anomalys_rank_step_module_op_phase_and_source(handmade):
    _, dom, png = handmade
    assert re.search(r"#banner \{ position: sticky; top: 0;", dom)
    assert re.search(r'<body>\s*<header id="banner" class="verdict-found"><div class="page-title">op_tools run report'
                     r'</div><h1 id="verdict">what went wrong first: rank 1: went wrong at step 8: inf/nan in '
                     r"torch\.nn\.functional\.linear", dom)
    facts = re.findall(r'<span class="field" data-field="([\w ]+)"><span class="field-name">[\w ]+</span><code>([^<]+)'
                       r"</code></span>", dom)
    assert facts == [("rank", "1"), ("step", str(NAN_STEP)), ("module", DOWN_PROJ),
                     ("op", "torch.nn.functional.linear"), ("phase", "backward"), ("found by", "OpOverflowCheck"),
                     ("source", BORN_AT)]
    # on load, the window shows it first: the found verdict's red edge and the banner's white, from the top row down
    assert [(row[2], row[20]) for row in top_rows(png, 8)] == [((0xcc, 0, 0), (0xff, 0xff, 0xff))] * 8


@needs_browser
def test_each_rank_card_shows_the_source_line_of_its_first_anomaly(handmade):
    _, dom, _ = handmade
    cards = re.findall(r'<div class="rank (\w+)" id="rank-(\d)"><div class="label">[^<]*</div><div class="text">[^<]*'
                       r'</div><div class="source">([^<]*)</div></div>', dom)
    assert cards == [("received", "0", RECEIVED_AT), ("origin", "1", BORN_AT)]
    assert '<div class="label">rank 1: origin (first)</div>' in dom


@needs_browser
def test_a_section_with_no_rows_is_one_line_and_the_monitor_page_is_linked(handmade):
    root, dom, _ = handmade
    assert "<table" not in dom.split('<div id="skew-section">')[1].split("</div>")[0]
    assert ('<div id="skew-section"><p class="none">not measured: OpTimeMeasure did not run '
            "(op_time_measure_result/ is not in the folder)</p></div>") in dom
    rows = re.findall(r'<tr class="anomaly nonfinite"><td>nonfinite</td><td>(\d)</td><td>(\d+)</td><td>([\w.]+)</td>'
                      r"<td>backward</td><td>nan</td><td>first non-finite value at step 8", dom)
    assert rows == [("1", str(NAN_STEP), NAN_PARAMETER), ("0", str(NAN_STEP), NAN_PARAMETER)]
    [href] = re.findall(r'<p id="monitor-link">[^<]*<a href="([^"]+)">', dom)
    assert href == "../op_training_monitor/rank0/monitor_pid100_2025-01-01-00-00-00_1.html"
    assert (root / "op_run_report" / href).resolve().is_file()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", dom)  # nothing fetched from elsewhere


def test_without_a_monitor_page_the_report_links_none(monitor_run):
    from op_tools.offline.run_report import main

    assert main([str(monitor_run)]) == 3  # the monitor's anomalies alone: no CSV, no page
    page = (monitor_run / "op_run_report" / "report.html").read_text()
    assert 'id="monitor-link"' not in page and not list(monitor_run.glob("**/monitor_*.html"))
