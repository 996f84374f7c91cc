"""Every tool configured by keyword arguments, by variables or by a config file behaves the same; arguments win over
variables, variables over the file; a bad argument or file key is an error naming it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from subprocess_env import env_without_settings

import op_tools

# A small workload on sim, then the tool's typed configuration, the ops it handled and the files it wrote,
# with what differs between runs by nature (result folders, pids, times, the source of a tolerance) left out.
PROBE = r'''
import json, os, re, sys, torch, ditorch.sim, op_tools
ditorch.sim.register()
F = torch.nn.functional


def workload():
    x = torch.randn(4, 4, device="sim", requires_grad=True)
    w = torch.randn(3, 4, device="sim")
    h = torch.ones(4, device="sim", dtype=torch.float16)
    y = F.relu(torch.add(x, 1)).mul(2)
    F.linear(y, w).sum().backward()
    torch.add(h, 1)


def typed(tool):
    out = {"common": {k: v for k, v in vars(tool.common).items() if k != "results_dir"},
           "allow": None if tool.filter.allow is None else [p.pattern for p in tool.filter.allow],
           "deny": [p.pattern for p in tool.filter.deny]}
    for name in ("settings", "cast", "raise_on_overflow", "synchronise"):
        value = getattr(tool, name, None)
        if value is not None:
            if hasattr(value, "tolerance"):
                spec = value.tolerance
                value = dict(vars(value), tolerance=[{k: v[:2] for k, v in spec.per_op_dtype.items()},
                                                     {k: v[:2] for k, v in spec.per_dtype.items()},
                                                     spec.default and spec.default[:2]])
            out[name] = repr(value)
    return out


def files(root):
    found = set()
    for folder, _, names in os.walk(root):
        for name in names:
            parts = os.path.relpath(os.path.join(folder, name), root).split(os.sep)
            found.add("/".join(re.sub(r"_?pid\d+.*", "", p) for p in parts[:2]))
    return sorted(found)


def run(root, **kwargs):
    tool = getattr(op_tools, sys.argv[1])(**kwargs)
    with tool:
        workload()
    handled = sorted(name for name, yes in tool._decisions.items() if yes)
    print("PROBE", json.dumps({"config": typed(tool), "handled": handled, "files": files(root)}, sort_keys=True))
'''

# tool, variables, the same as keyword arguments (Python source), the same in the config file
CASES = [
    ("OpCapture",
     {"OP_CAPTURE_LIST": "torch.add,torch.nn.functional.relu", "OP_CAPTURE_DEDUP": "0", "OP_CAPTURE_MAX_BYTES": "1M"},
     "ops=['torch.add', F.relu], dedup=False, max_bytes=1 << 20",
     "[capture]\nops = ['torch.add', 'torch.nn.functional.relu']\ndedup = false\nmax_bytes = '1M'"),
    ("OpCapture", {"OP_CAPTURE_MODE": "summary", "OP_CAPTURE_DISABLE_LIST": ".*linear.*"},
     "mode='summary', disable=['.*linear.*']", "[capture]\nmode = 'summary'\ndisable = ['.*linear.*']"),
    ("OpObserve",
     {"OP_OBSERVE_DISABLE_LIST": "torch.Tensor.mul,torch.add", "OP_TOOLS_PRINT_STACK": "1", "OP_TOOLS_STRICT": "1"},
     "disable=[torch.Tensor.mul, 'torch.add'], print_stack=True, strict=True",
     "[op_tools]\nprint_stack = true\nstrict = true\n[observe]\ndisable = ['torch.Tensor.mul', 'torch.add']"),
    ("OpAutoCompare",
     {"OP_AUTOCOMPARE_LIST": "torch.add,torch.nn.functional.linear", "OP_AUTOCOMPARE_BACKWARD": "0",
      "OP_AUTOCOMPARE_MAX_SAVED": "1", "AUTOCOMPARE_ERROR_TOLERANCE_BFLOAT16": "0.01,0.02",
      "LINEAR_AUTOCOMPARE_ERROR_TOLERANCE_FLOAT16": "0.1,0.1",
      "LINEAR_OP_DTYPE_CAST_DICT": "torch.float16->torch.float32"},
     "ops='torch.add,torch.nn.functional.linear', backward=False, max_saved=1, "
     "tolerance={torch.bfloat16: (0.01, 0.02), F.linear: {'float16': (0.1, 0.1)}}, "
     "reference_casts={F.linear: {torch.float16: torch.float32}}",
     "[autocompare]\nops = ['torch.add', 'torch.nn.functional.linear']\nbackward = false\nmax_saved = 1\n"
     "tolerance.bfloat16 = [0.01, 0.02]\ntolerance.'torch.nn.functional.linear'.float16 = [0.1, 0.1]\n"
     "reference_casts.linear = {float16 = 'float32'}"),
    ("OpTimeMeasure", {"OP_TIME_MEASURE_LIST": "torch.add", "OP_TIME_MEASURE_SYNC": "1"},
     "ops='torch.add', sync=True", "[time_measure]\nops = ['torch.add']\nsync = true"),
    ("OpOverflowCheck", {"OP_OVERFLOW_CHECK_DISABLE_LIST": "torch.add", "OP_OVERFLOW_CHECK_RAISE": "1"},
     "disable=['torch.add'], raise_on_overflow=True",
     "[overflow_check]\ndisable = ['torch.add']\nraise_on_overflow = true"),
    ("OpFallback", {"OP_FALLBACK_LIST": "torch.nn.functional.relu"}, "ops=[F.relu]",
     "[fallback]\nops = ['torch.nn.functional.relu']"),
    ("OpDtypeCast", {"OP_DTYPE_CAST_DICT": "torch.float16->torch.float64", "OP_DTYPE_CAST_LIST": "torch.add"},
     "casts={torch.float16: torch.float64}, ops=['torch.add']",
     "[dtype_cast]\ncasts = {float16 = 'float64'}\nops = ['torch.add']"),
]


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    """Every case of CASES run in one child (an interpreter per case would cost a torch import each): case index ->
    (by variables, by arguments, by the config file), each the PROBE's record."""
    root = tmp_path_factory.mktemp("settings")
    cases = []
    for i, (tool, variables, arguments, toml) in enumerate(CASES):
        folder = root / str(i)
        folder.mkdir()
        (folder / "settings.toml").write_text(toml)
        cases.append(textwrap.dedent(f"""
            sys.argv[1:] = [{tool!r}]
            os.environ.update({variables!r}, OP_TOOLS_RESULTS_DIR={str(folder / 'env')!r})
            print("CASE", {i})
            run(os.environ["OP_TOOLS_RESULTS_DIR"])                                  # by variables
            for name in {sorted(variables)!r}:
                del os.environ[name]
            run({str(folder / 'args')!r}, results_dir={str(folder / 'args')!r}, {arguments})   # by arguments
            os.environ["OP_TOOLS_CONFIG"] = {str(folder / 'settings.toml')!r}
            os.environ["OP_TOOLS_RESULTS_DIR"] = {str(folder / 'file')!r}
            run({str(folder / 'file')!r})                                          # by the config file
            del os.environ["OP_TOOLS_CONFIG"]
        """))
    env = env_without_settings({"OP_TOOLS_VERBOSE": "0"})
    done = subprocess.run([sys.executable, "-c", PROBE + "".join(cases)], env=env, cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    records: dict[int, list] = {}
    case = -1
    for line in done.stdout.splitlines():
        if line.startswith("CASE "):
            case = int(line.removeprefix("CASE "))
        elif line.startswith("PROBE "):
            records.setdefault(case, []).append(json.loads(line.removeprefix("PROBE ")))
    return records


@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[0] for c in CASES])
def test_a_tool_configured_by_arguments_or_by_a_config_file_behaves_as_by_variables(probes, case):
    by_variables, by_arguments, by_file = probes[case]
    assert by_variables["handled"], "the workload must reach the tool for the comparison to mean anything"
    assert by_arguments == by_variables
    assert by_file == by_variables


def test_arguments_win_over_variables_which_win_over_the_config_file(tmp_path, monkeypatch):
    config = tmp_path / "settings.toml"
    config.write_text("[op_tools]\nverbose = true\n[capture]\nmode = 'full'\ndedup = false\nmax_bytes = 1024\n")
    monkeypatch.setenv("OP_TOOLS_CONFIG", str(config))
    monkeypatch.setenv("OP_CAPTURE_MODE", "summary")
    monkeypatch.setenv("OP_CAPTURE_MAX_BYTES", "2K")
    tool = op_tools.OpCapture(max_bytes="3K")
    tool.ensure_configured()
    assert tool.settings.mode == "summary"       # the variable over the file
    assert tool.settings.dedup is False          # the file over the default
    assert tool.settings.max_bytes == 3072       # the argument over the variable
    assert tool.common.verbose is False          # OP_TOOLS_VERBOSE=0 (the test's fixture) over the file's [op_tools]
    monkeypatch.delenv("OP_TOOLS_VERBOSE")
    monkeypatch.setattr(tool, "common", None)
    tool.ensure_configured()
    assert tool.common.verbose is True


@pytest.mark.parametrize(("tool", "kwargs", "error", "words"), [
    (op_tools.OpCapture, {"mode": "everything"}, ValueError, ["mode='everything'", "full"]),
    (op_tools.OpCapture, {"max_bytes": "5 parsecs"}, ValueError, ["max_bytes='5 parsecs'", "'500M'"]),
    (op_tools.OpCapture, {"ops": [3]}, TypeError, ["ops=[3]", "a list of op names"]),
    (op_tools.OpCapture, {"ops": ["torch.add", "(unclosed"]}, ValueError, ["invalid regular expression"]),
    (op_tools.OpDtypeCast, {"casts": {torch.float16: "float33"}}, ValueError, ["casts=", "float33", "dict"]),
    (op_tools.OpDtypeCast, {"casts": "float16"}, ValueError, ["casts='float16'", "->"]),
    (op_tools.OpAutoCompare, {"tolerance": (1e-3,)}, TypeError, ["tolerance=(0.001,)", "(atol, rtol)"]),
    (op_tools.OpAutoCompare, {"tolerance": {torch.float16: (-1, 0)}}, ValueError, ["tolerance=", ">= 0"]),
    (op_tools.OpAutoCompare, {"max_saved": -2}, ValueError, ["max_saved=-2", ">= 0"]),
    (op_tools.OpTimeMeasure, {"sync": "sometimes"}, ValueError, ["sync='sometimes'", "True or False"]),
    (op_tools.OpTimeMeasure, {"synch": True}, TypeError, ["'synch'", "did you mean sync?"]),
    (op_tools.OpFallback, {"results_dir": 3}, TypeError, ["results_dir=3", "directory path"]),
])
def test_a_bad_argument_is_an_error_naming_it_its_value_and_the_expected_form(tool, kwargs, error, words):
    with pytest.raises(error) as info:
        tool(**kwargs)
    for word in words:
        assert word in str(info.value)
    assert tool.__name__ in str(info.value)


def test_each_tool_shows_its_keywords_in_its_signature_and_docstring():
    import inspect

    for cls in {*op_tools.FEATURES.values()}:
        parameters = inspect.signature(cls).parameters
        assert {"ops", "disable", "results_dir", "verbose", "print_stack", "strict"} <= set(parameters)
        for keyword in cls.keywords:
            assert f"``{keyword}``" in cls.__doc__, (cls.__name__, keyword)


@pytest.mark.parametrize(("toml", "words"), [
    ("[captur]\nmode = 'summary'\n", ["unknown section [captur]", "did you mean [capture]?"]),
    ("[op_capture]\nmode = 'summary'\n", ["unknown section [op_capture]", "did you mean [capture]?"]),
    ("[capture]\nmdoe = 'summary'\n", ["[capture] mdoe: unknown setting", "did you mean mode?"]),
    ("[capture]\nOP_CAPTURE_MODE = 'summary'\n", ["[capture] OP_CAPTURE_MODE", "did you mean mode?"]),
    ("[op_tools]\nops = ['torch.add']\n", ["[op_tools] ops: unknown setting"]),
    ("[capture]\nmode = 'everything'\n", ["[capture] mode = 'everything'", "unknown choice", "full, summary or stats"]),
    ("mode = 'summary'\n", ["outside any section"]),
    ("[capture\n", ["not valid TOML"]),
])
def test_a_bad_config_file_is_an_error_naming_the_file_section_and_key(toml, words, tmp_path, monkeypatch):
    config = tmp_path / "team.toml"
    config.write_text(toml)
    monkeypatch.setenv("OP_TOOLS_CONFIG", str(config))
    with pytest.raises(ValueError) as info:
        op_tools.OpCapture().start()
    assert str(config) in str(info.value)
    for word in words:
        assert word in str(info.value)
    assert not torch.overrides._get_current_function_mode_stack()  # nothing left started


def test_a_missing_config_file_names_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("OP_TOOLS_CONFIG", str(tmp_path / "nowhere.toml"))
    with pytest.raises(ValueError, match="OP_TOOLS_CONFIG=.*nowhere.toml.*cannot read it"):
        op_tools.OpObserve().start()


def test_full_capture_stops_at_max_bytes_with_one_warning_saying_how_much_was_saved(sim, tmp_path, caplog):
    x = torch.randn(256, device=sim)  # 1 KiB per tensor
    with caplog.at_level("WARNING", logger="op_tools"), op_tools.OpCapture(max_bytes="6K", dedup=False) as capture:
        for _ in range(10):
            x = torch.add(x, 1)
    warnings = [r.getMessage() for r in caplog.records if "max_bytes" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "OP_CAPTURE_MAX_BYTES" in warnings[0] and "later calls are not saved" in warnings[0]
    written = capture.store.bytes_written
    assert 0 < written < 12 * 1024  # a call started is saved whole (its inputs are checked before it)
    assert f"{written / 1024 ** 2:.1f} MiB" in warnings[0] or f"{written} bytes" in warnings[0]
    saved = [f for _, _, fs in os.walk(tmp_path / "results") for f in fs if f == "input.pth"]
    assert 0 < len(saved) < 10 and capture.calls_not_saved == 10 - len(saved)
