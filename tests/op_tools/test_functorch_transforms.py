"""Calls inside ``torch.func`` transforms (``vmap``, ``grad``): functorch's batched and wrapped tensors have no
storage a tool could read, copy or save. The tools that read values say such calls are not checked (they failed on
each, or one killed the run at ``stop()``); those that only run or time calls work through them."""

import logging

import pytest
import torch

import op_tools
from op_tools.core.engine import OpTool


def _per_sample(device: str):
    """A per-sample loss and per-sample gradients (Opacus's way), plus one gelu outside any transform."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).to(device)
    x = torch.randn(5, 8, device=device)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi):
        return torch.nn.functional.gelu(torch.func.functional_call(model, p, (xi,))).tanh().sum()

    per_sample = torch.func.vmap(loss, in_dims=(None, 0))(params, x)
    grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
    outside = torch.nn.functional.gelu(x)
    return [t.cpu() for t in (per_sample, grads["weight"], grads["bias"], outside)]


TOOLS = {
    "OpAutoCompare": lambda: op_tools.OpAutoCompare(),
    "OpOverflowCheck": lambda: op_tools.OpOverflowCheck(),
    "OpCapture(stats)": lambda: op_tools.OpCapture(mode="stats"),
    "OpCapture(full)": lambda: op_tools.OpCapture(),
    "OpSelfCheck": lambda: op_tools.OpSelfCheck(),
}


@pytest.mark.parametrize("tool", list(TOOLS))
def test_calls_inside_transforms_are_said_not_checked_and_the_run_is_unchanged(sim, tool, caplog):
    base = _per_sample(sim)
    with caplog.at_level(logging.WARNING, logger="op_tools"), TOOLS[tool]() as t:
        seen = _per_sample(sim)
    assert all(torch.equal(a, b) for a, b in zip(base, seen))
    assert not [r.getMessage() for r in caplog.records if "failed on" in r.getMessage()]  # no tool failure
    assert sum(t.transformed.values()) >= 3 and next(iter(t.transformed)) == "torch.nn.functional.linear"
    assert "inside torch.func transforms (vmap, grad, jacrev) not checked" in t.not_checked()
    assert "no call was handled" not in t.not_checked()
    assert t.verdict() == "unchecked"
    if tool != "OpSelfCheck":  # its default list has no gelu outside the transforms to miss; the others check it
        assert t.handled["torch.nn.functional.gelu"] == 1


def test_a_wrong_op_outside_transforms_is_still_found(sim):
    import ditorch.sim

    with ditorch.sim.faults("gelu:noise=0.01"), op_tools.OpAutoCompare() as compare:
        _per_sample(sim)
    assert [f["op"] for f in compare.failures] == ["torch.nn.functional.gelu"]
    assert compare.verdict() == "found"


def test_fallback_and_dtype_cast_run_through_transforms(sim):
    base = _per_sample("cpu")
    with op_tools.OpFallback(ops=["torch.nn.functional.gelu", "torch.nn.functional.linear"]) as fallback:
        moved = _per_sample(sim)  # the sim's kernels are the CPU's: the fallback gives the same numbers
    assert all(torch.equal(a, b) for a, b in zip(base, moved))
    assert fallback.handled["torch.nn.functional.gelu"] == 3 and fallback.verdict() == "clean"

    x = torch.randn(5, 8, device=sim, dtype=torch.bfloat16)
    with op_tools.OpDtypeCast(ops=["torch.Tensor.exp"]) as cast:
        y = torch.func.vmap(torch.Tensor.exp)(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y.cpu(), x.cpu().float().exp().bfloat16())
    assert cast.handled["torch.Tensor.exp"] == 1 and cast.verdict() == "clean"


class _FailsAtFinish(OpTool):
    hook_name = "FailsAtFinishHook"

    def finish(self) -> None:
        raise RuntimeError("results in flight could not be read")


def test_a_tool_failing_as_it_finishes_says_so_and_the_run_goes_on(sim, monkeypatch):
    with _FailsAtFinish() as tool:
        torch.ones(2, device=sim) + 1
    assert "finishing failed (RuntimeError: results in flight could not be read)" in tool.closing_line()
    assert tool.verdict() == "unchecked"
    monkeypatch.setenv("OP_TOOLS_STRICT", "1")
    with pytest.raises(RuntimeError, match="results in flight"), _FailsAtFinish():
        torch.ones(2, device=sim) + 1
