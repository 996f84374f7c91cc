"""Errors: a user's op error propagates unchanged under every tool; a tool's own failure is reported once per op
name and the run goes on, unless OP_TOOLS_STRICT=1."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.overrides import handle_torch_function, has_torch_function

import ditorch.sim
import op_tools
from op_tools.output import reporting

ALL_TOOLS = [op_tools.OpCapture, op_tools.OpObserve, op_tools.OpOverflowCheck, op_tools.OpTimeMeasure,
             op_tools.OpAutoCompare, op_tools.OpFallback, op_tools.OpDtypeCast]


def _error_of(fn) -> BaseException:
    with pytest.raises(BaseException) as info:
        fn()
    return info.value


def _shape_mismatch(device):
    a, b = torch.ones(2, 3, device=device, requires_grad=True), torch.ones(2, 3, device=device)
    return torch.mm(a, b)


def _unsupported_on_device(device):
    with ditorch.sim.faults("tanh:unsupported"):
        return torch.ones(3, device=device).tanh()


class UserError(Exception):
    pass


def _user_code_raises(device):
    x = torch.ones(3, device=device, requires_grad=True)
    (x * 2).sum().backward()
    raise UserError("raised by user code between ops")


# OpFallback exists to run an op the device cannot run on the CPU instead: that error is what it removes.
USER_ERRORS = [(tool, op) for tool in ALL_TOOLS for op in (_shape_mismatch, _unsupported_on_device, _user_code_raises)
               if not (tool is op_tools.OpFallback and op is _unsupported_on_device)]


@pytest.mark.parametrize("tool, op", USER_ERRORS, ids=lambda x: x.__name__)
def test_a_user_op_error_propagates_with_its_type_and_message(tool, op, sim):
    plain = _error_of(lambda: op(sim))
    with tool():
        under_tool = _error_of(lambda: op(sim))
    assert type(under_tool) is type(plain)
    assert str(under_tool) == str(plain)


# --- failures inside a tool: functions reached through the torch-function protocol, as torch's own are ---

class Unprintable:
    """An argument no tool can write down: its repr raises."""

    def __repr__(self):
        raise RuntimeError("this object has no text form")


def scale_with_context(x, context):
    if has_torch_function((x,)):
        return handle_torch_function(scale_with_context, (x,), x, context)
    return x * 2


def scale_with_context_strict(x, context):
    if has_torch_function((x,)):
        return handle_torch_function(scale_with_context_strict, (x,), x, context)
    return x * 2


def device_only_op(x):
    """A vendor op with no CPU kernel: the CPU reference of OpAutoCompare cannot run it."""
    if has_torch_function((x,)):
        return handle_torch_function(device_only_op, (x,), x)
    if x.device.type == "cpu":
        raise RuntimeError("device_only_op has no CPU kernel")
    return x * 3


def device_only_op_strict(x):
    if has_torch_function((x,)):
        return handle_torch_function(device_only_op_strict, (x,), x)
    if x.device.type == "cpu":
        raise RuntimeError("device_only_op has no CPU kernel")
    return x * 3


def _warnings_about(caplog, name: str) -> list[str]:
    """The warnings naming ``name``, their lines wrapped at the console's width joined back."""
    messages = [reporting.unwrapped(r.getMessage()) for r in caplog.records if r.levelno == logging.WARNING]
    return [m for m in messages if name in m]


@pytest.mark.parametrize("tool, fn, args", [
    (op_tools.OpCapture, scale_with_context, lambda d: (torch.ones(3, device=d), Unprintable())),
    (op_tools.OpAutoCompare, device_only_op, lambda d: (torch.ones(3, device=d),)),
], ids=["OpCapture-unserialisable-argument", "OpAutoCompare-no-cpu-reference"])
def test_a_tool_failure_is_reported_once_per_op_and_the_run_goes_on(tool, fn, args, sim, caplog):
    caplog.set_level(logging.WARNING, logger="op_tools")
    with tool() as running:
        results = [fn(*args(sim)) for _ in range(3)]
        after = torch.ones(2, device=sim) + 1  # the run goes on
    assert all(r.cpu().tolist() == fn(*args(sim)).cpu().tolist() for r in results)
    assert after.cpu().tolist() == [2.0, 2.0]
    name = f"{fn.__module__}.{fn.__name__}"
    reports = [m for m in _warnings_about(caplog, name) if "reported once" in m]
    assert len(reports) == 1, reports
    assert tool.hook_name in reports[0]
    # the three calls are counted as not checked, and the closing line (a WARNING) says so, naming the first
    closing = _warnings_about(caplog, f"{tool.__name__}: ")[-1]
    assert f"3 calls not checked (the tool failed), the first {name}: " in closing
    assert running.verdict() == "unchecked"


@pytest.mark.parametrize("tool, fn, args, message", [
    (op_tools.OpCapture, scale_with_context_strict, lambda d: (torch.ones(3, device=d), Unprintable()),
     "no text form"),
    (op_tools.OpAutoCompare, device_only_op_strict, lambda d: (torch.ones(3, device=d),), "no CPU kernel"),
], ids=["OpCapture", "OpAutoCompare"])
def test_strict_makes_a_tool_failure_an_error(tool, fn, args, message, sim, monkeypatch):
    monkeypatch.setenv("OP_TOOLS_STRICT", "1")
    with pytest.raises(RuntimeError, match=message), tool():
        fn(*args(sim))
