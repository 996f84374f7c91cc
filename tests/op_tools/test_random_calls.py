"""Calls that draw random numbers: never rerun, but a Python composite (attention with dropout) is compared inside."""

import contextlib
import os

import pytest
import torch

import op_tools
from op_tools.core import engine

# Comparing the calls inside a Python composite under a mode needs torch's one-hop skip of torch-function dispatch
# (torch 2.13); without it (torch 2.11) the composite runs whole and is skipped as random, said
# (test_without_the_one_hop_skip_attention_with_dropout_is_skipped_whole_and_said).
descends = pytest.mark.skipif(engine._skip_one_hop is None, reason="this torch has no _skip_one_hop_torch_function")


@pytest.fixture(autouse=True)
def _no_autocompare_variables(monkeypatch):
    for name in list(os.environ):
        if "AUTOCOMPARE" in name or name.endswith("_OP_DTYPE_CAST_DICT"):
            monkeypatch.delenv(name)


def attention_step(sim, need_weights: bool = True, tool=None):
    """One forward and backward of multi-head attention with dropout, training; what a script can observe after."""
    torch.manual_seed(0)
    attention = torch.nn.MultiheadAttention(8, 2, dropout=0.5).to(sim)
    x = torch.randn(5, 3, 8).to(sim).requires_grad_()
    torch.manual_seed(1)
    with tool if tool is not None else contextlib.nullcontext():
        out, weights = attention(x, x, x, need_weights=need_weights)
        out.sum().backward()
    return out, weights, x.grad, attention.in_proj_weight.grad, torch.get_rng_state()


# every call through a mode; a list of plain names through wrappers of those functions (targeting.py)
@pytest.mark.parametrize("ops", [pytest.param(None, marks=descends),
                                 ["torch.nn.functional.multi_head_attention_forward", "torch.nn.functional.softmax"]],
                         ids=["mode", "targeted"])
def test_softmax_fault_under_attention_dropout_is_the_first_failure(sim, ops):
    import ditorch.sim

    tool = op_tools.OpAutoCompare(**({"ops": ops} if ops else {}))
    with ditorch.sim.faults("_softmax:noise=1e-2"):
        attention_step(sim, tool=tool)
    first = tool.failures[0]
    assert (first["op"], first["phase"], first["module"]) == ("torch.nn.functional.softmax", "forward",
                                                              "MultiheadAttention")
    # the whole call is accounted for: skipped as random, with the calls compared inside it
    assert [reason for reason in tool.skipped if reason.startswith("random (compared inside")] != []


@descends
def test_attention_with_dropout_under_the_tool_draws_and_computes_as_without(sim):
    expected = attention_step(sim)
    tool = op_tools.OpAutoCompare()
    got = attention_step(sim, tool=tool)
    for a, b in zip(got, expected):
        assert torch.equal(a.cpu(), b.cpu())
    assert tool.failures == []
    inside = {reason: n for reason, n in tool.skipped.items() if reason.startswith("random (compared inside")}
    assert sum(inside.values()) == 1 and tool.skipped["random"] == 1  # the attention, and the dropout inside it
    assert tool.counts["forward compared"] >= 8 and tool.counts["backward compared"] >= 4  # linear, bmm, softmax


@descends
def test_attention_as_one_op_with_dropout_is_compared_with_its_replayed_mask(sim):
    expected = attention_step(sim, need_weights=False)  # multi_head_attention_forward calls SDPA with dropout_p
    tool = op_tools.OpAutoCompare()
    got = attention_step(sim, need_weights=False, tool=tool)
    for a, b in zip(got, expected):
        assert a is None and b is None or torch.equal(a.cpu(), b.cpu())  # results and the random stream untouched
    assert tool.failures == []
    sdpa = [(phase, c.passed) for name, _, phase, c, *_ in tool.rows if name.endswith("scaled_dot_product_attention")]
    assert ("forward", True) in sdpa and ("backward", True) in sdpa
    assert not [reason for reason in tool.skipped if "attention" in reason]


@descends
@pytest.mark.parametrize("need_weights", [False, True], ids=["sdpa", "softmax_and_dropout"])
def test_softmax_fault_under_attention_dropout_in_a_transformer_layer_is_found_first(sim, need_weights):
    import ditorch.sim

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True).to(sim).train()
    if need_weights:  # the attention as softmax, dropout and bmm calls, each handled
        forward = layer.self_attn.forward
        layer.self_attn.forward = lambda *a, **k: forward(*a, **{**k, "need_weights": True})
    x = torch.randn(2, 6, 16).to(sim)
    tool = op_tools.OpAutoCompare()
    with ditorch.sim.faults("_safe_softmax:noise=1e-2;_softmax:noise=1e-2"), tool:
        layer(x).sum().backward()
    first = tool.failures[0]
    expected = "torch.nn.functional.softmax" if need_weights else "torch.nn.functional.scaled_dot_product_attention"
    assert (first["op"], first["phase"], first["module"]) == (expected, "forward", "self_attn")


@descends
def test_attention_with_dropout_in_a_fused_kernel_is_skipped_saying_its_mask_cannot_be_replayed(sim, monkeypatch):
    # MOCK: a device whose attention kernel draws its own dropout mask (flash on CUDA); sim has none
    monkeypatch.setattr(torch, "_fused_sdp_choice", lambda *args, **kwargs: 1)
    tool = op_tools.OpAutoCompare()
    attention_step(sim, need_weights=False, tool=tool)
    assert tool.failures == []
    fused = [reason for reason in tool.skipped if "fused kernel" in reason]
    assert len(fused) == 1 and "mask cannot be replayed" in fused[0]


def test_without_the_one_hop_skip_attention_with_dropout_is_skipped_whole_and_said(sim, monkeypatch):
    monkeypatch.setattr(engine, "_skip_one_hop", None)  # as in torch 2.11
    expected = attention_step(sim)
    tool = op_tools.OpAutoCompare()
    got = attention_step(sim, tool=tool)
    for a, b in zip(got, expected):
        assert torch.equal(a.cpu(), b.cpu())  # runs as without the tool
    assert tool.skipped == {"random": 1} and tool.handled["torch.nn.functional.multi_head_attention_forward"] == 1
    assert "torch.nn.functional.softmax" not in tool.handled  # ran inside it, unseen: never counted as checked
