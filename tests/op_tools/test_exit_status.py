"""One exit-status scheme for every command (op_tools/output/exit_status.py): the table, ``python -m op_tools``
exiting 3 for what an op tool or the monitor found, and under torchrun the one line each rank says before it."""

from __future__ import annotations

import logging

import pytest

from op_tools.__main__ import main
from op_tools.output.exit_status import VERDICT_STATUS, ExitStatus, explain_under_torchrun, status_of, worst

# A division by zero on the device: an inf from finite inputs, which OpOverflowCheck finds (it leaves CPU calls).
OVERFLOW_SCRIPT = "import torch\ntorch.div(torch.ones(2, device={0!r}), torch.zeros(2, device={0!r}))\n"
# Two SGD steps of a tiny model whose weight is NaN from the second on: TrainingMonitor's nonfinite rule fires.
NAN_SCRIPT = """\
import torch
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(2):
    model(torch.randn(8, 4)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
"""
TORCHRUN = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "test"}


@pytest.fixture(autouse=True)
def _no_settings(monkeypatch, tmp_path):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "OP_TOOLS_CONFIG", "OP_TOOLS_PRINT_RANKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OP_TOOLS_VERBOSE", "0")
    monkeypatch.chdir(tmp_path)


def _script(tmp_path, text: str) -> str:
    path = tmp_path / "train.py"
    path.write_text(text)
    return str(path)


def test_the_table_gives_each_outcome_its_own_status_and_found_is_not_a_crash():
    assert {s.name: int(s) for s in ExitStatus} == {"CLEAN": 0, "RAISED": 1, "USAGE": 2, "FOUND": 3, "INCOMPLETE": 4,
                                                    "NOT_WRITTEN": 5, "INTERRUPTED": 130}
    assert {word: status_of(word) for word in VERDICT_STATUS} == {"clean": 0, "found": 3, "unchecked": 4, "unread": 4}
    assert worst([]) == 0 and worst([4, 5, 0]) == 5 and worst([4, 2, 1]) == 1 and worst([0, 4, 3, 1]) == 3


def test_an_op_tool_that_found_something_exits_3_and_no_line_is_said_outside_torchrun(tmp_path, caplog, sim):
    caplog.set_level(logging.INFO, logger="op_tools")
    assert main(["overflow_check", "--results-dir", "out", _script(tmp_path, OVERFLOW_SCRIPT.format(sim))]) == 3
    assert "first inf/nan from finite inputs: torch.div" in caplog.text
    assert "exits with status" not in caplog.text


def test_the_monitor_exits_3_when_a_rule_fired(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="op_tools")
    assert main(["monitor", "--results-dir", "out", "--tensorboard", "0", "--html", "0",
                 _script(tmp_path, NAN_SCRIPT)]) == 3
    assert "TrainingMonitor: first non-finite value at step 1" in caplog.text


def test_the_monitor_verdict_is_unchecked_when_it_failed_or_monitored_nothing_and_found_wins():
    from op_tools.tools.training_monitor import TrainingMonitor

    monitor = TrainingMonitor(tensorboard=False)
    assert monitor.verdict() == "unchecked"  # never started: nothing found, and nothing judged either
    monitor._monitored = 1
    assert monitor.verdict() == "clean"  # a step monitored, nothing found, nothing failed
    monitor._failed = True
    assert monitor.verdict() == "unchecked"
    monitor.anomalies.append({"rule": "nonfinite"})
    assert monitor.verdict() == "found"


def test_under_torchrun_each_rank_says_its_verdict_status_in_one_labelled_line(tmp_path, caplog, monkeypatch, sim):
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    caplog.set_level(logging.INFO, logger="op_tools")
    assert main(["overflow_check", "--results-dir", "out", _script(tmp_path, OVERFLOW_SCRIPT.format(sim))]) == 3
    (line,) = [r.getMessage() for r in caplog.records if "exits with status" in r.getMessage()]
    # labelled with the rank as every op_tools line under torchrun; a WARNING, shown on every rank
    assert line == "[rank1] op_tools: rank 1 exits with status 3: found (not a crash; see the summary above)"
    assert len(line) < 100


def test_the_torchrun_line_is_said_only_for_a_verdict_under_torchrun(monkeypatch):
    assert explain_under_torchrun(3) is None  # outside torchrun
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    assert explain_under_torchrun(4) == ("op_tools: rank 1 exits with status 4: incomplete (not a crash; see the "
                                         "summary above)")
    for status in (0, 1, 2, 5, 130):  # clean, or not a verdict: the traceback or the message says it
        assert explain_under_torchrun(status) is None
