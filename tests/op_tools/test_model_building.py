"""Building and evaluating a model while a tool is on: on the meta device then ``to_empty`` on the device (FSDP2's
way), ``torch.nn.init`` on parameters, factories that make leaves, an evaluation under ``torch.inference_mode``. Each
killed the run under some tool, made every call fail in the tool, or changed what the script sees."""

import logging

import pytest
import torch

import op_tools
from op_tools.output.capture_format import load_op_args

TOOLS = {
    "OpAutoCompare": lambda: op_tools.OpAutoCompare(),
    "OpOverflowCheck": lambda: op_tools.OpOverflowCheck(),
    "OpCapture": lambda: op_tools.OpCapture(),
    "OpCapture(stats)": lambda: op_tools.OpCapture(mode="stats"),
    "OpTimeMeasure": lambda: op_tools.OpTimeMeasure(),
    "OpFallback": lambda: op_tools.OpFallback(),
    "OpDtypeCast": lambda: op_tools.OpDtypeCast(),
    "OpSelfCheck": lambda: op_tools.OpSelfCheck(),
}


def _built_on_meta(device: str) -> torch.Tensor:
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
        assert model(torch.ones(2, 8)).shape == (2, 8)  # a forward on meta: shapes only
    model = model.to_empty(device=device)
    for p in model.parameters():
        torch.nn.init.constant_(p, 0.25)
    loss = model(torch.arange(16.0, device=device).reshape(2, 8)).square().sum()
    loss.backward()
    return torch.stack([loss.detach(), model[0].weight.grad.sum()]).cpu()


@pytest.mark.parametrize("tool", list(TOOLS))
def test_a_model_built_on_meta_then_moved_runs_unchanged_without_a_tool_failure(sim, tool, caplog):
    base = _built_on_meta(sim)
    with caplog.at_level(logging.WARNING, logger="op_tools"), TOOLS[tool]() as t:
        seen = _built_on_meta(sim)
    assert torch.equal(seen, base)
    assert not [r.getMessage() for r in caplog.records if "failed on" in r.getMessage()]
    assert "the tool failed" not in t.not_checked()


def test_a_call_reading_meta_tensors_is_captured_with_them(sim, tmp_path):
    with op_tools.OpCapture(results_dir=str(tmp_path), ops=["torch.empty_like"]):
        torch.empty_like(torch.empty(2, 3, device="meta"), device=sim)
    (saved,) = tmp_path.glob("op_capture_results/torch.empty_like/*/*/*/input.pth")
    data = load_op_args(str(saved))
    assert data["args"][0].is_meta and data["args"][0].shape == (2, 3)


@pytest.mark.parametrize("tool", ["OpFallback", "OpDtypeCast"])
def test_init_functions_write_parameters_and_the_users_own_errors_stay(sim, tool):
    model = torch.nn.Linear(4, 4).to(sim, torch.bfloat16)
    with TOOLS[tool]():
        torch.nn.init.constant_(model.weight, 0.5)  # under no_grad inside: autograd refused the copy back
        torch.nn.init.normal_(model.bias)
        with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
            model.bias.add_(1)  # raised without the tool too
        x = torch.ones(4, device=sim, dtype=torch.bfloat16, requires_grad=True)
        y = x * 1
        y.mul_(3)  # an in-place write autograd records: its gradient still flows
        y.sum().backward()
    assert model.weight.is_leaf and torch.equal(model.weight.detach().cpu(), torch.full((4, 4), 0.5).bfloat16())
    assert torch.equal(x.grad.cpu(), torch.full((4,), 3.0).bfloat16())


def test_a_factory_making_a_leaf_makes_one_under_fallback(sim):
    with op_tools.OpFallback():
        x = torch.ones(4, device=sim, requires_grad=True)
        (x * 2).sum().backward()
    assert x.is_leaf and x.grad_fn is None and x.device.type == sim
    assert torch.equal(x.grad.cpu(), torch.full((4,), 2.0))


@pytest.mark.parametrize("tool", ["OpAutoCompare", "OpOverflowCheck", "OpCapture", "OpCapture(stats)"])
def test_an_evaluation_under_inference_mode_is_checked(sim, tool, caplog):
    # inference tensors have no version counter, and on sim every view made in inference mode failed: each call
    # failed in the tool ("not checked (the tool failed)")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU()).to(sim).eval()
    x = torch.randn(4, 8, device=sim)

    def evaluate():
        with torch.inference_mode():
            return model(x).reshape(-1, 8).softmax(-1).cpu()

    base = evaluate()
    with caplog.at_level(logging.WARNING, logger="op_tools"), TOOLS[tool]() as t:
        seen = evaluate()
    assert torch.equal(seen, base) and t.verdict() == "clean"
    assert not [r.getMessage() for r in caplog.records if "failed on" in r.getMessage()]


def test_an_overflow_under_inference_mode_is_found(sim):
    import ditorch.sim

    x = torch.randn(4, 8, device=sim)
    with ditorch.sim.faults("gelu:nan"), op_tools.OpOverflowCheck() as check, torch.inference_mode():
        torch.nn.functional.gelu(x * 2).sum()
    assert check.first_overflow is not None and check.first_overflow.name == "torch.nn.functional.gelu"
