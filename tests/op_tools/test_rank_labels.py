"""Ranks, steps and times: console lines labelled ``[rank<N>] `` under torchrun, OP_TOOLS_PRINT_RANKS, and the
rank, step and time of every record a tool writes (docs/tools/README.md#ranks-steps-and-times)."""

from __future__ import annotations

import csv
import glob
import io
import logging
import os
import subprocess
import sys
import time

import pytest
import torch
from subprocess_env import ROOT, child_env

import op_tools
from op_tools.config.variables import PRINT_RANKS, convert_ranks, parse_ranks
from op_tools.core.steps import STEPS, StepCounter
from op_tools.output import reporting, result_files
from op_tools.output.run_recording import read_recording

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "rank_labels.py")


# --- the variable ---

@pytest.mark.parametrize(("text", "ranks"), [(None, None), ("", None), ("all", None), (" ALL ", None),
                                             ("0", frozenset({0})), (" 0, 3 ", frozenset({0, 3}))])
def test_print_ranks_parses_all_or_a_list_of_ranks(text, ranks):
    assert parse_ranks(text) == ranks


@pytest.mark.parametrize("text", ["x", "-1", "0,,1", "1.5", "0;1"])
def test_print_ranks_malformed_is_a_value_error_naming_the_variable(monkeypatch, text):
    monkeypatch.setenv("OP_TOOLS_PRINT_RANKS", text)
    with pytest.raises(ValueError, match=r"OP_TOOLS_PRINT_RANKS=.*expected all, or comma-separated ranks"):
        PRINT_RANKS.read()


def test_print_ranks_as_a_python_value():
    assert convert_ranks(2) == frozenset({2})
    assert convert_ranks([0, 3]) == frozenset({0, 3})
    assert convert_ranks("all") is None
    for bad in (-1, [0, "1"], True, 1.0):
        with pytest.raises(TypeError):
            convert_ranks(bad)


# --- the console form ---

def _record(message: str, level: int = logging.INFO, exc_info=None, name: str = "op_tools.observe"
            ) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, message, None, exc_info)


def test_formatter_prefixes_every_line_with_the_rank_tracebacks_included():
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        exc_info = sys.exc_info()
    text = reporting.RankFormatter(3).format(_record("title\n+---+\n| a |", exc_info=exc_info))
    lines = text.split("\n")
    assert lines[:3] == ["[rank3] title", "[rank3] +---+", "[rank3] | a |"]
    assert len(lines) > 4 and all(line.startswith("[rank3] ") for line in lines)
    assert lines[-1] == "[rank3] RuntimeError: boom"


def test_formatter_outside_torchrun_leaves_the_message_as_it_is():
    assert reporting.RankFormatter(None).format(_record("a\nb")) == "a\nb"


def test_a_rank_not_listed_shows_warnings_only(monkeypatch):
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stdout", stream)
    # a logger with no other handler on its way up (pytest's capture sits on the root logger)
    monkeypatch.setattr(logging.getLogger("op_tools_rank_test"), "propagate", False)
    handler = reporting.ConsoleHandler(1, frozenset({0}))
    handler.handle(_record("info line", name="op_tools_rank_test"))
    handler.handle(_record("a failure", logging.WARNING, name="op_tools_rank_test"))
    handler.set_rank(0, frozenset({0}))
    handler.handle(_record("info of rank 0", name="op_tools_rank_test"))
    assert stream.getvalue() == "[rank1] a failure\n[rank0] info of rank 0\n"


# --- steps ---

def _sgd_step(optimizer: torch.optim.Optimizer) -> None:
    weight = optimizer.param_groups[0]["params"][0]
    weight.grad = torch.ones_like(weight)
    optimizer.step()


def test_step_counter_counts_optimizer_steps_only_while_acquired():
    counter = StepCounter()
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    _sgd_step(optimizer)
    base = counter.acquire()
    _sgd_step(optimizer)
    _sgd_step(optimizer)
    assert counter.count - base == 2 and not counter.in_optimizer
    counter.release()
    _sgd_step(optimizer)
    assert counter.count - base == 2  # hooks removed with the last user


def test_recording_outside_torchrun_has_no_rank_and_steps_from_the_tool_start(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    weight = torch.ones(2, requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=0.1)
    _sgd_step(optimizer)  # before the tool: not counted
    users = STEPS._users
    started = time.time()
    with op_tools.OpCapture(mode="stats", results_dir=str(tmp_path)):
        for _ in range(2):
            (weight * 2).sum().backward()
            optimizer.step()
    header, records = read_recording(str(tmp_path))
    assert header["rank"] is None and header["time"] >= started - 1
    forward = [r for r in records if r["phase"] == "forward" and r["op"].endswith("mul")]
    assert [r["step"] for r in forward] == [0, 1]
    assert all(started - 1 <= r["time"] <= time.time() for r in records)
    assert STEPS._users == users  # the tool stopped: its hold on the optimizer hooks released


# --- under torchrun: one launch, two ranks, on sim ---

@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    env = child_env({"DITORCH_BACKEND": "sim", "DITORCH_QUIET": "1", "OMP_NUM_THREADS": "1",
                     "OP_TOOLS_VERBOSE": "1", "OP_TOOLS_RESULTS_DIR": str(out / "results")},
                    drop=("OP_", "DITORCH_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))
    started = time.time()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", SCRIPT, str(out)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, started, time.time()


@pytest.mark.parametrize("rank", [0, 1])
def test_every_console_line_under_torchrun_starts_with_its_rank(torchrun_run, rank):
    out, _, _ = torchrun_run
    lines = (out / f"all{rank}.txt").read_text().splitlines()
    assert len(lines) > 100  # debug tables, summaries and closing lines of three tools
    assert [line for line in lines if not line.startswith(f"[rank{rank}] ")] == []
    assert any(line.startswith(f"[rank{rank}] OpTimeMeasure: ") for line in lines)


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_labels_survive_the_scripts_own_logging_configuration(torchrun_run, rank):
    out, _, _ = torchrun_run
    lines = (out / f"basic{rank}.txt").read_text().splitlines()
    closing = [line for line in lines if line.startswith(f"INFO op_tools.observe: [rank{rank}] OpObserve: ")]
    assert len(closing) == 1, lines[-5:]  # through the script's handler, once: op_tools' own stays silent
    tables = [line for line in lines if not line.startswith(("INFO ", "DEBUG ", "WARNING "))]
    assert tables and all(line.startswith(f"[rank{rank}] ") for line in tables)  # every line of a table too


def test_print_ranks_0_leaves_rank_1_its_warnings_only(torchrun_run):
    out, _, _ = torchrun_run
    rank0 = (out / "only00.txt").read_text().splitlines()
    rank1 = (out / "only01.txt").read_text().splitlines()
    assert any(line.startswith("[rank0] OpObserve: ") for line in rank0)  # rank 0's INFO closing line
    assert any(line.startswith("[rank1] OpOverflowCheck: first inf/nan from finite inputs: torch.log")
               for line in rank1)
    assert not any("handled;" in line for line in rank1)  # no closing line (INFO) nor per-call table (DEBUG)
    assert all(line.startswith("[rank1] ") for line in rank1)


def _rows(pattern: str) -> list[dict]:
    paths = glob.glob(pattern)
    assert len(paths) == 1, paths
    with open(paths[0], newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize(("folder", "name"), [("op_time_measure_result", "op_elasped_info_*.csv"),
                                              ("op_autocompare_result", "op_autocompare_info_*.csv")])
def test_csv_rows_carry_rank_step_and_time(torchrun_run, rank, folder, name):
    out, started, ended = torchrun_run
    rows = _rows(str(out / "results" / folder / f"rank{rank}" / name))
    assert list(rows[0])[-3:] == list(result_files.RECORD_COLUMNS)  # added after the original's columns
    assert {r["rank"] for r in rows} == {str(rank)}
    forward = sorted((r for r in rows if r.get("phase", "forward") == "forward"), key=lambda r: float(r["time"]))
    steps = [int(r["step"]) for r in forward]
    assert steps == sorted(steps) and set(steps) == {0, 1, 2}  # 3 optimizer steps after the tools started
    assert all(started <= float(r["time"]) <= ended for r in rows)


@pytest.mark.parametrize("rank", [0, 1])
def test_recording_has_its_rank_in_the_header_and_a_time_per_record(torchrun_run, rank):
    out, started, ended = torchrun_run
    header, records = read_recording(str(out / "results"), rank=rank)
    assert header["rank"] == rank
    assert {r["step"] for r in records if r["phase"] == "forward" and r["module"]} == {0, 1, 2}
    assert all(started <= r["time"] <= ended for r in records)


def test_print_ranks_is_a_keyword_of_every_tool_and_a_config_file_key(tmp_path, monkeypatch):
    tool = op_tools.OpObserve(print_ranks=[0, 3])
    tool.start()
    tool.stop()
    assert tool.common.print_ranks == frozenset({0, 3})
    config = tmp_path / "op_tools.toml"
    config.write_text("[op_tools]\nprint_ranks = 1\n")
    monkeypatch.setenv("OP_TOOLS_CONFIG", str(config))
    monkeypatch.delenv("OP_TOOLS_PRINT_RANKS", raising=False)
    from_file = op_tools.OpTimeMeasure()
    from_file.start()
    from_file.stop()
    assert from_file.common.print_ranks == frozenset({1})
    with pytest.raises(ValueError, match=r"OpObserve\(print_ranks='x'\).*not a rank"):
        op_tools.OpObserve(print_ranks="x")
