"""A verdict is an account: every handled call ends compared (passed or failed), skipped with a reason, not checked
(the tool failed on it) or raised by the op itself, and a clean line ("no op failed", "no inf/nan") is earned only
when every call was checked. ``python -m op_tools`` exits 0 clean, 3 found something, 4 could not check."""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from reliability.test_errors import device_only_op  # a vendor op with no CPU kernel
from subprocess_env import env_without_settings

import ditorch.sim
import op_tools
from op_tools.output import reporting


def _closing(caplog, tool_name: str) -> logging.LogRecord:
    return [r for r in caplog.records if r.getMessage().startswith(f"{tool_name}: ")][-1]


def _summary(caplog) -> str:
    """OpAutoCompare's summary, its lines wrapped at the console's width joined back."""
    summary = next(r.getMessage() for r in caplog.records if "OpAutoCompare summary" in r.getMessage())
    return reporting.unwrapped(summary)


@pytest.mark.parametrize("given", ["argument", "variable"])
@pytest.mark.parametrize("tool", [op_tools.OpAutoCompare, op_tools.OpOverflowCheck, op_tools.OpObserve])
def test_a_list_that_matches_no_call_is_not_a_clean_verdict(tool, given, sim, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="op_tools")
    x = torch.randn(8, device=sim)
    if given == "variable":
        monkeypatch.setenv(f"{tool.env_prefix}_LIST", "torch.nn.functional.sliu")
    with tool(**({"ops": "torch.nn.functional.sliu"} if given == "argument" else {})) as running:  # a typo: silu
        torch.nn.functional.silu(x)
    closing = _closing(caplog, tool.__name__)
    assert closing.levelno == logging.WARNING
    # the list named as the user gave it (an argument was said to be the variable, which was not set)
    where = f"{tool.__name__}(ops=...)" if given == "argument" else f"{tool.env_prefix}_LIST"
    assert f"{where} matched no call" in reporting.unwrapped(closing.getMessage())
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "no op failed" not in text and "no inf/nan from finite inputs" not in text.replace(
        "no inf/nan from finite inputs among", "")
    assert running.verdict() == "unchecked"


@pytest.mark.parametrize("tool", [op_tools.OpFallback, op_tools.OpDtypeCast])
def test_each_list_entry_that_matched_no_handled_call_is_named(tool, sim, caplog):
    # silu ran and was handled; gelu never ran; view ran, but neither tool reroutes a view (its values are its
    # input's): each said at stop. The calls that ran were handled: a warning, not an unchecked verdict (a list of
    # many ops names some a run never makes); a list that matched nothing at all is one (above).
    caplog.set_level(logging.INFO, logger="op_tools")
    x = torch.randn(8, device=sim, dtype=torch.float16)  # a dtype OpDtypeCast's default table casts
    with tool(ops=["torch.nn.functional.silu", "torch.nn.functional.gelu", "torch.Tensor.view"]) as running:
        torch.nn.functional.silu(x).view(2, 4)
    assert running.handled == {"torch.nn.functional.silu": 1}
    said = [reporting.unwrapped(r.getMessage()) for r in caplog.records if r.levelno == logging.WARNING]
    assert said == [f"{tool.__name__}: {tool.__name__}(ops=...) matched no call: torch.nn.functional.gelu; "
                    f"{tool.__name__}(ops=...) named calls {tool.__name__} does not handle: torch.Tensor.view"]
    with tool(ops=["torch.nn.functional.gelu", "torch.Tensor.view"]) as running:
        x.view(2, 4)
    assert running.not_checked() == (f"{tool.__name__}(ops=...) matched no call: torch.nn.functional.gelu; "
                                     f"{tool.__name__}(ops=...) named calls {tool.__name__} does not handle: "
                                     "torch.Tensor.view")
    assert running.verdict() == "unchecked"


def test_a_disable_list_that_excluded_every_call_is_named_as_why_nothing_was_checked(sim, monkeypatch):
    # It said "OP_OVERFLOW_CHECK_LIST matched no call: torch.nn.functional.gelu" though gelu ran, and with '.*',
    # "no call was handled (the CPU's calls are the reference: none ran on a device)" though they ran on the device.
    x = torch.randn(4, device=sim)
    monkeypatch.setenv("OP_OVERFLOW_CHECK_DISABLE_LIST", "torch.nn.functional.gelu")
    with op_tools.OpOverflowCheck(ops=["torch.nn.functional.gelu"]) as running:
        torch.nn.functional.gelu(x)
    assert running.not_checked() == ("OpOverflowCheck(ops=...) named calls OP_OVERFLOW_CHECK_DISABLE_LIST excludes: "
                                     "torch.nn.functional.gelu")
    with op_tools.OpOverflowCheck(disable=[".*"]) as running:
        torch.nn.functional.gelu(x) + 1
    assert running.not_checked() == ("OpOverflowCheck(disable=...) excluded every call that ran (torch.Tensor.add, "
                                     "torch.nn.functional.gelu)")
    assert running.verdict() == "unchecked"


def test_every_handled_call_is_compared_skipped_not_checked_or_raised(sim, caplog):
    caplog.set_level(logging.INFO, logger="op_tools")
    torch.manual_seed(0)
    x = torch.randn(16, 16, device=sim, requires_grad=True)
    with op_tools.OpAutoCompare() as compare:
        y = torch.nn.functional.dropout(x.sin(), p=0.5)          # dropout: skipped (random)
        torch.empty(3, device=sim)                                # uninitialised: skipped
        with pytest.raises(RuntimeError):
            torch.mm(y, torch.ones(3, 3, device=sim))             # the op's own error: raised
        (y * 2).sum().backward()
    c = compare.counts
    handled = sum(compare.handled.values())
    skipped = sum(compare.skipped.values())
    raised = sum(compare.raised.values())
    assert skipped >= 2 and raised == 1 and c["forward compared"] >= 3
    assert handled == c["forward compared"] + skipped + c["forward not checked"] + raised
    summary = _summary(caplog)
    assert (f"forward {c['forward compared']} compared, {c['forward passed']} passed, 0 failed, 0 not checked"
            in summary)
    assert f"{skipped} skipped; 1 raised by the op itself" in summary
    assert "no op failed" in summary.splitlines() and compare.verdict() == "clean"


def test_a_cpu_reference_that_cannot_run_counts_as_not_checked_not_skipped(sim, caplog):
    caplog.set_level(logging.INFO, logger="op_tools")
    x = torch.randn(8, device=sim)
    with op_tools.OpAutoCompare() as compare, ditorch.sim.faults("tanh:unsupported"):
        x.sin()
        device_only_op(x)
        with pytest.raises(RuntimeError):
            x.tanh()  # the device cannot run it: the op's own error
    assert compare.counts["forward not checked"] == 1 and not compare.skipped
    assert compare.raised["torch.Tensor.tanh"] == 1
    summary = _summary(caplog)
    assert "forward 1 compared, 1 passed, 0 failed, 1 not checked" in summary
    name = f"{device_only_op.__module__}.device_only_op"
    assert f"NOT CHECKED: 1 call not checked (the tool failed), the first {name}: " \
        "RuntimeError: the CPU reference cannot run" in summary
    assert "no op failed" not in summary and compare.verdict() == "unchecked"


def test_nothing_compared_never_reads_as_no_op_failed(sim, caplog):
    caplog.set_level(logging.INFO, logger="op_tools")
    x = torch.randn(8, device=sim)
    with op_tools.OpAutoCompare() as compare:
        torch.nn.functional.dropout(x, p=0.5)
    summary = _summary(caplog)
    assert "no op failed" not in summary and "no call was compared" in summary.splitlines()
    assert compare.verdict() == "clean"  # nothing went unchecked: the one call was skipped with its reason


def _replace_by_file(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    with open(folder, "w") as f:
        f.write("not a folder")  # as root, a read-only folder would still be written: a file stands in its way


def test_capture_files_it_could_not_write_leave_calls_not_checked(sim, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="op_tools")
    x = torch.randn(8, device=sim)
    with op_tools.OpCapture(results_dir=str(tmp_path)) as capture:
        x.sin()
        _replace_by_file(str(tmp_path / "op_capture_results"))
        x.cos()
    closing = _closing(caplog, "OpCapture")
    assert closing.levelno == logging.WARNING
    assert "1 call not checked (the tool failed), the first torch.Tensor.cos: " in reporting.unwrapped(
        closing.getMessage())
    assert capture.verdict() == "unchecked"


def test_failing_calls_autocompare_could_not_save_are_in_its_verdict(sim, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="op_tools")
    x = torch.randn(8, device=sim)
    _replace_by_file(str(tmp_path / "op_capture_results"))
    with op_tools.OpAutoCompare(results_dir=str(tmp_path)) as compare, ditorch.sim.faults("sigmoid:noise=1e-1"):
        x.sigmoid()
    closing = _closing(caplog, "OpAutoCompare")
    assert closing.levelno == logging.WARNING
    assert "of failing calls not written" in reporting.unwrapped(closing.getMessage())
    assert compare.verdict() == "found"  # what it found wins: the exit status says so (3)


DTENSOR_SCRIPT = """\
import os, torch, ditorch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
dist.init_process_group("gloo", rank=0, world_size=1)
mesh = DeviceMesh("sim", [0], _init_backend=False)
x = DTensor.from_local(torch.randn(4, 4, device="sim"), mesh, [Replicate()], run_check=False)
y = torch.nn.functional.silu(x) * 2
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_op_autocompare_compares_a_dtensor_call_on_its_whole_tensor_and_finds_a_fault(tmp_path):
    output, status = _run_dtensor_script("autocompare", tmp_path)
    assert status == 0, output[-3000:]
    assert "not checked;" not in output.replace("0 not checked;", "") and "no op failed" in output
    output, status = _run_dtensor_script("autocompare", tmp_path, faults="silu:noise=1e-2")
    assert status == 3, output[-3000:]
    # the op shortened in its cell at the default 100 columns, whole under the table
    assert re.search(r"^\|   1   \| torch\S*silu +\| forward \|", output, re.M), output[-3000:]
    assert "\n  [1] op: torch.nn.functional.silu\n" in output, output[-3000:]


def test_op_overflow_check_checks_the_part_of_a_dtensor_this_rank_holds(tmp_path):
    output, status = _run_dtensor_script("overflow_check", tmp_path)
    assert status == 0, output[-3000:]
    # DTensor.from_local's ``view_as`` is not handled: a view computes nothing (op_facts' ``alias_only``)
    assert "calls of 5 ops handled; wrote no file; no inf/nan from finite inputs" in output
    assert "not checked" not in output
    output, status = _run_dtensor_script("overflow_check", tmp_path, faults="silu:nan")
    assert status == 3 and "first inf/nan from finite inputs: torch.nn.functional.silu" in output, output[-3000:]


def _run_dtensor_script(tool: str, tmp_path, faults: str = "") -> tuple[str, int]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(DTENSOR_SCRIPT))
    env = env_without_settings({"DITORCH_BACKEND": "sim", "DITORCH_QUIET": "1", "MASTER_ADDR": "127.0.0.1",
                                "MASTER_PORT": str(_free_port()), "OP_TOOLS_RESULTS_DIR": str(tmp_path / "out"),
                                "DITORCH_SIM_FAULTS": faults})
    done = subprocess.run([sys.executable, "-m", "op_tools", tool, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    return done.stdout + done.stderr, done.returncode


def test_the_exit_status_is_the_verdict(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import torch, ditorch\nx = torch.ones(3, device='cuda')\ntorch.sigmoid(x)\n")
    env = env_without_settings({"DITORCH_BACKEND": "sim", "DITORCH_QUIET": "1", "OP_TOOLS_VERBOSE": "0",
                                "OP_TOOLS_RESULTS_DIR": str(tmp_path / "out")})

    def status(*options, faults: str = "") -> int:
        return subprocess.run([sys.executable, "-m", "op_tools", "autocompare", *options, str(script)], cwd=tmp_path,
                              env={**env, "DITORCH_SIM_FAULTS": faults}, capture_output=True, timeout=180).returncode

    assert status() == 0
    assert status(faults="sigmoid:noise=1e-1") == 3
    assert status("--ops", "torch.sigmoidd") == 4


@pytest.mark.parametrize("tool", ["OpAutoCompare", "OpCapture", "OpObserve", "OpTimeMeasure", "OpOverflowCheck",
                                  "OpFallback", "OpDtypeCast", "OpSelfCheck"])
def test_a_tool_never_started_is_unchecked_without_raising(tool):
    # OpOverflowCheck, OpAutoCompare, OpSelfCheck, ... raised AttributeError (state made at start)
    never = getattr(op_tools, tool)()
    assert (never.verdict(), never.not_checked()) == ("unchecked", "never started: no call was handled")


def test_a_tool_whose_start_failed_on_a_setting_is_a_never_started_one(monkeypatch):
    # configure() raised after the common settings were read: verdict() raised AttributeError, and not_checked()
    # said no call ran on a device
    monkeypatch.setenv("OP_OVERFLOW_CHECK_RAISE", "maybe")
    tool = op_tools.OpOverflowCheck()
    with pytest.raises(ValueError, match="OP_OVERFLOW_CHECK_RAISE"):
        tool.start()
    assert (tool.verdict(), tool.not_checked()) == ("unchecked", "never started: no call was handled")
