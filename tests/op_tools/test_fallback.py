import pytest
import torch
from tiny_models import train_llama

import op_tools

FAULTS = "rsqrt:unsupported;.*@float64:unsupported"


def test_llama_step_fails_on_the_device_and_matches_cpu_under_fallback(sim):
    import ditorch.sim

    cpu = train_llama("cpu", steps=2)
    with ditorch.sim.faults(FAULTS):
        with pytest.raises(ditorch.sim.SimUnsupportedError):
            train_llama(sim, steps=1)
        with op_tools.OpFallback():
            assert train_llama(sim, steps=2) == cpu


def test_only_listed_ops_fall_back(sim, monkeypatch):
    import ditorch.sim

    monkeypatch.setenv("OP_FALLBACK_LIST", "torch.rsqrt")
    cpu = train_llama("cpu", steps=1)
    with ditorch.sim.faults(FAULTS), op_tools.OpFallback():
        assert train_llama(sim, steps=1) == cpu


def test_in_place_and_out_update_the_device_tensors(sim):
    x = torch.ones(3, device=sim, dtype=torch.float16)
    out = torch.empty(3, device=sim, dtype=torch.float16)
    with op_tools.OpFallback():
        returned = x.add_(2)
        torch.mul(x, 2, out=out)
    assert returned is x and x.device.type == sim and x.dtype == torch.float16
    assert torch.equal(x.cpu(), torch.full((3,), 3.0, dtype=torch.float16))
    assert torch.equal(out.cpu(), torch.full((3,), 6.0, dtype=torch.float16))


def test_gradients_reach_device_parameters(sim):
    w = torch.nn.Parameter(torch.ones(2, 3, device=sim))
    with op_tools.OpFallback():
        loss = torch.nn.functional.linear(torch.ones(4, 3, device=sim), w).pow(2).sum()
    assert loss.device.type == sim
    loss.backward()
    assert w.grad.device.type == sim and torch.equal(w.grad.cpu(), torch.full((2, 3), 24.0))


def test_device_moves_are_never_fallen_back(sim, logged, monkeypatch):
    monkeypatch.setenv("OP_TOOLS_VERBOSE", "1")
    x = torch.ones(2, device=sim)
    with op_tools.OpFallback():
        assert x.cpu().device.type == "cpu"
        assert x.to("cpu").device.type == "cpu"
        y = x.view(2, 1)
    assert y._base is x or y.data_ptr() == x.data_ptr()
    out = logged()
    assert "skip OpFallbackHook on torch.Tensor.cpu" in out and "apply OpFallbackHook on torch.Tensor.cpu" not in out


def half_unfriendly(x):
    """Stands in for a CPU kernel without float16 support."""
    if x.device.type == "cpu" and x.dtype == torch.float16:
        raise RuntimeError('"half_unfriendly" not implemented for \'Half\'')
    return x * 2


def test_float16_is_upcast_when_the_cpu_rejects_it(sim):
    op_tools.apply_feature(f"{__name__}.half_unfriendly", "fallback")
    try:
        y = half_unfriendly(torch.ones(3, device=sim, dtype=torch.float16))
    finally:
        op_tools.remove_feature(f"{__name__}.half_unfriendly")
    assert y.device.type == sim and y.dtype == torch.float16
    assert torch.equal(y.cpu(), torch.full((3,), 2.0, dtype=torch.float16))


def test_an_embedding_with_sparse_gradients_falls_back_and_trains_as_on_the_device(sim):
    # Tensor.to's backward converts the gradient to the input's layout, which PyTorch refuses for a sparse one: the
    # user's backward() failed under the tool. The move's own backward keeps the gradient's layout.
    def train(tool):
        torch.manual_seed(0)
        embedding = torch.nn.Embedding(20, 4, sparse=True).to(sim)
        optimizer = torch.optim.SGD(embedding.parameters(), lr=0.5)
        index = torch.tensor([1, 3, 3, 7], device=sim)
        with tool:
            loss = embedding(index).square().sum()
            loss.backward()
        grad = embedding.weight.grad
        optimizer.step()
        return loss.item(), grad.layout, grad.coalesce().to_dense().cpu(), embedding.weight.detach().cpu()

    import contextlib

    plain = train(contextlib.nullcontext())
    with_tool = train(op_tools.OpFallback(ops=["torch.nn.functional.embedding"]))
    assert with_tool[0] == plain[0] and with_tool[1] == plain[1] == torch.sparse_coo
    assert torch.equal(with_tool[2], plain[2]) and torch.equal(with_tool[3], plain[3])
