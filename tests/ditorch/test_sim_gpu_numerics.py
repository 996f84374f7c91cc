"""``DITORCH_SIM_NUMERICS=gpu``: sim's sums in a GPU reduction kernel's order (ditorch/sim/gpu_numerics.py)."""

from __future__ import annotations

import pytest
import torch

EPS32 = torch.finfo(torch.float32).eps


@pytest.fixture
def gpu_numerics(sim):
    import ditorch.sim

    with ditorch.sim.numerics("gpu"):
        yield sim


def _rows(seed: int = 0) -> torch.Tensor:
    return torch.randn(64, 512, generator=torch.Generator().manual_seed(seed))


def in_order(x: torch.Tensor) -> torch.Tensor:
    """The rows of ``x`` added one after the other in float32: what a thread per result computes."""
    total = torch.zeros(x.shape[1:])
    for row in x.float():
        total = total + row
    return total


def test_off_by_default_sim_sums_as_the_cpu(sim):
    x = _rows()
    assert torch.equal(x.to(sim).sum(-1).cpu(), x.sum(-1))
    assert torch.equal(x.to(sim).mean(0).cpu(), x.mean(0))


def test_contiguous_terms_are_summed_in_another_legitimate_order(gpu_numerics):
    x = _rows()
    device = x.to(gpu_numerics).sum(-1).cpu()
    assert (device != x.sum(-1)).any()  # another order: another rounding, on some rows
    exact = x.double().sum(-1)
    magnitudes = x.double().abs().sum(-1)
    n = x.shape[-1]
    assert ((device.double() - exact).abs() <= n * EPS32 / 2 * magnitudes).all()  # as any order may give


def test_strided_terms_are_summed_in_order_one_thread_per_result(gpu_numerics):
    x = _rows()
    assert torch.equal(x.to(gpu_numerics).sum(0).cpu(), in_order(x))


def test_half_types_accumulate_in_float32_and_a_mean_multiplies(gpu_numerics):
    x = _rows(1)
    bf16 = x.to(torch.bfloat16)
    total = bf16.to(gpu_numerics).sum(0).cpu()
    assert total.dtype == torch.bfloat16
    assert torch.equal(total, in_order(bf16).to(torch.bfloat16))
    mean = x.to(gpu_numerics).mean(0, keepdim=True).cpu()
    assert mean.shape == (1, 512)
    assert torch.equal(mean, (in_order(x) * torch.tensor(1 / 64, dtype=torch.float32)).reshape(1, 512))


def test_whole_tensor_sums_and_integers(gpu_numerics):
    x = _rows(2)
    whole = x.to(gpu_numerics).sum().cpu()
    assert abs(whole.double().item() - x.double().sum().item()) <= x.numel() * EPS32 * x.abs().sum().item()
    ints = torch.arange(10)
    assert x.to(gpu_numerics).sum(dtype=torch.float64).dtype == torch.float64
    assert torch.equal(ints.to(gpu_numerics).sum().cpu(), ints.sum())  # integers: exact, the CPU's kernel
    scalar = torch.tensor(2.5).to(gpu_numerics)  # a 0-d tensor (a loss): its sum was a TypeError in this mode
    assert scalar.sum().item() == scalar.mean().item() == 2.5


def test_the_switch_is_scoped(sim):
    import ditorch.sim
    from ditorch.sim.gpu_numerics import NUMERICS

    with ditorch.sim.numerics("gpu"):
        assert NUMERICS.mode == "gpu"
    assert NUMERICS.mode == "cpu"
    with pytest.raises(ValueError, match="DITORCH_SIM_NUMERICS='fast': expected cpu or gpu"):
        ditorch.sim.numerics("fast").__enter__()


def test_a_long_gemm_is_split_along_its_inner_dimension(gpu_numerics):
    generator = torch.Generator().manual_seed(3)
    a, b = torch.randn(64, 1024, generator=generator), torch.randn(1024, 32, generator=generator)
    slices = [a[:, s:s + 256] @ b[s:s + 256] for s in range(0, 1024, 256)]
    expected = slices[0]
    for part in slices[1:]:
        expected = expected + part
    device = (a.to(gpu_numerics) @ b.to(gpu_numerics)).cpu()
    assert torch.equal(device, expected) and not torch.equal(device, a @ b)
    bias = torch.randn(32, generator=generator)
    linear = torch.nn.functional.linear(a.to(gpu_numerics), b.t().contiguous().to(gpu_numerics), bias.to(gpu_numerics))
    assert torch.equal(linear.cpu(), expected + bias)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_addcmul_and_addcdiv_round_once_after_a_fused_multiply_add(gpu_numerics, dtype):
    generator = torch.Generator().manual_seed(4)
    x, t1, t2 = (torch.randn(4096, generator=generator).to(dtype) for _ in range(3))
    t2 = t2.abs() + 0.5
    acc = torch.float32
    fma_mul = (x.double() + (t1.to(acc) * 0.3).double() * t2.double()).to(acc).to(dtype)
    alpha = float(torch.tensor(0.3, dtype=acc))  # CUDA holds the scalar in the accumulation type
    fma_div = (x.double() + alpha * (t1.to(acc) / t2.to(acc)).double()).to(acc).to(dtype)
    on = [t.to(gpu_numerics) for t in (x, t1, t2)]
    assert torch.equal(torch.addcmul(*on, value=0.3).cpu(), fma_mul)
    divided = torch.addcdiv(*on, value=0.3).cpu()
    assert torch.equal(divided, fma_div)
    if dtype == torch.float32:  # the CPU rounds the quotient's product before adding: another, legitimate result
        assert not torch.equal(divided, torch.addcdiv(x, t1, t2, value=0.3))
    in_place = on[0].clone()
    in_place.addcdiv_(on[1], on[2], value=0.3)  # Adam's update, written into its argument
    assert torch.equal(in_place.cpu(), fma_div)


def warp_sum(rows: torch.Tensor) -> torch.Tensor:
    """``(M, n) -> (M, 1)``: each row's terms dealt to 32 lanes (term i to lane i % 32), each lane's added in order,
    the lanes' sums added pairwise, neighbours first: a warp's shuffle reduction."""
    lanes = torch.stack([in_order(rows[:, lane::32].T) if rows[:, lane::32].numel() else torch.zeros(len(rows))
                         for lane in range(32)], 1)
    while lanes.shape[1] > 1:
        lanes = lanes[:, 0::2] + lanes[:, 1::2]
    return lanes


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_log_softmax_in_cudas_association(gpu_numerics, dtype):
    # CUDA's LogSoftMaxForwardEpilogue: x - (max + log(sum)) in float32; the CPU's: (x - max) - log(sum)
    x = (torch.randn(64, 10, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    wide = x.float()
    top = wide.amax(1, keepdim=True)
    cuda = (wide - (top + warp_sum((wide - top).exp()).log())).to(dtype)
    on_sim = torch.log_softmax(x.to(gpu_numerics), 1).cpu()
    assert torch.equal(on_sim, cuda)
    if dtype != torch.float32:
        assert not torch.equal(on_sim, torch.log_softmax(x, 1))  # an ulp apart in some elements
        assert torch.log_softmax(x.to(gpu_numerics), 1, dtype=torch.float32).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_softmax_and_its_backward_sum_their_rows_in_a_warps_order(gpu_numerics, dtype):
    generator = torch.Generator().manual_seed(6)
    x = (torch.randn(64, 200, generator=generator) * 3).to(dtype)
    wide = x.float()
    e = (wide - wide.amax(1, keepdim=True)).exp()
    on_sim = torch.softmax(x.to(gpu_numerics), 1).cpu()
    assert torch.equal(on_sim, (e / warp_sum(e)).to(dtype))
    if dtype == torch.float32:
        assert not torch.equal(on_sim, torch.softmax(x, 1))  # another order: an ulp apart in some elements
    grad = torch.randn(64, 200, generator=generator).to(dtype)
    out = on_sim.float()
    expected = out * (grad.float() - warp_sum(grad.float() * out))
    backward = torch.ops.aten._softmax_backward_data(grad.to(gpu_numerics), on_sim.to(gpu_numerics), 1, dtype)
    assert torch.equal(backward.cpu(), expected.to(dtype))
    log_out = torch.log_softmax(x.to(gpu_numerics), 1)
    log_backward = torch.ops.aten._log_softmax_backward_data(grad.to(gpu_numerics), log_out, 1, dtype)
    assert torch.equal(log_backward.cpu(), (grad.float() - log_out.cpu().float().exp() * warp_sum(grad.float()))
                       .to(dtype))


def test_attentions_safe_softmax_gives_a_row_masked_whole_zeros(gpu_numerics):
    x = torch.randn(4, 40, generator=torch.Generator().manual_seed(7))
    x[1] = -torch.inf
    on_sim = torch.ops.aten._safe_softmax(x.to(gpu_numerics), -1).cpu()
    assert torch.equal(on_sim[1], torch.zeros(40))
    e = (x[[0, 2, 3]] - x[[0, 2, 3]].amax(1, keepdim=True)).exp()
    assert torch.equal(on_sim[[0, 2, 3]], e / warp_sum(e))
    assert torch.ops.aten._safe_softmax(x.bfloat16().to(gpu_numerics), -1, dtype=torch.float32).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_embeddings_rows_are_summed_per_index_in_chunks_of_ten_as_cuda_sums_them(gpu_numerics, dtype):
    import torch.nn.functional as F  # noqa: N812

    generator = torch.Generator().manual_seed(8)
    ids = torch.randint(0, 20, (3, 40), generator=generator)
    ids[1, :35] = 4  # 35 rows of one index: chunks of 10, 10, 10, 5
    upstream = torch.randn(3, 40, 16, generator=generator).to(dtype)
    weight = torch.randn(20, 16, generator=generator).to(dtype).to(gpu_numerics).requires_grad_()
    F.embedding(ids.to(gpu_numerics), weight, padding_idx=2).backward(upstream.to(gpu_numerics))
    flat, rows = ids.reshape(-1), upstream.reshape(-1, 16).float()
    expected = torch.zeros(20, 16)
    for index in flat.unique().tolist():
        mine = rows[flat == index]  # in position order, as a stable sort keeps them
        chunks = [in_order(mine[start:start + 10]) for start in range(0, len(mine), 10)]
        total = chunks[0]
        for chunk in chunks[1:]:
            total = total + chunk
        expected[index] = total
    expected[2] = 0  # padding_idx: no gradient
    assert torch.equal(weight.grad.cpu(), expected.to(dtype))
    if dtype == torch.float32:  # the CPU adds each row into its index's in one pass: another order
        cpu = torch.zeros(20, 16).index_add_(0, flat, rows)
        cpu[2] = 0
        assert not torch.equal(weight.grad.cpu(), cpu)


def test_accumulating_index_put_and_the_cpus_narrow_sums_run_in_float32_rounded_once(gpu_numerics):
    # What the CPU adds (or multiplies) in bfloat16 itself and CUDA in float32: an accumulating index_put (x[ids]'s
    # gradient), prod and fold (col2im): here in float32, each result rounded once
    import torch.nn.functional as F  # noqa: N812

    generator = torch.Generator().manual_seed(3)
    base, values = torch.randn(4, 8, generator=generator), torch.randn(600, 8, generator=generator)
    ids = torch.randint(0, 4, (600,), generator=generator)
    factors, patches = 1 + 1e-2 * torch.randn(3, 600, generator=generator), torch.randn(1, 16, 49, generator=generator)
    cases = {  # each case's arguments on one device
        "index_put": lambda t, v: t.index_put((ids.to(t.device),), v, accumulate=True),
        "index_put_": lambda t, v: t.clone().index_put_((ids.to(t.device),), v, accumulate=True),
        "prod": lambda t, v: t.prod(1),
        "fold": lambda t, v: F.fold(t, (8, 8), 2),
    }
    inputs = {"index_put": (base, values), "index_put_": (base, values), "prod": (factors, factors),
              "fold": (patches, patches)}
    for name, op in cases.items():
        t, v = (x.bfloat16() for x in inputs[name])
        expected = op(t.float(), v.float()).bfloat16()
        on_sim = op(t.to(gpu_numerics), v.to(gpu_numerics)).cpu()
        assert on_sim.dtype == torch.bfloat16 and torch.equal(on_sim, expected), name
        assert not torch.equal(op(t, v), expected), name  # the CPU's own adds in bfloat16: another result
