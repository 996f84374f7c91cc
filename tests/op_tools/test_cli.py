"""``python -m op_tools TOOL [options] script.py [args]`` runs a script under a tool with no edit to it."""

from __future__ import annotations

import csv
import glob
import os
import subprocess
import sys

import pytest
from subprocess_env import ROOT, env_without_settings

from op_tools.__main__ import main

SCRIPT = """\
import sys, torch, ditorch
print("argv", sys.argv[1:])
x = torch.ones(3, device="cuda")
torch.add(x, 1); x.mul(2); torch.nn.functional.relu(x)
{ending}
"""


def op_tools_command(*args, cwd, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = env_without_settings({"DITORCH_BACKEND": "sim", "DITORCH_QUIET": "1", "OP_TOOLS_VERBOSE": "0",
                                  **(env or {})})
    return subprocess.run([sys.executable, "-m", "op_tools", *args], cwd=cwd, env=clean, capture_output=True,
                          text=True, timeout=180)


def _script(tmp_path, ending: str = "") -> str:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT.format(ending=ending))
    return str(path)


def test_help_lists_every_tool(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for name in ("autocompare", "capture", "observe", "time_measure", "overflow_check", "fallback", "dtype_cast",
                 "dump_op_args", "OpCapture"):
        assert name in out


def test_autocompare_runs_an_example_script_and_finds_the_faulty_op(tmp_path):
    done = op_tools_command("autocompare", "--results-dir", "out", os.path.join(ROOT, "examples", "cuda_training.py"),
                            "--steps", "1", cwd=tmp_path, env={"DITORCH_SIM_FAULTS": "gelu:noise=1e-2"})
    assert done.returncode == 3, done.stderr[-3000:]  # the script exited 0; the tool found something
    (table,) = glob.glob(str(tmp_path / "out" / "op_autocompare_result" / "*.csv"))
    with open(table, newline="") as f:
        failing = {row["op"] for row in csv.DictReader(f) if row["verdict"] == "FAIL"}
    assert failing == {"torch.nn.functional.gelu"}


def test_options_are_the_tool_arguments_and_the_script_gets_its_own(tmp_path):
    done = op_tools_command("op_capture", "--ops", "torch.add,torch.nn.functional.relu",
                            "--disable=torch.nn.functional.relu", "--dedup", _script(tmp_path), "--ops", "mine",
                            cwd=tmp_path,
                            env={"OP_TOOLS_RESULTS_DIR": str(tmp_path / "out")})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "argv ['--ops', 'mine']" in done.stdout
    captured = [n for n in os.listdir(tmp_path / "out" / "op_capture_results") if not n.startswith("index_")]
    assert captured == ["torch.add"]  # the calls' folders, not the index beside them


@pytest.mark.parametrize(("ending", "status"), [("raise RuntimeError('boom')", 1), ("sys.exit(5)", 5)])
def test_the_tool_is_stopped_and_writes_its_results_however_the_script_ends(ending, status, tmp_path):
    done = op_tools_command("capture", "--mode", "summary", "--results-dir", "out", _script(tmp_path, ending),
                            cwd=tmp_path)
    assert done.returncode == status, done.stderr[-3000:]
    assert ("RuntimeError: boom" in done.stderr) == (status == 1)
    (summary,) = glob.glob(str(tmp_path / "out" / "op_capture_results" / "summary_*.csv"))
    with open(summary, newline="") as f:
        assert "torch.add" in {row["op"] for row in csv.DictReader(f)}


def test_a_module_runs_as_python_m_runs_it(tmp_path):
    (tmp_path / "trainer.py").write_text(SCRIPT.format(ending=""))
    done = op_tools_command("observe", "-m", "trainer", "--steps", "2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "argv ['--steps', '2']" in done.stdout


@pytest.mark.parametrize(("args", "words"), [
    (["capture", "--mode", "everything", "train.py"], ["--mode 'everything'", "full"]),
    (["capture", "--max-bytes", "lots", "train.py"], ["--max-bytes 'lots'"]),
    # in the variables' form the options take, not Python's ("expected True or False")
    (["autocompare", "--verbose", "maybe", "train.py"], ["--verbose 'maybe': not a flag; expected 0 or 1"]),
    (["captur", "train.py"], ["invalid choice: 'captur'"]),
    (["capture", "--mdoe", "summary", "train.py"], ["unrecognized arguments: --mdoe"]),
    (["capture", "missing.py"], ["no such script: missing.py"]),
    (["capture"], ["no script to run"]),
    (["capture", "--config", "missing.toml", "train.py"], ["--config missing.toml: no such file"]),
])
def test_a_bad_command_line_is_an_error_naming_what_is_wrong(args, words, tmp_path, monkeypatch, capsys):
    _script(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as done:  # parsed before anything runs
        main(args)
    assert done.value.code == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err


@pytest.mark.parametrize(("variable", "value", "tool", "words"), [
    ("OP_CAPTURE_MODE", "sumary", "capture", ["OP_CAPTURE_MODE='sumary'", "full, summary or stats"]),
    ("OP_TOOLS_VERBOSE", "maybe", "overflow_check", ["OP_TOOLS_VERBOSE='maybe'", "expected 0 or 1"]),
    ("OP_AUTOCOMPARE_BACKWARD", "2x", "autocompare", ["OP_AUTOCOMPARE_BACKWARD='2x'"]),
    ("OP_TOOLS_RESULTS_DIR", "a_file", "overflow_check", ["OP_TOOLS_RESULTS_DIR=", "is not a directory"]),
    ("OP_TOOLS_CONFIG", "missing.toml", "time_measure", ["OP_TOOLS_CONFIG='missing.toml'"]),
])
def test_a_malformed_variable_is_a_usage_error_naming_it_before_the_script_runs(variable, value, tool, words,
                                                                                tmp_path, monkeypatch, capsys):
    # The tool's start() read it, inside the run: a 28-line traceback and status 1, which a CI job cannot tell from
    # a crash of the tool (2 is a bad command line or environment)
    script = _script(tmp_path)
    (tmp_path / "a_file").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as done:
        main([tool, script])
    assert done.value.code == 2
    out, err = capsys.readouterr()
    assert "argv" not in out  # the script never ran
    for word in words:
        assert word in err.splitlines()[-1], err
    assert not list(tmp_path.rglob("running_*.json"))  # a session that never started left no marker saying it ran
