"""A rank whose run ends early keeps what it computed, and the run report says that rank ended early: the replica
fingerprints and the run recording are flushed once per step (a SIGKILL loses the step it came in), SIGTERM
finishes the fingerprints as it finishes the tools' files, and a ``.partial`` fingerprints file (empty, or cut
short) is a rank that did not finish, not a file of the wrong format. Two plain processes stand for torchrun's ranks
(``RANK``/``WORLD_SIZE`` set, no process group): rank 1 kills itself at step 1, rank 0 is sent SIGTERM there, as
torchrun does to the ranks left."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from subprocess_env import ROOT, child_env

from op_tools.offline.run_report.analysis import analyse
from op_tools.offline.run_report.readers import read_results
from op_tools.offline.run_report.report import console_report

RANK = """
import os, signal, torch, op_tools
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
with op_tools.OpCapture(mode="stats"):  # records CPU calls: one side of a comparison
    for step in range(3):
        model(torch.ones(3, 4)).sum().backward()
        if step == 1:
            os.kill(os.getpid(), getattr(signal, os.environ["END"]))
        optimizer.step()
        optimizer.zero_grad()
"""


@pytest.fixture(scope="module")
def ended(tmp_path_factory):
    """Rank 0 ended by SIGTERM, rank 1 by SIGKILL, both at step 1 before its optimizer step; one results folder."""
    out = tmp_path_factory.mktemp("ended_early")
    children = [subprocess.Popen([sys.executable, "-c", RANK], cwd=out, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True,
                                 env=child_env({"RANK": str(rank), "WORLD_SIZE": "2", "END": end,
                                                "OP_TOOLS_RESULTS_DIR": str(out)}, drop=("OP_", "DITORCH_")))
                for rank, end in ((0, "SIGTERM"), (1, "SIGKILL"))]
    for child, status in zip(children, (-signal.SIGTERM, -signal.SIGKILL)):
        output, _ = child.communicate(timeout=120)
        assert child.returncode == status, output
    return out


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_rank_killed_keeps_the_fingerprints_and_the_recording_of_the_steps_before(ended):
    # the fingerprints file was empty: its lines waited in a buffer the kill threw away
    (fingerprints,) = (ended / "op_replica_fingerprints" / "rank1").iterdir()
    assert fingerprints.name.endswith(".jsonl.partial")
    header, *steps = _lines(fingerprints)
    assert (header["format"], header["rank"]) == ("op_tools fingerprints", 1)
    assert [step["step"] for step in steps] == [0]
    (recording,) = (ended / "op_capture_results" / "rank1").iterdir()
    assert recording.name.endswith(".jsonl.partial")
    records = _lines(recording)[1:]
    # the whole of step 0, its optimizer's calls too; step 1 (where it died) at most in part
    assert {(r["step"], r["phase"]) for r in records if r["step"] == 0} == \
        {(0, "forward"), (0, "backward"), (0, "optimizer")}


def test_sigterm_finishes_the_fingerprints_as_the_tools_files(ended):
    # it was left .partial and empty, beside a run recording SIGTERM had finished
    (fingerprints,) = (ended / "op_replica_fingerprints" / "rank0").iterdir()
    assert fingerprints.name.endswith(".jsonl")
    assert [step["step"] for step in _lines(fingerprints)[1:]] == [0]
    (recording,) = (ended / "op_capture_results" / "rank0").iterdir()
    assert recording.name.endswith(".jsonl") and "end" in _lines(recording)[-1]


def test_the_report_names_the_rank_that_ended_early_and_compares_what_it_wrote(ended):
    # it said "NOT READ: ...: ValueError: not a replica fingerprints file" and nothing of rank 1's end
    done = subprocess.run([sys.executable, "-m", "op_tools.report", str(ended)], env=child_env(drop=("OP_",)),
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 4, done.stdout + done.stderr
    assert "NOT READ" not in done.stdout
    assert "\nENDED EARLY: rank 1: its fingerprints go to step 0 (fingerprints_pid" in done.stdout
    assert ".jsonl.partial: the process was killed before its tools stopped, or is still running)\n" in done.stdout
    assert "ENDED EARLY: rank 0" not in done.stdout
    assert "\nreplicas: agree at each of the 1 steps compared\n" in done.stdout
    assert done.stdout.splitlines()[-2] == "nothing concluded: no anomaly in what the tools wrote on 2 ranks, but " \
        "the run of rank 1 ended early (above)"


def _fingerprints(folder, rank, name, text):
    path = folder / "op_replica_fingerprints" / f"rank{rank}"
    path.mkdir(parents=True, exist_ok=True)
    (path / name).write_text(text)


HEADER = '{"format": "op_tools fingerprints", "version": 1, "rank": %d, "world_size": 2}\n'
STEP = '{"step": %d, "time": 1.0, "params": {"w": 7}, "grads": {"w": 3}, "nonfinite": []}\n'


def test_an_empty_partial_fingerprints_file_is_a_rank_that_wrote_nothing(tmp_path):
    _fingerprints(tmp_path, 0, "fingerprints_a.jsonl", HEADER % 0 + STEP % 0)
    _fingerprints(tmp_path, 1, "fingerprints_b.jsonl.partial", "")
    results = read_results(str(tmp_path))
    text = console_report(analyse(results))
    assert results.unreadable == []
    assert "ENDED EARLY: rank 1: it wrote no replica fingerprint (fingerprints_b.jsonl.partial is empty: the process " \
        "was killed before its first step's were written, or is still running)\n" in text
    assert "replicas: not compared (only rank 0 wrote fingerprints, not rank 1: the run of rank 1 ended early)\n" \
        in text
    assert analyse(results).verdict() == "unread"


def test_a_partial_fingerprints_file_cut_inside_a_line_is_read_to_its_last_whole_line(tmp_path):
    for rank in (0, 1):
        _fingerprints(tmp_path, rank, "fingerprints_a.jsonl.partial", HEADER % rank + STEP % 0 + (STEP % 1)[:20])
    results = read_results(str(tmp_path))
    assert results.unreadable == []
    assert sorted(results.ended_early) == [0, 1]
    (session,) = results.fingerprints
    assert {rank: sorted(steps) for rank, steps in session.ranks.items()} == {0: [0], 1: [0]}
    assert console_report(analyse(results)).splitlines()[-1] == "nothing concluded: no anomaly in what the tools " \
        "wrote on 2 ranks, but the run of ranks 0,1 ended early (above)"


def test_a_finished_fingerprints_file_without_its_header_is_still_not_read(tmp_path):
    _fingerprints(tmp_path, 0, "fingerprints_a.jsonl", "")
    assert read_results(str(tmp_path)).unreadable[0].endswith("ValueError: not a replica fingerprints file")
