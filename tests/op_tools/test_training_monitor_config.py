"""TrainingMonitor's settings: each OP_TRAINING_MONITOR_* variable parsed into TrainingMonitorConfig, a bad value an
error naming the variable (or the argument, or the file's key), the value and the expected form; arguments win over
variables, variables over the config file's [monitor] section; ``python -m op_tools monitor script.py`` runs the
script between the monitor's start() and stop() and keeps its exit status."""

from __future__ import annotations

import csv
import glob
import os
import subprocess
import sys

import pytest
from subprocess_env import env_without_settings

from op_tools.__main__ import main
from op_tools.config.training_monitor import TrainingMonitorConfig
from op_tools.config.typo_check import unknown_variable
from op_tools.config.variables import BLOCKS

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "monitor_training.py")


@pytest.fixture(autouse=True)
def _no_monitor_settings(monkeypatch):
    for name in list(os.environ):
        if name.startswith("OP_TRAINING_MONITOR_") or name == "OP_TOOLS_CONFIG":
            monkeypatch.delenv(name)


def _patterns(value):
    """Compiled patterns as their text, for comparison; any other value as it is."""
    return [p.pattern for p in value] if isinstance(value, tuple) else value


def test_unset_variables_give_the_defaults():
    config = TrainingMonitorConfig.from_env()
    assert (config.every, config.parameters, config.activations, config.spike_factor, config.warmup,
            config.tensorboard, config.update_ratio, config.moments, config.scale_drops, config.replicas,
            config.html, config.state_every) == (1, None, BLOCKS, 10.0, 3, None, True, True, 3, True, True, 20)


@pytest.mark.parametrize(("variable", "text", "field", "expected"), [
    ("EVERY", "4", "every", 4),
    ("STATE_EVERY", "1", "state_every", 1),
    ("PARAMETERS", r"model\.layers\.0\., lm_head", "parameters", [r"model\.layers\.0\.", "lm_head"]),
    ("PARAMETERS", "", "parameters", []),  # empty: no parameter
    ("ACTIVATIONS", r"layers\.\d+\.mlp,model\.norm", "activations", [r"layers\.\d+\.mlp", r"model\.norm"]),
    ("ACTIVATIONS", "none", "activations", []),
    ("ACTIVATIONS", "Blocks", "activations", BLOCKS),
    ("SPIKE_FACTOR", "2.5", "spike_factor", 2.5),
    ("WARMUP", "7", "warmup", 7),
    ("TENSORBOARD", "auto", "tensorboard", None),
    ("TENSORBOARD", "1", "tensorboard", True),
    ("TENSORBOARD", "off", "tensorboard", False),
    ("UPDATE_RATIO", "0", "update_ratio", False),
    ("MOMENTS", "false", "moments", False),
    ("SCALE_DROPS", "5", "scale_drops", 5),
    ("REPLICAS", "no", "replicas", False),
    ("HTML", "0", "html", False),
])
def test_each_variable_is_parsed_into_its_field(variable, text, field, expected, monkeypatch):
    monkeypatch.setenv(f"OP_TRAINING_MONITOR_{variable}", text)
    assert _patterns(getattr(TrainingMonitorConfig.from_env(), field)) == expected


@pytest.mark.parametrize(("variable", "text", "words"), [
    ("EVERY", "0", ["must be >= 1", "an integer >= 1"]),
    ("EVERY", "often", ["not an integer"]),
    ("PARAMETERS", "model.(layers", ["invalid regular expression 'model.(layers'"]),
    ("ACTIVATIONS", "blocks,lm_head", ["blocks and none stand alone"]),
    ("ACTIVATIONS", "[", ["invalid regular expression"]),
    ("SPIKE_FACTOR", "1", ["must be > 1", "a number > 1"]),
    ("SPIKE_FACTOR", "nan", ["must be > 1"]),
    ("SPIKE_FACTOR", "ten", ["not a number"]),
    ("WARMUP", "-2", ["an integer >= 1"]),
    ("TENSORBOARD", "maybe", ["not a flag", "auto, 0 or 1"]),
    ("UPDATE_RATIO", "-1", ["not a flag", "0 or 1"]),
    ("MOMENTS", "yes please", ["not a flag"]),
    ("SCALE_DROPS", "0", ["must be >= 1"]),
    ("REPLICAS", "x", ["not a flag"]),
    ("HTML", "on second thought", ["not a flag"]),
])
def test_a_bad_variable_is_an_error_naming_it_its_value_and_the_expected_form(variable, text, words, monkeypatch):
    name = f"OP_TRAINING_MONITOR_{variable}"
    monkeypatch.setenv(name, text)
    with pytest.raises(ValueError) as info:
        TrainingMonitorConfig.resolve()
    assert f"{name}={text!r}" in str(info.value)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(("arguments", "error", "words"), [
    ({"every": 0}, ValueError, ["TrainingMonitor(every=0)", "must be >= 1", "an int >= 1"]),
    ({"every": 2.5}, TypeError, ["TrainingMonitor(every=2.5)", "not an integer"]),
    ({"every": True}, TypeError, ["TrainingMonitor(every=True)"]),
    ({"parameters": "a,("}, ValueError, ["TrainingMonitor(parameters='a,(')", "invalid regular expression '('"]),
    ({"parameters": [3]}, TypeError, ["TrainingMonitor(parameters=[3])", "a list of regular expressions"]),
    ({"activations": ["blocks", "lm_head"]}, ValueError, ["TrainingMonitor(activations=", "stand alone"]),
    ({"spike_factor": 0.5}, ValueError, ["TrainingMonitor(spike_factor=0.5)", "must be > 1"]),
    ({"tensorboard": "sometimes"}, ValueError, ["TrainingMonitor(tensorboard='sometimes')", "not a flag"]),
    ({"moments": 2}, TypeError, ["TrainingMonitor(moments=2)", "True or False"]),
    ({"scale_drops": -1}, ValueError, ["TrainingMonitor(scale_drops=-1)"]),
    ({"warmup": -1}, ValueError, ["TrainingMonitor(warmup=-1): must be >= 1;"]),  # it said ">= 0; expected ... >= 1"
    ({"evry": 2}, TypeError, ["unexpected keyword argument 'evry'", "did you mean every?"]),
])
def test_a_bad_argument_is_an_error_naming_it_its_value_and_the_expected_form(arguments, error, words):
    with pytest.raises(error) as info:
        TrainingMonitorConfig.resolve(**arguments)
    for word in words:
        assert word in str(info.value)


def test_arguments_take_python_values_or_the_variables_text():
    config = TrainingMonitorConfig.resolve(every="3", parameters=["lm_head", r"model\.norm"], activations="none",
                                           spike_factor=4, tensorboard=False, update_ratio="0", html=False,
                                           results_dir="elsewhere")
    assert (config.every, _patterns(config.parameters), config.activations, config.spike_factor, config.tensorboard,
            config.update_ratio, config.html) == (3, ["lm_head", r"model\.norm"], (), 4.0, False, False, False)
    assert config.common.results_dir == "elsewhere"
    assert _patterns(TrainingMonitorConfig.resolve(activations=[r"model\.layers\.0"]).activations) == [
        r"model\.layers\.0"]


def _config_file(tmp_path, monkeypatch, text: str) -> str:
    path = tmp_path / "team.toml"
    path.write_text(text)
    monkeypatch.setenv("OP_TOOLS_CONFIG", str(path))
    return str(path)


def test_arguments_win_over_variables_which_win_over_the_config_file(tmp_path, monkeypatch):
    _config_file(tmp_path, monkeypatch, "[op_tools]\nresults_dir = 'from_file'\n\n"
                                        "[monitor]\nevery = 5\nwarmup = 6\nspike_factor = 3.5\n"
                                        "parameters = ['lm_head']\nactivations = 'none'\ntensorboard = false\n"
                                        "moments = false\n")
    monkeypatch.setenv("OP_TRAINING_MONITOR_EVERY", "3")
    monkeypatch.setenv("OP_TRAINING_MONITOR_WARMUP", "4")
    monkeypatch.delenv("OP_TOOLS_RESULTS_DIR")  # the file's results_dir, under [op_tools], then applies
    config = TrainingMonitorConfig.resolve(every=2, parameters=None)  # None: not given
    assert (config.every, config.warmup, config.spike_factor, _patterns(config.parameters), config.activations,
            config.tensorboard, config.moments, config.scale_drops) == (2, 4, 3.5, ["lm_head"], (), False, False, 3)
    assert config.common.results_dir == "from_file"
    assert TrainingMonitorConfig.resolve().every == 3  # the variable over the file
    monkeypatch.delenv("OP_TRAINING_MONITOR_EVERY")
    assert TrainingMonitorConfig.resolve().every == 5  # the file over the default


@pytest.mark.parametrize(("toml", "words"), [
    ("[monitor]\nevry = 2\n", ["[monitor] evry: unknown setting", "did you mean every?"]),
    ("[monitor]\nOP_TRAINING_MONITOR_EVERY = 2\n", ["[monitor] OP_TRAINING_MONITOR_EVERY", "did you mean every?"]),
    ("[monitor]\nspike_factor = 1\n", ["[monitor] spike_factor = 1", "must be > 1", "a number > 1"]),
    ("[monitor]\nparameters = 'a,('\n", ["[monitor] parameters = 'a,('", "invalid regular expression"]),
    ("[monitor]\nops = ['torch.add']\n", ["[monitor] ops: unknown setting"]),  # the monitor handles no op
    ("[monitr]\nevery = 2\n", ["unknown section [monitr]", "did you mean [monitor]?"]),
])
def test_a_bad_config_file_key_is_an_error_naming_the_file_section_and_key(toml, words, tmp_path, monkeypatch):
    path = _config_file(tmp_path, monkeypatch, toml)
    with pytest.raises(ValueError) as info:
        TrainingMonitorConfig.resolve()
    assert path in str(info.value)
    for word in words:
        assert word in str(info.value)


def test_the_typo_check_knows_the_monitors_variables():
    assert unknown_variable("OP_TRAINING_MONITOR_SPIKE_FACTOR") is None
    assert "did you mean OP_TRAINING_MONITOR_SPIKE_FACTOR?" in unknown_variable("OP_TRAINING_MONITOR_SPIKE_FACTR")


# --- python -m op_tools monitor ---

def _monitor_command(*args, cwd, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = env_without_settings({"OP_TOOLS_VERBOSE": "0", **(env or {})})
    return subprocess.run([sys.executable, "-m", "op_tools", "monitor", *args], cwd=cwd, env=clean,
                          capture_output=True, text=True, timeout=180)


def _steps_written(results_dir) -> set[int]:
    (table,) = glob.glob(os.path.join(results_dir, "op_training_monitor", "monitor_*.csv"))
    with open(table, newline="", encoding="utf-8") as f:
        return {int(row["step"]) for row in csv.DictReader(f)}


@pytest.mark.parametrize(("ending", "status"), [("0", 0), ("3", 3), ("raise", 1)])
def test_the_monitor_runs_a_script_and_keeps_its_exit_status(ending, status, tmp_path):
    done = _monitor_command("--results-dir", "out", SCRIPT, "3", ending, cwd=tmp_path)
    assert done.returncode == status, done.stderr[-3000:]
    assert "trained 3 steps" in done.stdout
    assert ("RuntimeError: the script failed" in done.stderr) == (ending == "raise")
    assert _steps_written(tmp_path / "out") == {0, 1, 2}  # stopped, its files written, however the script ended


def test_the_monitor_reads_its_options_and_variables_on_the_command_line(tmp_path):
    by_option = _monitor_command("--results-dir", "a", "--every", "2", "--tensorboard", "0", SCRIPT, "5", cwd=tmp_path)
    assert by_option.returncode == 0, by_option.stderr[-3000:]
    assert _steps_written(tmp_path / "a") == {0, 2, 4}
    assert not glob.glob(str(tmp_path / "a" / "op_training_monitor" / "tensorboard_*"))
    by_variable = _monitor_command("--results-dir", "b", SCRIPT, "5", cwd=tmp_path,
                                   env={"OP_TRAINING_MONITOR_EVERY": "3"})
    assert by_variable.returncode == 0, by_variable.stderr[-3000:]
    assert _steps_written(tmp_path / "b") == {0, 3}


def test_the_monitor_command_lists_its_options(capsys):
    with pytest.raises(SystemExit) as done:
        main(["monitor", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for option in TrainingMonitorConfig.keywords:
        assert f"--{option.replace('_', '-')} " in out and f"as OP_TRAINING_MONITOR_{option.upper()}:" in out
    assert "--results-dir" in out and "--ops" not in out


def test_a_bad_option_is_an_error_naming_it_before_the_script_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as done:
        main(["TrainingMonitor", "--every", "0", SCRIPT, "1"])
    assert done.value.code == 2
    assert "--every '0': must be >= 1; expected an integer >= 1" in capsys.readouterr().err  # as the option reads
    assert not os.path.exists(tmp_path / "results" / "op_training_monitor")  # never started


def test_a_module_given_first_is_the_model(tmp_path, monkeypatch):
    import torch

    import op_tools

    monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(tmp_path))
    model = torch.nn.Linear(2, 2)
    monitor = op_tools.TrainingMonitor(model, html=False)  # as other monitors are called
    assert monitor.model is model and monitor.config.common.results_dir == str(tmp_path)
    with pytest.raises(TypeError, match=r"a module \(Linear\) given first and model= too"):
        op_tools.TrainingMonitor(model, model=model)


def test_a_misspelt_variable_is_warned_about_at_start(monkeypatch, tmp_path, caplog):
    # the op tools check the environment at each start; the monitor did not: its misspelt variable went unsaid
    import op_tools

    monkeypatch.setenv("OP_TRAINING_MONITR_EVERY", "2")
    with caplog.at_level("WARNING", logger="op_tools"), op_tools.TrainingMonitor(results_dir=str(tmp_path)):
        pass
    assert "OP_TRAINING_MONITR_EVERY is not a variable op_tools reads; did you mean OP_TRAINING_MONITOR_EVERY?" \
        in caplog.text
