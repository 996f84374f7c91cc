"""What the run report says about the replicas is what the folder holds: fingerprints that agree while every
parameter is NaN say so (and the verdict is not clean), and a report with nothing compared says why."""

from __future__ import annotations

import json

import pytest
import torch

from op_tools.core.replicas import FORMAT, ReplicaFingerprints
from op_tools.offline.run_report.analysis import analyse
from op_tools.offline.run_report.readers import FingerprintSession, Results, read_results
from op_tools.offline.run_report.report import console_report, csv_rows
from op_tools.output.result_files import JsonLinesFile


def _fingerprint_file(path, module, step_of):
    """One rank's fingerprints file, written by the tools' own hook before ``optimizer.step()``."""
    fingerprints = ReplicaFingerprints()
    fingerprints._file = JsonLinesFile(str(path))
    fingerprints._file.write({"format": FORMAT, "version": 1})
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    for _ in range(step_of):
        fingerprints._write(optimizer)
    fingerprints._file.close()
    return [json.loads(line) for line in open(path)]


@pytest.mark.parametrize("device", ["cpu", "sim"])
def test_the_fingerprints_name_each_parameter_holding_inf_or_nan(tmp_path, request, device):
    if device == "sim":
        request.getfixturevalue("sim")
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2)).to(device)
    with torch.no_grad():
        model[0].weight[1, 2] = float("nan")
        model[1].bias[0] = float("-inf")
    lines = _fingerprint_file(tmp_path / "f.jsonl", model, 1)
    # named by their place in the optimizer (no tool ran to name them by module)
    assert lines[1]["nonfinite"] == ["param_groups[0][0]", "param_groups[0][3]"]
    assert len(lines[1]["params"]) == 4


def _results(fingerprints: dict, ranks=(0, 1)) -> Results:
    """One session's fingerprints: rank -> step -> record."""
    sessions = [FingerprintSession(fingerprints, {rank: "f.jsonl" for rank in fingerprints})] if fingerprints else []
    return Results("run", ranks=set(ranks), tools={"OpOverflowCheck": set(ranks)}, fingerprints=sessions)


def _step(nonfinite=(), value=7):
    return {"params": {"w": value, "b": 1}, "grads": {}, "nonfinite": list(nonfinite)}


def test_replicas_that_agree_while_holding_nan_say_so_and_the_report_is_not_clean():
    report = analyse(_results({rank: {0: _step(), 1: _step(["w", "b"])} for rank in (0, 1)}))
    text = console_report(report)
    assert ("replicas: agree at each of the 2 steps compared, but from step 1, parameter w and 1 more hold inf/nan "
            "on ranks 0,1\n") in text
    assert report.verdict() == "found"
    assert text.splitlines()[-1] == "what went wrong first: not found by a tool; from step 1, parameter w and 1 more " \
        "hold inf/nan on ranks 0,1"
    assert [(r["section"], r["rank"], r["step"], r["module"]) for r in csv_rows(report)] == \
        [("rank", 0, "", ""), ("rank", 1, "", ""), ("parameters", 0, 1, "w"), ("parameters", 1, 1, "w")]


def test_clean_finite_replicas_agree_and_are_clean():
    report = analyse(_results({rank: {0: _step(), 1: _step()} for rank in (0, 1)}))
    assert "replicas: agree at each of the 2 steps compared\n" in console_report(report)
    assert report.verdict() == "clean"


@pytest.mark.parametrize("ranks, fingerprints, why", [
    ((0,), {0: {0: _step()}}, "the results hold one rank"),
    ((0, 1), {}, "no rank wrote replica fingerprints: the op tools write them before each optimizer step they "
     "see, unless OP_TOOLS_REPLICA_FINGERPRINTS=0; TrainingMonitor does not"),
    ((0, 1, 2), {1: {0: _step()}}, "only rank 1 wrote fingerprints, not ranks 0,2"),
    ((0, 1), {0: {}, 1: {}}, "no optimizer step ran while an op tool was on (the fingerprints are written before "
     "each), or every parameter is sharded (FSDP2's: no replica holds another's)"),
    ((0, 1), {0: {0: _step()}, 1: {1: _step()}}, "the ranks' fingerprints share no step"),
])
def test_replicas_not_compared_say_why(ranks, fingerprints, why):
    report = analyse(_results(fingerprints, ranks))
    assert f"replicas: not compared ({why})\n" in console_report(report)


def test_a_header_only_fingerprints_file_reads_as_a_rank_with_no_step(tmp_path):
    for rank in (0, 1):
        folder = tmp_path / "op_replica_fingerprints" / f"rank{rank}"
        folder.mkdir(parents=True)
        (folder / "fingerprints_x.jsonl").write_text(json.dumps({"format": "op_tools fingerprints", "rank": rank})
                                                      + "\n")
    report = analyse(read_results(str(tmp_path)))
    assert "replicas: not compared (no optimizer step ran while an op tool was on" in console_report(report)


def _session_file(folder, rank, name, steps, launch=None):
    """One rank's fingerprints file of one session, as the hook writes it: rank -> step -> record."""
    path = folder / "op_replica_fingerprints" / f"rank{rank}"
    path.mkdir(parents=True, exist_ok=True)
    lines = [{"format": FORMAT, "version": 1, "rank": rank, "world_size": 2, "launch": launch},
             *({"step": step, "time": 1.0, **record} for step, record in steps.items())]
    (path / name).write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_parameters_holding_nan_in_an_earlier_run_into_the_folder_are_not_hidden_by_a_later_clean_one(tmp_path):
    # each rank's files were read as one: the later run's steps replaced the earlier's, and the report said "agree at
    # each of the 2 steps compared", no anomaly (files written before their header named the launch: none here)
    for rank in (0, 1):
        _session_file(tmp_path, rank, f"fingerprints_pid1{rank}_2026-12-01-01-53-49_1.jsonl",
                      {0: _step(), 1: _step(["w", "b"])})
        _session_file(tmp_path, rank, f"fingerprints_pid2{rank}_2026-12-01-01-54-08_1.jsonl", {0: _step(), 1: _step()})
    report = analyse(read_results(str(tmp_path)))
    assert ("replicas: agree at each of the 4 steps compared in 2 sessions, but from step 1 in session 1 of 2 (rank "
            "0's fingerprints_pid10_2026-12-01-01-53-49_1.jsonl), parameter w and 1 more hold inf/nan on ranks 0,1\n"
            ) in console_report(report)
    assert report.verdict() == "found"


def test_files_of_one_launch_are_compared_together_and_files_that_cannot_be_matched_are_not_compared(tmp_path):
    _session_file(tmp_path, 0, "fingerprints_pid10_2026-12-01-01-53-49_1.jsonl", {0: _step()}, launch="a/0")
    for rank in (0, 1):  # rank 1 wrote no file in launch a
        _session_file(tmp_path, rank, f"fingerprints_pid2{rank}_2026-12-01-01-54-08_1.jsonl", {0: _step(value=rank)},
                      launch="b/0")
    text = console_report(analyse(read_results(str(tmp_path))))
    assert "NOT READ" not in text
    assert "replicas: disagree from step 0 (before its optimizer update) in session 2 of 2 (rank 0's " \
        "fingerprints_pid20_2026-12-01-01-54-08_1.jsonl): parameter w differs, rank 0 vs rank 1\n" in text
    # no launch named, two files on rank 0 and one on rank 1: which goes with which cannot be told
    for folder in (tmp_path / "op_replica_fingerprints").iterdir():
        for file in folder.iterdir():
            _session_file(tmp_path, int(folder.name[4:]), file.name, {0: _step()})
    report = analyse(read_results(str(tmp_path)))
    text = console_report(report)
    assert "the ranks wrote different numbers of fingerprints files naming no launch (rank 0: 2, rank 1: 1): which " \
        "go together cannot be told, and none of them is compared\n" in text
    assert "replicas: not compared (no two ranks' fingerprints are of one session: the files of different runs, or " \
        "not matched (above))\n" in text
    assert report.verdict() == "unread"
