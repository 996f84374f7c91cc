"""Targeted dispatch: a LIST of plain names wraps the named functions instead of pushing a mode, and a tool then
handles exactly the calls it would have handled through a mode."""

import logging
import re
import sys
import threading

import pytest
import torch
from tiny_models import tiny_gpt2, tiny_llama, train_llama
from torch import matmul as imported_matmul  # bound before any tool starts, as a program's imports are
from torch.nn import functional
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

import op_tools
from op_tools.core.engine import OpTool
from op_tools.ops.naming import OPERATOR_METHODS, resolve_op_name


class Record(OpTool):
    """Records the names it handles, forward and backward, into ``log`` (shared between instances in a test)."""

    hook_name = "RecordHook"
    env_prefix = "OP_RECORD"

    def __init__(self, log: list | None = None, tag: str = "") -> None:
        super().__init__()
        self.log = [] if log is None else log
        self.tag = tag
        self.backward_calls = 0

    def before(self, call):
        self.log.append((self.tag, call.name))

    def after_backward(self, call, grad_inputs, grad_outputs):
        self.backward_calls += 1


def dispatch_of(tool) -> str:
    return "mode" if _get_current_function_mode_stack() else "targeted"


@pytest.mark.parametrize("factory", [tiny_llama, tiny_gpt2])
def test_targeted_and_mode_dispatch_handle_the_same_calls_of_a_training_step(sim, factory, monkeypatch):
    def run(listing):
        monkeypatch.setenv("OP_RECORD_LIST", listing)
        with Record() as tool:
            kind = dispatch_of(tool)
            losses = train_llama(sim, steps=2, model_factory=factory)
        return kind, tool.log, tool.backward_calls, losses

    monkeypatch.delenv("OP_RECORD_LIST", raising=False)
    with Record() as everything:
        train_llama(sim, steps=1, model_factory=factory)
    names = sorted({name for _, name in everything.log})
    assert "torch.Tensor.add" in names and "torch.nn.functional.linear" in names or factory is tiny_gpt2

    kind_mode, calls_mode, backward_mode, losses_mode = run(",".join(map(re.escape, names)))  # patterns: a mode
    kind_targeted, calls_targeted, backward_targeted, losses_targeted = run(",".join(names))
    assert (kind_mode, kind_targeted) == ("mode", "targeted")
    assert len(calls_targeted) > 300 and calls_targeted == calls_mode
    assert backward_targeted == backward_mode > 100
    assert losses_targeted == losses_mode == train_llama(sim, steps=2, model_factory=factory)


def test_wrappers_exist_only_while_the_tool_runs_and_operators_are_seen_by_method_name(sim, monkeypatch):
    monkeypatch.setenv("OP_RECORD_LIST", "torch.nn.functional.silu,torch.Tensor.add,torch.Tensor.mul_")
    silu, add, iadd = functional.silu, torch.Tensor.__add__, torch.Tensor.__imul__
    x = torch.ones(3, device=sim)
    with Record() as tool:
        assert not _get_current_function_mode_stack()
        assert functional.silu is not silu and torch.Tensor.__add__ is not add
        functional.silu(x)
        x + 1
        1 + x
        x *= 2
        x.sub(1)
    assert [name for _, name in tool.log] == ["torch.nn.functional.silu", "torch.Tensor.add", "torch.Tensor.add",
                                               "torch.Tensor.mul_"]
    assert functional.silu is silu and torch.Tensor.__add__ is add and torch.Tensor.__imul__ is iadd
    assert torch.equal(x.cpu(), torch.full((3,), 2.0))


def test_a_name_imported_before_the_tool_started_is_handled_as_through_a_mode(sim, monkeypatch):
    # ``from torch import matmul`` at import time: the module's global was not wrapped, and its calls went unseen
    # (the original ditorch's modes saw them); a bound method stays out of reach, as documented
    monkeypatch.setenv("OP_RECORD_LIST", "torch.matmul")
    x = torch.ones(2, 2, device=sim)
    with Record() as tool:
        assert not _get_current_function_mode_stack()
        imported_matmul(x, x)
        torch.matmul(x, x)
    assert [name for _, name in tool.log] == ["torch.matmul", "torch.matmul"]
    assert imported_matmul is torch.matmul  # restored at stop()


def test_a_listed_function_no_mode_sees_keeps_its_imported_names(sim, monkeypatch):
    # torch.utils.checkpoint.checkpoint is a Python function of torch calls: a mode never sees it. Wrapped under
    # transformers' own name for it, the calls inside every checkpointed layer went unhandled
    import types

    import torch.utils.checkpoint

    holder = types.ModuleType("holder")
    holder.checkpoint = torch.utils.checkpoint.checkpoint
    monkeypatch.setitem(sys.modules, "holder", holder)
    monkeypatch.setenv("OP_RECORD_LIST", "torch.utils.checkpoint.checkpoint,torch.nn.functional.silu")
    x = torch.ones(2, 2, device=sim, requires_grad=True)
    with Record() as tool:
        assert holder.checkpoint is not torch.utils.checkpoint.checkpoint  # the torch name is wrapped, as listed
        holder.checkpoint(functional.silu, x, use_reentrant=False)
    assert [name for _, name in tool.log] == ["torch.nn.functional.silu"]


def test_a_name_a_notebook_binds_between_two_starts_is_handled(sim, monkeypatch):
    # the modules are searched again only after new imports; a notebook's cell binds names in __main__ with none
    import types

    monkeypatch.setenv("OP_RECORD_LIST", "torch.matmul")
    main = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", main)
    x = torch.ones(2, 2, device=sim)
    with Record():
        pass
    main.mm = torch.matmul  # the next cell: from torch import matmul as mm
    with Record() as tool:
        main.mm(x, x)
    assert [name for _, name in tool.log] == ["torch.matmul"] and main.mm is torch.matmul


def test_operator_methods_are_what_a_mode_sees():
    seen = []

    class Probe(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(resolve_op_name(func))
            return func(*args, **(kwargs or {}))

    found = {}
    for dunder in dir(torch.Tensor):
        if not re.fullmatch(r"__(r|i)?(add|sub|mul|truediv|div|floordiv|mod|pow|matmul|and|or|xor|lshift|rshift|"
                            r"lt|le|gt|ge|eq|ne|neg|abs|invert)__", dunder):
            continue
        integers = torch.ones(2, dtype=torch.int64)
        for args in ((torch.ones(2), torch.ones(2)), (integers, integers), (torch.ones(2),)):
            seen.clear()
            try:
                with Probe():
                    getattr(torch.Tensor, dunder)(*args)
            except (TypeError, RuntimeError):
                continue
            if seen[0] != "torch.Tensor." + dunder and seen[0] != resolve_op_name(getattr(torch.Tensor, dunder)):
                found[dunder] = seen[0].removeprefix("torch.Tensor.")
            break
    assert found == OPERATOR_METHODS


def test_only_the_thread_that_started_the_tool_is_handled(sim, monkeypatch):
    monkeypatch.setenv("OP_RECORD_LIST", "torch.nn.functional.silu")
    x = torch.ones(2, device=sim)
    with Record() as tool:
        other = threading.Thread(target=lambda: functional.silu(x))
        other.start()
        other.join()
        functional.silu(x)
    assert tool.log == [("", "torch.nn.functional.silu")]


def test_nested_calls_are_not_handled_and_tools_stack_like_modes(sim, monkeypatch):
    # functional.layer_norm calls torch.layer_norm: a mode does not see the inner call, nor does a wrapper.
    names = "torch.nn.functional.layer_norm,torch.layer_norm"
    x = torch.randn(2, 4, device=sim)
    logs = {}
    for kind, listing in (("mode", r"torch\.nn\.functional\.layer_norm,torch\.layer_norm"), ("targeted", names)):
        monkeypatch.setenv("OP_RECORD_LIST", listing)
        log = logs[kind] = []
        with Record(log, "outer"), Record(log, "inner"):
            functional.layer_norm(x, (4,))
            torch.layer_norm(x, (4,))
    assert logs["targeted"] == logs["mode"] == [
        ("inner", "torch.nn.functional.layer_norm"), ("outer", "torch.nn.functional.layer_norm"),
        ("inner", "torch.layer_norm"), ("outer", "torch.layer_norm")]


def test_a_mode_tool_and_a_targeted_tool_both_handle_a_call_once(sim, monkeypatch):
    x = torch.ones(2, device=sim)
    log = []
    monkeypatch.setenv("OP_RECORD_LIST", r"torch\.nn\.functional\.silu")
    with Record(log, "mode"):
        monkeypatch.setenv("OP_RECORD_LIST", "torch.nn.functional.silu")
        with Record(log, "targeted"):
            functional.silu(x)
    assert sorted(log) == [("mode", "torch.nn.functional.silu"), ("targeted", "torch.nn.functional.silu")]


def test_a_torch_name_that_names_no_function_needs_no_mode_and_the_other_names_stay_targeted(sim, monkeypatch):
    monkeypatch.setenv("OP_RECORD_LIST", "torch.nn.functional.silu,torch.nn.functional.sillu")
    with Record() as tool:
        assert dispatch_of(tool) == "targeted"  # no call can be named after no function: a mode would only cost
        functional.silu(torch.ones(2, device=sim))
        functional.gelu(torch.ones(2, device=sim))
    assert tool.log == [("", "torch.nn.functional.silu")]


@pytest.mark.parametrize("entry, problem", [
    ("mypackage.sillu", "no function is named 'mypackage.sillu'"),  # perhaps imported later: the mode sees it
    ("torch.Tensor.__add__", "'torch.Tensor.__add__' is reported as 'torch.Tensor.add'"),
    ("torch._C._nn.linear", "'torch._C._nn.linear' is reported as 'torch.nn.functional.linear'"),
])
def test_a_name_no_call_is_reported_under_is_reported_and_the_list_applies_through_a_mode(sim, monkeypatch, caplog,
                                                                                            entry, problem):
    monkeypatch.setenv("OP_RECORD_LIST", f"torch.nn.functional.silu,{entry}")
    with caplog.at_level(logging.WARNING, logger="op_tools"), Record() as tool:
        assert dispatch_of(tool) == "mode"
        functional.silu(torch.ones(2, device=sim))
    assert tool.log == [("", "torch.nn.functional.silu")]
    assert f"OP_RECORD_LIST: {problem}" in caplog.text


@pytest.mark.parametrize("dispatch", ["targeted", "mode"])
def test_torch_mm_and_its_equal_twin_spmm_are_each_named_as_called_and_listed_apart(sim, monkeypatch, dispatch):
    # torch.mm == torch.spmm (one C function under two names, equal and hashed alike): torch's name table and the
    # tools' caches took one for the other, so every torch.mm was reported as torch.spmm and no LIST could name it
    assert torch.mm == torch.spmm and resolve_op_name(torch.mm) == "torch.mm"
    assert resolve_op_name(torch.spmm) == "torch.spmm" and resolve_op_name(torch.mm) == "torch.mm"
    a = torch.randn(3, 3, device=sim)
    monkeypatch.setenv("OP_RECORD_LIST", "torch.mm" if dispatch == "targeted" else "torch.mm,torch.nn.functional.*")
    with Record() as tool:
        assert dispatch_of(tool) == dispatch
        torch.spmm(a, a)  # its binding hands a mode torch.mm's function (its own name): torch.mm's call there
        torch.mm(a, a)
        torch.mm(a, a)
    assert tool.log == [("", "torch.mm")] * (2 if dispatch == "targeted" else 3)


def test_every_tool_works_with_a_list_of_plain_names(sim, monkeypatch, tmp_path):
    monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(tmp_path))
    base = train_llama(sim, steps=1)
    for tool_class in (op_tools.OpCapture, op_tools.OpObserve, op_tools.OpOverflowCheck, op_tools.OpTimeMeasure,
                       op_tools.OpAutoCompare):
        prefix = tool_class.env_prefix
        monkeypatch.setenv(f"{prefix}_LIST", "torch.nn.functional.linear,torch.Tensor.add")
        with tool_class():
            assert not _get_current_function_mode_stack()
            assert train_llama(sim, steps=1) == base
        monkeypatch.delenv(f"{prefix}_LIST")
    captured = {p.name for p in tmp_path.rglob("*")}
    assert "torch.nn.functional.linear" in captured and "torch.Tensor.add" in captured
    assert not any("matmul" in name or "silu" in name for name in captured)
