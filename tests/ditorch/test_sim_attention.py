"""The chunked attention algorithm on sim: PyTorch's fused-attention route, correct to the dtype's rounding.

Tolerance: against a float64 CPU reference, output and gradients must be within 8 * eps(dtype) * max|reference|.
Over 40 random boolean masks in float32, PyTorch's own math path measured up to 3.5 eps * max|reference|, the
chunked kernel up to 4.4 (its float32 gradient sums run in another order; a CI run met 4.5 with an unseeded
mask); a wrong mask, scale, head grouping or logsumexp is off by orders of magnitude more. Masks are drawn
from a seeded generator: a test's inputs do not depend on what ran before it.
"""

import pytest
import torch
from tiny_models import train_llama

import ditorch.sim
from ditorch.sim.attention import MATH, OVERRIDEABLE

pytestmark = pytest.mark.usefixtures("sim")

FUSED = "_scaled_dot_product_fused_attention_overrideable"
sdpa = torch.nn.functional.scaled_dot_product_attention
_masks = torch.Generator().manual_seed(0)


def attention_case(dtype, heads=4, kv_heads=4, seq_q=13, seq_k=11, **options):
    """Output and q/k/v gradients on sim (chunked, 4 keys per block) and in float64 on the CPU."""
    torch.manual_seed(0)
    q = torch.randn(2, heads, seq_q, 8, dtype=dtype)
    k = torch.randn(2, kv_heads, seq_k, 8, dtype=dtype)
    v = torch.randn(2, kv_heads, seq_k, 6, dtype=dtype)
    mask = options.pop("attn_mask", None)
    reference_inputs = [t.double().requires_grad_() for t in (q, k, v)]
    reference_mask = mask.double() if mask is not None and mask.is_floating_point() else mask
    reference = sdpa(*reference_inputs, attn_mask=reference_mask, **options)
    grad = torch.randn_like(reference)
    reference.backward(grad)
    sim_inputs = [t.to("sim").requires_grad_() for t in (q, k, v)]
    with ditorch.sim.sdpa_algorithm("chunked", block_size=4):
        out = sdpa(
            *sim_inputs, attn_mask=mask.to("sim") if mask is not None else None, **options)
        out.backward(grad.to(dtype).to("sim"))
    assert type(out.grad_fn).__name__ == "ScaledDotProductFusedAttentionOverrideableBackward0"
    return ([out.detach()] + [t.grad for t in sim_inputs],
            [reference.detach()] + [t.grad for t in reference_inputs])


def assert_within_dtype_rounding(actual, expected, dtype):
    for got, want in zip(actual, expected):
        assert got.dtype == dtype
        error = (got.cpu().double() - want).abs().max().item()
        assert error <= 8 * torch.finfo(dtype).eps * want.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("options", [
    {},
    {"is_causal": True},
    {"is_causal": True, "kv_heads": 2, "enable_gqa": True},  # Llama's grouped-query attention
    {"attn_mask": torch.rand(13, 11, generator=_masks) > 0.3},  # boolean: True takes part
    {"attn_mask": torch.randn(2, 1, 13, 11, generator=_masks), "scale": 0.3},  # additive, broadcast over heads
    {"is_causal": True, "seq_q": 16, "seq_k": 16},  # GPT-2's self-attention
], ids=["plain", "causal", "gqa", "bool-mask", "float-mask", "square-causal"])
def test_forward_and_backward_match_a_float64_reference(dtype, options):
    options = dict(options)
    if "attn_mask" in options and options["attn_mask"].is_floating_point():
        options["attn_mask"] = options["attn_mask"].to(dtype)
    shapes = {key: options.pop(key) for key in ("kv_heads", "seq_q", "seq_k") if key in options}
    actual, expected = attention_case(dtype, **shapes, **options)
    assert_within_dtype_rounding(actual, expected, dtype)


def test_gradient_of_an_additive_mask():
    bias = torch.randn(1, 2, 5, 7, requires_grad=True)
    q, k, v = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 7, 4), torch.randn(1, 2, 7, 4)
    sdpa(q.double(), k.double(), v.double(), attn_mask=bias.double()).sum().backward()
    expected = bias.grad.clone()
    bias_sim = bias.detach().to("sim").requires_grad_()
    with ditorch.sim.sdpa_algorithm("chunked", block_size=3):
        sdpa(q.to("sim"), k.to("sim"), v.to("sim"), attn_mask=bias_sim).sum().backward()
    torch.testing.assert_close(bias_sim.grad.cpu(), expected, rtol=0, atol=1e-6)


def test_the_choice_follows_what_the_kernel_supports():
    q = torch.randn(1, 2, 4, 8, device="sim")
    kv = torch.randn(1, 1, 4, 8, device="sim")
    assert torch._fused_sdp_choice(q, q, q) == MATH  # the default: PyTorch's math path
    with ditorch.sim.sdpa_algorithm("chunked"):
        assert torch._fused_sdp_choice(q, q, q) == OVERRIDEABLE
        assert torch._fused_sdp_choice(q, q, q, dropout_p=0.1) == MATH
        assert torch._fused_sdp_choice(q, kv, kv) == MATH  # fewer kv heads without enable_gqa: math's error
        assert torch._fused_sdp_choice(q, kv, kv, enable_gqa=True) == OVERRIDEABLE
        assert torch._fused_sdp_choice(q.double(), q.double(), q.double()) == MATH
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.MATH]):
            assert torch._fused_sdp_choice(q, q, q) == MATH
        torch.manual_seed(0)
        dropped = sdpa(q, q, q, dropout_p=0.5)  # runs the math path
        assert dropped.shape == q.shape
        with ditorch.sim.faults(f"{FUSED}:unsupported"):
            with pytest.raises(RuntimeError, match=f"aten::{FUSED}.default is not supported"):
                sdpa(q, q, q)


def test_default_is_unchanged_and_the_algorithm_is_restored_after_the_block():
    q = torch.randn(1, 2, 6, 8)
    with ditorch.sim.faults(f"{FUSED}:unsupported"):  # never reached by default
        on_sim = sdpa(q.to("sim"), q.to("sim"), q.to("sim"), is_causal=True)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        assert torch.equal(on_sim.cpu(), sdpa(q, q, q, is_causal=True))
    with ditorch.sim.sdpa_algorithm("chunked", block_size=2):
        chunked = sdpa(q.to("sim"), q.to("sim"), q.to("sim"), is_causal=True).cpu()
        assert ditorch.sim.get_sdpa_algorithm() == ditorch.sim.SdpaAlgorithm("chunked", 2)
    assert ditorch.sim.get_sdpa_algorithm().name == "math"
    assert not torch.equal(chunked, on_sim.cpu())  # another algorithm: the same numbers, other roundings
    torch.testing.assert_close(chunked, on_sim.cpu())
    with pytest.raises(ValueError, match="unknown attention algorithm 'flash'"):
        ditorch.sim.set_sdpa_algorithm("flash")


def test_inference_mode_uses_the_chunked_kernel_too():
    q = torch.randn(1, 2, 5, 8)
    with ditorch.sim.sdpa_algorithm("chunked", block_size=2), torch.inference_mode():
        with ditorch.sim.faults("scaled_dot_product_attention:nan"):  # the op reaches sim whole here
            assert torch.isnan(sdpa(q.to("sim"), q.to("sim"), q.to("sim")).cpu()).all()
        out = sdpa(q.to("sim"), q.to("sim"), q.to("sim"), is_causal=True)
    torch.testing.assert_close(out.cpu(), sdpa(q, q, q, is_causal=True))


def test_tiny_llama_trains_two_steps_with_chunked_attention():
    with ditorch.sim.sdpa_algorithm("chunked", block_size=4):
        on_sim = train_llama("sim", steps=2)
        with ditorch.sim.faults(f"{FUSED}:nan"):  # its attention runs through the fused op
            assert all(loss != loss for loss in train_llama("sim", steps=1))
    assert on_sim == pytest.approx(train_llama("cpu", steps=2), rel=1e-5)
    assert on_sim[1] < on_sim[0]
