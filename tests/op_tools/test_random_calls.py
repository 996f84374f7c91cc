"""Calls that draw random numbers: never rerun, but a Python composite (attention with dropout) is compared inside."""

import contextlib
import os

import pytest
import torch

import op_tools
from op_tools.core import one_hop


@pytest.fixture(params=["torch", "copy"])
def descends(request, monkeypatch):
    """Comparing the calls inside a Python composite under a mode skips one hop of torch-function dispatch: torch's
    own (2.13), or, where torch has none (2.11), a copy of the function without its check; both are held here."""
    if request.param == "torch" and one_hop._native is None:
        pytest.skip("this torch has no _skip_one_hop_torch_function")
    if request.param == "copy":
        monkeypatch.setattr(one_hop, "_native", None)


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
@pytest.mark.parametrize("ops", [None, ["torch.nn.functional.multi_head_attention_forward",
                                        "torch.nn.functional.softmax"]], ids=["mode", "targeted"])
def test_softmax_fault_under_attention_dropout_is_the_first_failure(sim, descends, ops):
    import ditorch.sim

    tool = op_tools.OpAutoCompare(**({"ops": ops} if ops else {}))
    with ditorch.sim.faults("_softmax:noise=1e-2"):
        attention_step(sim, tool=tool)
    first = tool.failures[0]
    assert (first["op"], first["phase"], first["module"]) == ("torch.nn.functional.softmax", "forward",
                                                              "MultiheadAttention")
    # the whole call is accounted for: skipped as random, with the calls compared inside it
    assert [reason for reason in tool.skipped if reason.startswith("random (compared inside")] != []


def test_attention_with_dropout_under_the_tool_draws_and_computes_as_without(sim, descends):
    expected = attention_step(sim)
    tool = op_tools.OpAutoCompare()
    got = attention_step(sim, tool=tool)
    for a, b in zip(got, expected):
        assert torch.equal(a.cpu(), b.cpu())
    assert tool.failures == []
    inside = {reason: n for reason, n in tool.skipped.items() if reason.startswith("random (compared inside")}
    assert sum(inside.values()) == 1 and tool.skipped["random"] == 1  # the attention, and the dropout inside it
    assert tool.counts["forward compared"] >= 8 and tool.counts["backward compared"] >= 4  # linear, bmm, softmax


def test_attention_as_one_op_with_dropout_is_compared_with_its_replayed_mask(sim, descends):
    expected = attention_step(sim, need_weights=False)  # multi_head_attention_forward calls SDPA with dropout_p
    tool = op_tools.OpAutoCompare()
    got = attention_step(sim, need_weights=False, tool=tool)
    for a, b in zip(got, expected):
        assert a is None and b is None or torch.equal(a.cpu(), b.cpu())  # results and the random stream untouched
    assert tool.failures == []
    sdpa = [(phase, c.passed) for name, _, phase, c, *_ in tool.rows if name.endswith("scaled_dot_product_attention")]
    assert ("forward", True) in sdpa and ("backward", True) in sdpa
    assert not [reason for reason in tool.skipped if "attention" in reason]


@pytest.mark.parametrize("need_weights", [False, True], ids=["sdpa", "softmax_and_dropout"])
def test_softmax_fault_under_attention_dropout_in_a_transformer_layer_is_found_first(sim, descends, need_weights):
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


def test_attention_with_dropout_in_a_fused_kernel_is_skipped_saying_its_mask_cannot_be_replayed(sim, descends,
                                                                                               monkeypatch):
    # MOCK: a device whose attention kernel draws its own dropout mask (flash on CUDA); sim has none
    monkeypatch.setattr(torch, "_fused_sdp_choice", lambda *args, **kwargs: 1)
    tool = op_tools.OpAutoCompare()
    attention_step(sim, need_weights=False, tool=tool)
    assert tool.failures == []
    fused = [reason for reason in tool.skipped if "fused kernel" in reason]
    assert len(fused) == 1 and "mask cannot be replayed" in fused[0]


def test_a_composite_that_cannot_be_descended_into_is_skipped_whole_and_said(sim, monkeypatch):
    monkeypatch.setattr(one_hop, "skipping", lambda func: None)  # as for a function with no check of its own
    expected = attention_step(sim)
    tool = op_tools.OpAutoCompare()
    got = attention_step(sim, tool=tool)
    for a, b in zip(got, expected):
        assert torch.equal(a.cpu(), b.cpu())  # runs as without the tool
    assert tool.skipped == {"random": 1} and tool.handled["torch.nn.functional.multi_head_attention_forward"] == 1
    assert "torch.nn.functional.softmax" not in tool.handled  # ran inside it, unseen: never counted as checked


def test_without_torchs_hop_a_functions_copy_skips_its_own_check_and_reads_its_module_live(monkeypatch):
    import types

    monkeypatch.setattr(one_hop, "_native", None)  # as in torch 2.11
    module = types.ModuleType("composite_module")
    exec("from torch.overrides import has_torch_function_unary, handle_torch_function\n"
         "def composite(x):\n"
         "    if has_torch_function_unary(x):\n"
         "        return handle_torch_function(composite, (x,), x)\n"
         "    return inner(x)\n"
         "def inner(x):\n"
         "    return x + 1\n", module.__dict__)
    run = one_hop.skipping(module.composite)
    seen = []

    class Names(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    module.inner = lambda x: x * 3  # rebound after the copy was made: the copy sees it
    x = torch.ones(2)
    with Names():
        result = run((x,), {})
    assert result.tolist() == [3.0, 3.0]
    assert seen == ["mul"]  # the composite's own check skipped, the calls inside it dispatched
    assert one_hop.skipping(torch.add) is None and one_hop.skipping(lambda x: x) is None  # nothing to skip
