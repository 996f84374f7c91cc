import logging
import threading

import pytest
import torch

import op_tools
from op_tools.core.engine import OpTool
from op_tools.ops.naming import resolve_op_name


class Recorder(OpTool):
    """A tool that records the names it handles (and can do torch work of its own)."""

    hook_name = "RecorderHook"

    def __init__(self, own_work=False):
        super().__init__()
        self.names = []
        self.own_work = own_work
        self.backward = []

    def after(self, call):
        self.names.append(call.name)
        if self.own_work:
            (call.result * 2).sum().item()  # a tool's own torch calls


class BackwardRecorder(Recorder):
    def before_backward(self, call, grad_outputs):
        self.backward.append(("before", call.name, len(grad_outputs)))

    def after_backward(self, call, grad_inputs, grad_outputs):
        self.backward.append(("after", call.name, [g.shape if g is not None else None for g in grad_inputs]))


def test_names_resolve_to_public_paths():
    assert resolve_op_name(torch.add) == "torch.add"
    assert resolve_op_name(torch.Tensor.add) == "torch.Tensor.add"
    assert resolve_op_name(torch.nn.functional.linear) == "torch.nn.functional.linear"
    assert resolve_op_name(torch._foreach_add_) == "torch._foreach_add_"


def test_factories_keep_their_names_when_a_device_layer_wraps_them():
    # ditorch's transfer replaces torch.ones with a wrapper; the call the mode sees is still torch.ones.
    import subprocess
    import sys

    from subprocess_env import child_env

    code = ("import torch, ditorch, op_tools; tool = op_tools.OpObserve().start(); "
            "torch.ones(2, device='cuda'); tool.stop()")
    env = child_env({"DITORCH_BACKEND": "sim", "DITORCH_QUIET": "1", "OP_OBSERVE_LIST": "torch.ones",
                     "OP_TOOLS_VERBOSE": "1"})
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "apply OpObserveHook on torch.ones" in result.stdout, result.stdout + result.stderr


def test_only_device_calls_are_handled_and_metadata_never(sim):
    x = torch.ones(2, 3, device=sim)
    with Recorder() as tool:
        torch.ones(2) + 1  # CPU: taken as correct
        x.size(), x.shape, x.dim(), x.numel(), x.data_ptr(), x.dtype, x.requires_grad
        y = x + 1
        torch.zeros(2, device=sim)
    assert tool.names == ["torch.Tensor.add", "torch.zeros"]
    assert y.device.type == sim


def test_tools_nest_and_each_sees_every_op_once(sim):
    x = torch.ones(4, device=sim)
    with Recorder(own_work=True) as outer, Recorder(own_work=True) as inner:
        torch.nn.functional.relu(x * 3)
    # layer below a tool never sees the tool's own `* 2`, `.sum()`, `.item()`
    assert outer.names == inner.names == ["torch.Tensor.mul", "torch.nn.functional.relu"]


def test_start_stop_end_and_restart(sim):
    x = torch.ones(2, device=sim)
    tool = Recorder()
    tool.start()
    x + 1
    tool.stop()
    x + 2
    tool.start()
    x * 2
    tool.end()
    assert tool.names == ["torch.Tensor.add", "torch.Tensor.mul"]


def test_tools_stopped_out_of_order_leave_the_other_running(sim):
    x = torch.ones(2, device=sim)
    first, second = Recorder().start(), Recorder().start()
    first.stop()
    x + 1
    second.stop()
    x + 1
    assert first.names == [] and second.names == ["torch.Tensor.add"]


def test_threads_do_not_see_each_other(sim):
    x = torch.ones(2, device=sim)
    seen = {}

    def work(label, op):
        with Recorder() as tool:
            for _ in range(50):
                op(x)
        seen[label] = set(tool.names)

    threads = [threading.Thread(target=work, args=(label, op)) for label, op in (("a", torch.sin), ("b", torch.cos))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"a": {"torch.sin"}, "b": {"torch.cos"}}


def test_user_exception_propagates_unchanged(sim):
    x = torch.ones(2, 3, device=sim)
    with Recorder(), pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
        x @ x


class Broken(OpTool):
    hook_name = "BrokenHook"

    def after(self, call):
        raise KeyError("tool bug")


def test_tool_failure_is_reported_once_and_the_run_goes_on(sim, caplog, monkeypatch):
    x = torch.ones(2, device=sim)
    with Broken():
        for _ in range(3):
            y = x + 1
    assert torch.equal(y.cpu(), torch.full((2,), 2.0))
    failures = [r for r in caplog.records if "BrokenHook failed on torch.Tensor.add" in r.getMessage()]
    assert len(failures) == 1
    monkeypatch.setenv("OP_TOOLS_STRICT", "1")
    with Broken(), pytest.raises(KeyError):
        x + 1


class BrokenInBackward(BackwardRecorder):
    hook_name = "BrokenInBackwardHook"

    def after_backward(self, call, grad_inputs, grad_outputs):
        raise KeyError("tool bug in backward")


def test_a_tool_failing_in_backward_is_reported_or_raised_by_backward_in_strict_mode(sim, caplog, monkeypatch):
    # The tool's step runs in an autograd hook, on the device's backward thread: strict mode raises its error
    # from backward() (sim's device guard carries it there, as CUDA's does), otherwise the step is reported.
    w = torch.ones(3, 4, device=sim, requires_grad=True)
    x = torch.ones(2, 4, device=sim)
    with BrokenInBackward() as tool:
        torch.nn.functional.linear(x, w).sum().backward()
    assert torch.equal(w.grad.cpu(), torch.full((3, 4), 2.0)) and tool.unchecked
    assert any("BrokenInBackwardHook failed on" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("OP_TOOLS_STRICT", "1")
    with BrokenInBackward(), pytest.raises(KeyError, match="tool bug in backward"):
        torch.nn.functional.linear(x, w).sum().backward()


def test_backward_hooks_see_upstream_and_input_gradients(sim):
    w = torch.ones(3, 4, device=sim, requires_grad=True)
    x = torch.ones(2, 4, device=sim)
    with BackwardRecorder() as tool:
        y = torch.nn.functional.linear(x, w)
    y.sum().backward()
    assert ("before", "torch.nn.functional.linear", 1) in tool.backward
    after = [b for b in tool.backward if b[0] == "after"]
    assert len(after) == 1 and any(shape is not None for shape in after[0][2])
    assert w.grad.device.type == sim


def test_a_call_handing_its_input_back_is_given_no_backward_of_the_call_that_made_it(sim):
    # x.to(x.dtype) and x.contiguous() return x itself: its node is the linear's, whose backward it is not
    w = torch.ones(3, 4, device=sim, requires_grad=True)
    x = torch.ones(2, 4, device=sim)
    with BackwardRecorder() as tool:
        y = torch.nn.functional.linear(x, w)
        assert y.to(torch.float32) is y and y.contiguous() is y
        z = y.mul_(2)  # an in-place op hands its input back too, with a node of its own
    z.sum().backward()
    assert [name for when, name, _ in tool.backward if when == "after"] == ["torch.Tensor.mul_",
                                                                           "torch.nn.functional.linear"]


def test_apply_lines_are_logged_once_per_op_at_debug(sim, logged, caplog, monkeypatch):
    monkeypatch.setenv("OP_TOOLS_VERBOSE", "1")
    x = torch.ones(2, device=sim)

    class Announcer(OpTool):
        hook_name = "AnnouncerHook"

    with Announcer():
        x + 1
        x + 1
    out = logged()
    assert out.count("apply AnnouncerHook on torch.Tensor.add") == 1
    (record,) = [r for r in caplog.records if r.getMessage().startswith("apply ")]
    assert record.levelno == logging.DEBUG and record.name == "op_tools.Announcer"
    assert op_tools.OpObserve.hook_name == "OpObserveHook"


def test_autograd_entry_points_are_not_ops(sim):
    # backward(), autograd.backward and autograd.grad run the graph: they are never handed to a tool as a call.
    x = torch.randn(3, device=sim, requires_grad=True)
    with Recorder() as tool:
        y = (x * x).sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        g.sum().backward()
    assert not any(name.startswith(("torch.autograd", "torch.Tensor.backward")) for name in tool.names)
    assert torch.allclose(x.grad.cpu(), torch.full((3,), 2.0))


class Unsupported(OpTool):
    hook_name = "UnsupportedHook"

    def after(self, call):
        from op_tools.ops.arguments import UnsupportedInputError

        raise UnsupportedInputError("sparse tensors are not compared")


def test_a_call_a_tool_cannot_check_by_design_is_not_checked_for_that_reason_without_a_failure(sim, caplog,
                                                                                                monkeypatch):
    x = torch.ones(2, device=sim)
    with Unsupported() as tool:
        for _ in range(3):
            x + 1
    assert tool.not_checked() == "3 calls not checked (sparse tensors are not compared), the first torch.Tensor.add"
    assert tool.verdict() == "unchecked" and not tool.unchecked  # not counted as the tool's failures
    assert not any("UnsupportedHook failed" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("OP_TOOLS_STRICT", "1")
    with Unsupported(), pytest.raises(Exception, match="sparse tensors are not compared"):
        x + 1


def test_sparse_calls_are_said_not_compared_and_not_recorded(sim, tmp_path):
    dense = torch.full((4, 4), 2.0, device=sim)
    with op_tools.OpAutoCompare(results_dir=str(tmp_path)) as compare:
        torch.log1p(dense.to_sparse())
    with op_tools.OpCapture(results_dir=str(tmp_path), mode="stats") as capture:
        torch.log1p(dense.to_sparse())
    assert "2 calls not checked (sparse tensors are not compared)" in compare.not_checked()
    assert "2 calls not checked (sparse tensors are not measured)" in capture.not_checked()
    assert compare.verdict() == capture.verdict() == "unchecked"


def test_a_tool_started_again_on_its_thread_is_refused_and_counts_each_call_once(sim):
    # started twice, a tool pushed a second mode: each call handled, counted and written twice
    tool = op_tools.OpTimeMeasure()
    with tool:
        with pytest.raises(RuntimeError, match="OpTimeMeasure is already started on this thread"):
            with tool:
                pass
        torch.ones(2, device=sim) * 2
    assert tool.handled["torch.Tensor.mul"] == 1
    with tool:  # stopped, it starts again
        torch.ones(2, device=sim) * 2
    assert tool.handled["torch.Tensor.mul"] == 1 and tool.verdict() == "clean"


def test_tool_work_around_a_tools_start_or_stop_leaves_torch_function_handling_as_it_was():
    # tool_work() asked at its exit whether a mode sat under the tools' again: a stop inside the block left
    # torch-function handling off on the thread for good (a program's mode saw no call after it), and a start
    # inside it raised AttributeError
    from torch.overrides import TorchFunctionMode

    class Seen(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.append(getattr(func, "__name__", ""))
            return func(*args, **(kwargs or {}))

    tool = op_tools.OpObserve().start()
    with op_tools.tool_work():  # the tool's own mode was under the block's start, none is at its end
        tool.stop()
    assert torch._C._is_torch_function_enabled()
    with Seen() as seen:
        torch.ones(2).add(1)
    assert "add" in seen.names
    with op_tools.tool_work():  # no mode at the block's start, the tool's at its end
        tool = op_tools.OpObserve().start()
    tool.stop()
    assert torch._C._is_torch_function_enabled()
