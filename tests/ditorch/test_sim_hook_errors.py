"""A user's hook that raises during a sim backward: its exception reaches backward's caller unchanged, as on a device
whose guard is C++ (before ``ditorch/sim/device_guard.py`` the process aborted: "terminate called without an active
exception")."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from subprocess_env import child_env


class HookError(Exception):
    pass


def _raising(seen: list):
    def hook(*_):
        error = HookError("the user's hook")
        seen.append(error)
        raise error

    return hook


def _assert_unchanged(raised: pytest.ExceptionInfo, seen: list) -> None:
    from ditorch.sim import device_guard

    (error,) = seen
    assert raised.value is error  # the same object, neither wrapped nor chained to the engine's SystemError
    assert error.__cause__ is None and error.__context__ is None
    frames = []
    tb = raised.tb
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert frames[-1] == "hook" and "type_" not in frames  # ends where it was raised; the guard's frame is not shown
    assert not device_guard.TAKEN.errors


@pytest.mark.parametrize("on_calling_thread", [False, True], ids=["device thread", "calling thread"])
def test_a_tensor_hooks_exception_is_raised_by_backward_unchanged(sim, on_calling_thread):
    seen: list = []
    x = torch.randn(4, 4, device=sim, requires_grad=True)
    x.register_hook(_raising(seen))
    with torch.autograd.set_multithreading_enabled(not on_calling_thread), pytest.raises(HookError) as raised:
        (x * 2).sum().backward()
    _assert_unchanged(raised, seen)
    y = torch.randn(4, 4, device=sim, requires_grad=True)
    (y * 3).sum().backward()  # the device and the engine go on
    assert torch.equal(y.grad.cpu(), torch.full((4, 4), 3.0))


def test_a_module_backward_hooks_exception_is_raised_by_autograd_grad_unchanged(sim):
    seen: list = []
    layer = torch.nn.Linear(8, 8).to(sim)
    layer.register_full_backward_hook(_raising(seen))
    x = torch.randn(2, 8, device=sim, requires_grad=True)
    with pytest.raises(HookError) as raised:
        torch.autograd.grad(layer(x).sum(), x)
    _assert_unchanged(raised, seen)


def test_a_hooks_exception_under_an_op_tool_is_raised_unchanged(sim, tmp_path):
    import op_tools

    seen: list = []
    layer = torch.nn.Linear(8, 8).to(sim)
    x = torch.randn(2, 8, device=sim, requires_grad=True)
    with op_tools.OpAutoCompare(results_dir=str(tmp_path)):
        y = layer(x)
        y.register_hook(_raising(seen))
        with pytest.raises(HookError) as raised:
            y.sum().backward()
    _assert_unchanged(raised, seen)


def test_the_process_survives_a_hooks_exception():
    # In a process of its own: before the guard took the pending exception, this aborted the interpreter.
    script = """
import torch, ditorch.sim
ditorch.sim.register()
x = torch.randn(3, device="sim", requires_grad=True)
x.register_hook(lambda g: 1 / 0)
try:
    x.sum().backward()
except ZeroDivisionError as error:
    print("raised:", type(error).__name__)
print("alive")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env=child_env())
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-3:] == ["raised:", "ZeroDivisionError", "alive"]
