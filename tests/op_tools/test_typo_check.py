"""Typos are caught when a tool starts: variables that look like op_tools' but are not, op names that no torch function
has, and an apply_feature condition_func that cannot be called; each with the right name suggested."""

from __future__ import annotations

import difflib
import subprocess
import sys
import textwrap

import pytest
import torch
from subprocess_env import env_without_settings

import op_tools
from op_tools.config import typo_check

# The script's warnings on stdout, one per line: whatever the library does with its loggers' output.
LOGGED = "import logging, sys\nlogging.basicConfig(stream=sys.stdout, format='%(name)s %(levelname)s %(message)s')\n"


def _run(code: str, env: dict, cwd) -> str:
    done = subprocess.run([sys.executable, "-c", LOGGED + textwrap.dedent(code)], env=env_without_settings(env),
                          cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_misspelt_variables_are_warned_about_once_with_the_closest_name_when_a_tool_starts(tmp_path):
    env = {"OP_CAPTRUE_LIST": "torch.add", "AUTOCOMPARE_ERROR_TOLERANCE_BF16": "1e-2,1e-2",
           "LINAER_AUTOCOMPARE_ERROR_TOLERANCE_FLOAT16": "1e-2,1e-2", "OP_TOOLS_VERBOS": "0",
           "LINEAR_OP_DTYPE_CAST_DICTT": "torch.float16->torch.float32",
           # correct ones, and another program's OP_ variable: no word
           "LINEAR_AUTOCOMPARE_ERROR_TOLERANCE_FLOAT16": "1e-2,1e-2", "OP_CAPTURE_LIST": "torch.add",
           "LAYER_NORM_OP_DTYPE_CAST_DICT": "torch.float16->torch.float32", "OP_SESSION_my_team": "x",
           "OP_TOOLS_RESULTS_DIR": str(tmp_path)}
    out = _run("""
        import torch, op_tools
        for _ in range(2):
            with op_tools.OpObserve(), op_tools.OpCapture():
                torch.ones(1)
    """, env, tmp_path)
    expected = {
        "OP_CAPTRUE_LIST": "OP_CAPTURE_LIST",
        "AUTOCOMPARE_ERROR_TOLERANCE_BF16": "AUTOCOMPARE_ERROR_TOLERANCE_BFLOAT16",
        "LINAER_AUTOCOMPARE_ERROR_TOLERANCE_FLOAT16": "LINEAR_AUTOCOMPARE_ERROR_TOLERANCE_FLOAT16",
        "OP_TOOLS_VERBOS": "OP_TOOLS_VERBOSE",
        "LINEAR_OP_DTYPE_CAST_DICTT": "LINEAR_OP_DTYPE_CAST_DICT",
    }
    for wrong, right in expected.items():
        line = f"op_tools WARNING {wrong} is not a variable op_tools reads; did you mean {right}?"
        assert out.count(line) == 1, out
    assert out.count("is not a variable op_tools reads") == len(expected), out


def test_a_misspelt_ditorch_variable_is_warned_about_at_import(tmp_path):
    # one that chooses the device is an error instead: tests/ditorch/test_import_traps.py
    out = _run("import ditorch\n", {"DITORCH_QUITE": "1"}, tmp_path)
    assert "ditorch WARNING DITORCH_QUITE is not a variable ditorch reads; did you mean DITORCH_QUIET?" in out


@pytest.mark.parametrize(("entry", "suggestion"), [
    ("torch.ad", "torch.add"),
    ("torch.nn.functional.lineer", "torch.nn.functional.linear"),
    ("torch.Tensor.sofmax", "torch.Tensor.softmax"),
    ("add", "torch.add"),
])
def test_an_unknown_op_name_in_a_list_is_warned_about_with_a_suggestion(entry, suggestion, caplog):
    with caplog.at_level("WARNING", logger="op_tools"), op_tools.OpObserve(disable=[entry, ".*silu.*"]):
        pass
    messages = [r.getMessage() for r in caplog.records if "no op is named" in r.getMessage()]
    assert len(messages) == 1, messages  # the pattern is not checked
    assert messages[0].startswith("OpObserve(disable=...)") and f"'{entry}'" in messages[0]
    assert suggestion in messages[0]


def test_an_unknown_op_name_in_a_variable_names_the_variable(monkeypatch, caplog):
    monkeypatch.setenv("OP_FALLBACK_DISABLE_LIST", "torch.nn.functional.gleu")
    with caplog.at_level("WARNING", logger="op_tools"), op_tools.OpFallback():
        pass
    (message,) = [r.getMessage() for r in caplog.records if "no op is named" in r.getMessage()]
    assert message.startswith("OP_FALLBACK_DISABLE_LIST: no op is named 'torch.nn.functional.gleu'")
    assert "torch.nn.functional.gelu" in message


def test_known_names_and_patterns_pass_without_a_word():
    for entry in ("torch.add", "torch.Tensor.add_", "torch.nn.functional.linear", "torch.Tensor.__getitem__",
                  "torch.linalg.vector_norm", ".*linear.*", "torch.nn.functional.(gelu|silu)", "mypackage.func"):
        assert typo_check.unknown_op(entry) is None, entry


def _double(x):
    return x * 2


def test_a_condition_func_with_a_wrong_signature_is_reported_once_and_the_run_goes_on(sim, caplog, monkeypatch):
    monkeypatch.setenv("OP_TOOLS_VERBOSE", "1")
    x = torch.ones(3, device=sim)
    op_tools.apply_feature("torch.add", "capture", condition_func=lambda t: t.numel() > 2)  # takes one argument
    try:
        with caplog.at_level("WARNING", logger="op_tools"):
            results = [torch.add(x, 1) for _ in range(3)]
    finally:
        op_tools.remove_feature("torch.add")
    assert all(torch.equal(r.cpu(), torch.full((3,), 2.0)) for r in results)
    reports = [r.getMessage() for r in caplog.records if r.getMessage().startswith("apply_feature(")]
    assert len(reports) == 1, reports
    assert "TypeError" in reports[0] and "torch.add(input, other" in reports[0]
    assert "condition_func(*args, **kwargs)" in reports[0] and "without the tool" in reports[0]
    import os
    folder = os.path.join(os.environ["OP_TOOLS_RESULTS_DIR"], "op_capture_results")  # made at start(), to probe it
    assert not [f for _, _, files in os.walk(folder) for f in files], "a call was captured"



def test_the_calls_a_raising_condition_func_left_unchecked_are_in_the_verdict(sim):
    # The call ran without the tool, on a wrong kernel here, and the verdict said "0 not checked ... no op failed"
    import ditorch.sim
    from op_tools.core import features

    x = torch.randn(4, device=sim)
    op_tools.apply_feature("torch.exp", "autocompare", condition_func=lambda t: True)  # no keyword `input`
    try:
        tool = features._patched["torch.exp"][4]
        torch.exp(x)  # handled: passes
        with ditorch.sim.faults("exp:noise=1e-1"):
            torch.exp(input=x)
    finally:
        op_tools.remove_feature("torch.exp")  # its verdict written
    assert tool.verdict() == "unchecked" and tool.failures == []
    assert tool.not_checked().startswith("1 call not checked (the tool failed), the first torch.exp: condition_func "
                                         "raised TypeError: "), tool.not_checked()
    assert tool.not_checked().endswith("<lambda>() got an unexpected keyword argument 'input'")


def test_a_condition_func_that_raises_propagates_in_strict_mode(sim, monkeypatch):
    monkeypatch.setenv("OP_TOOLS_STRICT", "1")
    op_tools.apply_feature("torch.add", "OpObserve", condition_func=lambda t: True)
    try:
        with pytest.raises(TypeError, match="positional argument"):
            torch.add(torch.ones(3, device=sim), 1)
    finally:
        op_tools.remove_feature("torch.add")


@pytest.mark.parametrize("name", ["capture", "op_capture", "OpCapture", "observe", "dump_op_args", "OpObserve",
                                  "time_measure", "measure_op_time", "dtype_cast", "cast_dtype", "time-measure"])
def test_apply_feature_takes_class_names_short_names_and_the_original_feature_names(name, sim):
    op_tools.apply_feature("torch.sub", name)
    try:
        torch.sub(torch.ones(2, device=sim), 1)
    finally:
        op_tools.remove_feature("torch.sub")


def test_an_unknown_feature_suggests_the_closest_name():
    with pytest.raises(ValueError, match=r"unknown feature 'captur'; valid features: .*; did you mean 'capture'\?$"):
        op_tools.apply_feature("torch.add", "captur")


def _searches_during(action) -> int:
    """How many closest-name searches (``difflib.get_close_matches``) ``action()`` runs, seen by a profile hook."""
    searches = 0

    def profile(frame, event, arg):
        nonlocal searches
        if event == "call" and frame.f_code is difflib.get_close_matches.__code__:
            searches += 1

    sys.setprofile(profile)
    try:
        action()
    finally:
        sys.setprofile(None)
    return searches


def test_a_tool_started_again_with_the_same_unknown_name_searches_and_warns_no_more(monkeypatch, caplog):
    monkeypatch.setenv("OP_OBSERVE_LIST", "torch.nn.functional.sliu_again")  # a name no other test checks

    def start_and_stop():
        with op_tools.OpObserve():
            pass

    with caplog.at_level("WARNING", logger="op_tools"):
        assert _searches_during(start_and_stop) > 0
    assert "no op is named 'torch.nn.functional.sliu_again'; did you mean" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="op_tools"):
        assert _searches_during(start_and_stop) == 0  # a tool started per step pays a set lookup
    assert "did you mean" not in caplog.text  # each warning about the list once per process (the closing line
    # names the entry that matched no call, as each stop's verdict)


def test_a_misspelt_variable_set_after_a_first_start_is_warned_about_at_the_next(monkeypatch, caplog):
    with op_tools.OpObserve():
        pass
    monkeypatch.setenv("OP_OBSERVE_DISABLE_LSIT", "torch.add")
    with caplog.at_level("WARNING", logger="op_tools"), op_tools.OpObserve():
        pass
    assert "OP_OBSERVE_DISABLE_LSIT is not a variable op_tools reads; did you mean OP_OBSERVE_DISABLE_LIST?" \
        in caplog.text
