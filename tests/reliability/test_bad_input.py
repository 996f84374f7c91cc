"""Bad input: every environment variable the library reads, given a malformed value, is a ValueError naming the
variable, the value and the expected form when the tool starts (op_tools) or at ``import ditorch`` (ditorch).

Driven by the declared tables (``op_tools.config.variables.VARIABLES``, ``ditorch.env.VARIABLES``): a malformed value is
derived from each variable's declared form, so a variable added with a form this file does not know fails here.
"""

from __future__ import annotations

import pytest

import ditorch.env
import op_tools
from op_tools.config.variables import VARIABLES

# Declared form -> a value that form rejects. Forms are matched by their start.
MALFORMED_BY_FORM = {
    "0 or 1": "maybe",
    "full or summary": "partial",
    "full, summary or stats": "partial",
    "eager, check or versus_eager": "sometimes",
    "cpu, device or auto": "gpu",
    "a fraction > 0 and <= 1": "1.5",
    "an integer >= 1": "0",
    "an integer >= 40, or full": "39",
    "a number >= 0": "-1",
    "comma-separated '<dtype>=<relative difference>'": "float32:1",
    "comma-separated op names or regular expressions": "torch.add,(unclosed",
    "comma-separated 'torch.<dtype>->torch.<dtype>' pairs": "torch.float16->torch.nodtype",
    "'atol,rtol'": "tight",
    "a directory path": None,  # an existing regular file: filled in by the test
    "one of npu, mlu": "tpu",
    "a positive integer": "0",
    "an integer >= 0": "-1",
    "'pattern[@dtype]:kind[,p=<fraction>][,rank=<r>]'": "mm:boom",
    "0, 1 (both), or a comma list of matmul, conv": "gemm",
    "math, or chunked": "flash",
    "cpu or gpu": "tpu",
    "a size in bytes": "lots",
    "a positive number of bytes": "2 gigs",
    "a TOML file path": "no/such/settings.toml",
    "all, or comma-separated ranks": "rank0",
    "all, or comma-separated steps": "step1",
    "a number > 1": "1",
    "auto, 0 or 1": "maybe",
    "comma-separated regular expressions": "model,(unclosed",
    "blocks, none, or comma-separated regular expressions": "model,(unclosed",
}

# Which tool reads an op_tools variable when it starts: by the variable's name.
TOOL_BY_PREFIX = {"OP_CAPTURE": op_tools.OpCapture, "OP_OBSERVE": op_tools.OpObserve,
                  "OP_OVERFLOW_CHECK": op_tools.OpOverflowCheck, "OP_FALLBACK": op_tools.OpFallback,
                  "OP_DTYPE_CAST": op_tools.OpDtypeCast, "OP_TIME_MEASURE": op_tools.OpTimeMeasure,
                  "OP_AUTOCOMPARE": op_tools.OpAutoCompare, "OP_TOOLS": op_tools.OpObserve,
                  "OP_SELF_CHECK": op_tools.OpSelfCheck,
                  "OP_TRAINING_MONITOR": op_tools.TrainingMonitor}


def malformed_value(form: str, tmp_path) -> str:
    for start, value in MALFORMED_BY_FORM.items():
        if form.startswith(start):
            if value is None:
                value = str(tmp_path / "a_file")
                (tmp_path / "a_file").write_text("not a directory")
            return value
    raise AssertionError(f"no malformed value for the form {form!r}: add one to MALFORMED_BY_FORM")


def concrete_name(name: str) -> str:
    """Declared names with placeholders (<OPNAME>, <DTYPE>) as a user writes them."""
    return name.replace("<OPNAME>", "LINEAR").replace("<DTYPE>", "FLOAT32")


def tool_reading(name: str):
    if "AUTOCOMPARE" in name or name.endswith("_OP_DTYPE_CAST_DICT") and name.startswith("<OPNAME>"):
        return op_tools.OpAutoCompare
    if name == "OP_TOOLS_MAX_CACHE_SIZE":  # the original's name: OpAutoCompare's and OpTimeMeasure's CSVs as they go
        return op_tools.OpAutoCompare
    for prefix in sorted(TOOL_BY_PREFIX, key=len, reverse=True):
        if name.startswith(prefix + "_"):
            return TOOL_BY_PREFIX[prefix]
    raise AssertionError(f"no tool known to read {name}: add it to TOOL_BY_PREFIX")


@pytest.mark.parametrize("declared", sorted(VARIABLES))
def test_op_tools_variable_malformed_fails_at_tool_start(declared, tmp_path, monkeypatch):
    var = VARIABLES[declared]
    name, value = concrete_name(declared), malformed_value(var.form, tmp_path)
    monkeypatch.setenv(name, value)
    if declared.startswith("OP_COMPARE_RUNS_"):  # read when compare_runs starts comparing, not by a tool
        from op_tools.offline.compare_runs import Tolerances

        with pytest.raises(ValueError) as info:
            Tolerances.from_env()
    else:
        made = []
        with pytest.raises(ValueError) as info:  # an op tool reads its variables at start, TrainingMonitor when made
            made.append(tool_reading(declared)())
            made[-1].start()
        for tool in made:
            tool.stop()  # nothing was started: a no-op
    message = str(info.value)
    assert name in message and repr(value) in message and var.form in message, message


@pytest.mark.parametrize("name", sorted(ditorch.env.VARIABLES))
def test_ditorch_variable_malformed_is_a_value_error_naming_it(name, tmp_path):
    # ditorch.env.read is what ``import ditorch`` (and the sim's register()) call; test_import_env.py shows the
    # import failing this way in a fresh interpreter.
    var = ditorch.env.VARIABLES[name]
    value = malformed_value(var.form, tmp_path)
    with pytest.raises(ValueError) as info:
        ditorch.env.read(name, {name: value})
    message = str(info.value)
    assert name in message and repr(value) in message, message
    # the fault grammar words its own form; every other variable quotes its declared one
    assert var.form in message or "expected 'pattern[@dtype]:kind[,p=<fraction>][,rank=<r>]'" in message, message
