import torch
from tiny_models import train_llama

import op_tools


def test_ops_run_in_float32_and_return_the_original_dtype(sim):
    x = torch.randn(64, dtype=torch.float16)
    with op_tools.OpDtypeCast():
        y = torch.nn.functional.silu(x.to(sim))
    assert y.dtype == torch.float16 and y.device.type == sim
    assert torch.equal(y.cpu(), torch.nn.functional.silu(x.float()).half())


def test_in_place_updates_the_original_tensor(sim):
    x = torch.ones(4, device=sim, dtype=torch.bfloat16)
    with op_tools.OpDtypeCast():
        returned = x.mul_(3)
    assert returned is x and x.dtype == torch.bfloat16
    assert torch.equal(x.cpu(), torch.full((4,), 3.0, dtype=torch.bfloat16))


def test_views_and_conversions_are_left_alone(sim, logged, monkeypatch):
    monkeypatch.setenv("OP_TOOLS_VERBOSE", "1")
    x = torch.ones(4, device=sim, dtype=torch.float16)
    with op_tools.OpDtypeCast():
        v = x.view(2, 2)
        h = x.float()
        x.sin()
    assert v.dtype == torch.float16 and h.dtype == torch.float32
    out = logged()
    assert "skip OpDtypeCastHook on torch.Tensor.view" in out
    assert "| torch.Tensor.sin |  input[0] | torch.float16 -> torch.float32 |" in out
    for column in ("name", "target", "action", "config"):
        assert f" {column} " in out


def test_custom_dict_and_llama_under_bf16_autocast(sim, monkeypatch):
    monkeypatch.setenv("OP_DTYPE_CAST_DICT", "torch.bfloat16->torch.float32,torch.half->torch.float64")
    with op_tools.OpDtypeCast() as tool:
        losses = train_llama(sim, steps=1, autocast_dtype=torch.bfloat16)
    assert tool.cast == {torch.bfloat16: torch.float32, torch.float16: torch.float64}
    assert all(torch.isfinite(torch.tensor(losses)))
