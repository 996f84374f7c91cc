"""Attention and softmax in bfloat16 and float16 judged by what their kernels round: a fused kernel's legitimate
differences pass, on sim's CPU numerics and its GPU ones; a fault of 1% in the output or the softmax is found."""

import os

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import op_tools
from op_tools.numerics.attention import attention_math

ATTENTION_KERNEL = "_scaled_dot_product_fused_attention_overrideable"  # sim's chunked kernel


@pytest.fixture(autouse=True)
def _no_autocompare_variables(monkeypatch):
    for name in list(os.environ):
        if "AUTOCOMPARE" in name or name.endswith("_OP_DTYPE_CAST_DICT"):
            monkeypatch.delenv(name)


def _attention_inputs(case: str, dtype: torch.dtype, seed: int, sim):
    """(q, k, v, keyword arguments): 2 x 4 heads of 32 over 48 tokens, as a Llama's attention."""
    g = torch.Generator().manual_seed(seed)
    heads_kv = 2 if case == "gqa" else 4
    q = torch.randn(2, 4, 48, 32, generator=g)
    k, v = (torch.randn(2, heads_kv, 48, 32, generator=g) for _ in range(2))
    kwargs: dict = {}
    if case == "causal":
        kwargs["is_causal"] = True
    elif case == "float mask":
        kwargs["attn_mask"] = (torch.randn(48, 48, generator=g) * 2).to(dtype).to(sim)
    else:  # grouped-query attention with a padding mask
        keep = torch.ones(2, 1, 48, 48, dtype=torch.bool)
        keep[1, ..., 40:] = False
        kwargs.update(attn_mask=keep.to(sim), enable_gqa=True)
    return [t.to(dtype).to(sim).requires_grad_() for t in (q, k, v)], kwargs


def _attention_step(sim, case: str, dtype: torch.dtype, seed: int, fault: str = ""):
    import ditorch.sim

    (q, k, v), kwargs = _attention_inputs(case, dtype, seed, sim)
    with ditorch.sim.faults(fault), op_tools.OpAutoCompare() as tool:
        F.scaled_dot_product_attention(q, k, v, **kwargs).float().square().sum().backward()
    return [(f["op"].rsplit(".", 1)[-1], f["phase"]) for f in tool.failures], tool


@pytest.mark.parametrize("numerics", ["cpu", "gpu"])
@pytest.mark.parametrize("case", ["causal", "float mask", "gqa"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fused_attention_passes_clean_and_a_one_percent_fault_fails(sim, dtype, case, numerics):
    import ditorch.sim

    with ditorch.sim.numerics(numerics):
        for algorithm in ("math", "chunked"):  # PyTorch's path, and a flash-like kernel rounding its probabilities
            with ditorch.sim.sdpa_algorithm(algorithm, block_size=16):
                for seed in range(3):
                    failures, tool = _attention_step(sim, case, dtype, seed)
                    assert failures == [], (algorithm, seed, failures)
        with ditorch.sim.sdpa_algorithm("chunked", block_size=16):
            failures, tool = _attention_step(sim, case, dtype, 0, f"{ATTENTION_KERNEL}:noise=1e-2")
    assert failures[0] == ("scaled_dot_product_attention", "forward"), failures
    assert "what rounding allows" in next(c.error_info for name, _, phase, c, *_ in tool.rows
                                          if phase == "forward" and not c.passed)


@pytest.mark.parametrize("dtype, noise", [(torch.bfloat16, "3e-3"), (torch.float16, "3e-4")], ids=["bf16", "fp16"])
def test_softmax_is_held_to_its_rounding(sim, dtype, noise):
    import ditorch.sim

    torch.manual_seed(0)
    scores = [(torch.randn(2, 4, rows, n) * 3).to(dtype).to(sim) for rows, n in ((64, 64), (2, 8192))]
    with op_tools.OpAutoCompare() as tool:
        for s in scores:  # a long row sums 8,192 terms in float32: still far inside the rounding
            F.softmax(s, dim=-1)
    assert tool.failures == [] and tool.counts["forward compared"] == 2
    with ditorch.sim.faults(f"_softmax:noise={noise}"), op_tools.OpAutoCompare() as tool:
        F.softmax(scores[0], dim=-1)
    assert [(f["op"], f["phase"]) for f in tool.failures] == [("torch.nn.functional.softmax", "forward")]


def test_the_math_path_takes_a_boolean_mask_as_attention_does():
    # the unfused run that replays a reduced-precision matmul, and the reference of a call with a replayed dropout mask
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 8, dtype=torch.float64) for _ in range(3))
    keep = torch.rand(6, 6) > 0.3
    keep[:, 0] = True  # no row masked whole
    assert torch.allclose(attention_math(q, k, v, keep), F.scaled_dot_product_attention(q, k, v, keep))


def _module_attention_step(sim, module: str, dtype: torch.dtype, seed: int, need_weights: bool, fault: str = "",
                           tool=None):
    """A forward and backward of nn.MultiheadAttention (or a TransformerEncoderLayer without dropout), training;
    its results and gradients."""
    import contextlib

    import ditorch.sim

    torch.manual_seed(seed)
    if module == "mha":
        layer = torch.nn.MultiheadAttention(64, 4, batch_first=True)
    else:
        layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    layer = layer.to(dtype).to(sim)
    x = torch.randn(2, 48, 64).to(dtype).to(sim).requires_grad_()
    with ditorch.sim.faults(fault), tool if tool is not None else contextlib.nullcontext():
        out = layer(x, x, x, need_weights=need_weights)[0] if module == "mha" else layer(x)
        out.float().square().sum().backward()
    return out, x.grad


@pytest.mark.parametrize("numerics", ["cpu", "gpu"])
@pytest.mark.parametrize("module, need_weights", [("mha", False), ("mha", True), ("encoder layer", False)],
                         ids=["mha", "mha with weights", "encoder layer"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_attention_in_python_is_judged_by_its_parts_and_a_one_percent_softmax_fault_fails(sim, dtype, module,
                                                                                          need_weights, numerics):
    # multi_head_attention_forward compared whole has one ratio, wide enough for fused kernels (16x): a 1e-2 fault in
    # its softmax passed in bfloat16 (3.7x). Compared inside as well, its attention is one scaled_dot_product_attention
    # (the fused kernels' rounding bound) or a softmax between two batched products (softmax's own bound).
    import ditorch.sim

    fault = "_softmax:noise=1e-2" if need_weights else "_safe_softmax:noise=1e-2"  # the math path's softmax
    with ditorch.sim.numerics(numerics):
        for seed in range(3):
            expected = _module_attention_step(sim, module, dtype, seed, need_weights)
            tool = op_tools.OpAutoCompare()
            got = _module_attention_step(sim, module, dtype, seed, need_weights, tool=tool)
            assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(got, expected))  # the tool changes nothing
            assert tool.failures == [], (seed, tool.failures)
            compared = {name.rsplit(".", 1)[-1] for name, _, phase, *_ in tool.rows if phase == "forward"}
            # the whole call too, and the attention inside it
            assert {"multi_head_attention_forward", "softmax" if need_weights else "scaled_dot_product_attention"} \
                <= compared, compared
            tool = op_tools.OpAutoCompare()
            _module_attention_step(sim, module, dtype, seed, need_weights, fault, tool=tool)
            first = tool.failures[0] if tool.failures else {}
            expected_op = "softmax" if need_weights else "scaled_dot_product_attention"
            assert (first.get("op", "").rsplit(".", 1)[-1], first.get("phase")) == (expected_op, "forward"), seed


def test_attention_in_python_listed_alone_is_still_compared_whole(sim):
    # A list naming multi_head_attention_forward alone wraps it and nothing inside it: the calls inside are not
    # handled, and the whole call is what is compared (as before the calls inside were compared too).
    torch.manual_seed(0)
    layer = torch.nn.MultiheadAttention(64, 4, batch_first=True).to(sim)
    x = torch.randn(2, 48, 64).to(sim)
    with op_tools.OpAutoCompare(ops=["torch.nn.functional.multi_head_attention_forward"]) as tool:
        layer(x, x, x)
    assert [name for name, _, phase, *_ in tool.rows if phase == "forward"] == \
        ["torch.nn.functional.multi_head_attention_forward"] * 2  # its two outputs
    assert tool.counts["forward compared"] == 1 and not tool.skipped
