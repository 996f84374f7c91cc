"""The statistics a run recording keeps of each tensor, against the same quantities computed directly in float64."""

import math

import pytest
import torch

from op_tools.numerics.tensor_stats import (
    _BLOCKS,
    STAT_FIELDS,
    SUMMARY_FIELDS,
    _fingerprint_weights,
    host_values,
    stats_to_host,
    summary,
)


def recorded(tensors):
    """``STAT_FIELDS`` of each tensor, as a recording computes them: the tensors of one call together."""
    return [dict(zip(STAT_FIELDS, host_values(t, v))) for t, v in zip(tensors, stats_to_host(tensors))]


def expected(t):
    x = (torch.view_as_real(t) if t.is_complex() else t).detach().cpu().reshape(-1).double()
    n = x.numel()
    blocks, rest = divmod(n, _BLOCKS)
    block_of = torch.cat([torch.arange(_BLOCKS).repeat_interleave(blocks), torch.arange(rest)])
    folded = torch.zeros(_BLOCKS, dtype=torch.float64).index_add_(0, block_of, x)
    signs = _fingerprint_weights(torch.device("cpu"), torch.float64)[1:]
    finite = x[x.isfinite()]
    return {"min": x.min().item(), "max": x.max().item(), "mean": x.mean().item(), "norm": x.norm().item(),
            "nan": int(x.isnan().sum()), "inf": int(x.isinf().sum()), "finite_max": finite.abs().max().item(),
            **{f"fp{j}": (signs[j] * folded).sum().item() / math.sqrt(n) for j in range(len(signs))}}


SIZES = [1, 7, _BLOCKS - 1, _BLOCKS, 3 * _BLOCKS + 5, 40_000]  # below, at and above one element per block


@pytest.mark.parametrize("device", ["cpu", "sim"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_statistics_match_a_float64_computation(device, dtype, request):
    if device == "sim":
        request.getfixturevalue("sim")
    tensors = [(torch.randn(n) * 3 + 1).to(dtype).to(device) for n in SIZES]
    tensors.append(torch.randn(6, 9).to(dtype).to(device).t())  # not contiguous
    for t, got in zip(tensors, recorded(tensors)):
        want = expected(t)
        scale = math.sqrt(t.numel()) * want["finite_max"]  # float32 accumulation's error bound, loosely
        for field in ("min", "max"):
            assert got[field] == want[field], (t.numel(), field)  # exact: a value of the tensor
        assert got["nan"] == got["inf"] == 0
        for field in ("mean", "norm", *(f"fp{j}" for j in range(16))):
            assert got[field] == pytest.approx(want[field], abs=1e-5 * scale), (t.numel(), field)


def test_integers_bools_and_complex_are_described_by_their_values():
    tensors = [torch.arange(-5, 2000), torch.tensor([True, False, True]), torch.randn(1500, dtype=torch.complex64)]
    for t, got in zip(tensors, recorded(tensors)):
        want = expected(t)
        assert (got["min"], got["max"]) == (want["min"], want["max"])
        assert got["mean"] == pytest.approx(want["mean"], rel=1e-5, abs=1e-6)
        assert got["fp3"] == pytest.approx(want["fp3"], rel=1e-4, abs=1e-4)


def test_nan_and_inf_are_counted():
    t = torch.randn(3000)
    t[[5, 17, 2999]] = float("nan")
    t[100] = float("inf")
    t[101] = -float("inf")
    got = recorded([t, torch.ones(4)])
    assert (got[0]["nan"], got[0]["inf"]) == (3, 2)
    assert (got[1]["nan"], got[1]["inf"], got[1]["mean"]) == (0, 0, 1.0)


def test_fingerprints_estimate_an_elementwise_relative_change():
    x = torch.randn(200_000)
    noisy = x * (1 + 1e-3 * torch.randn_like(x))
    a, b = recorded([x, noisy])
    rms = a["norm"] / math.sqrt(x.numel())
    change = math.sqrt(sum((a[f"fp{j}"] - b[f"fp{j}"]) ** 2 for j in range(16)) / 16) / rms
    assert 0.6e-3 < change < 1.4e-3  # the true elementwise relative change: 1e-3 (rms)
    assert abs(a["mean"] - b["mean"]) < 1e-5 and a["norm"] == pytest.approx(b["norm"], rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_summary_equals_torchs_own_statistics_computed_in_float64(dtype):
    x = (torch.randn(2, 64, 96, dtype=torch.float64) * 3 + 1).to(dtype)
    wide = x.double()
    expected = [wide.norm(), wide.mean(), wide.std(), wide.min(), wide.max()]
    got = summary(x)
    assert got.dtype == torch.float32 and got.shape == (len(SUMMARY_FIELDS),)
    assert got.tolist() == pytest.approx([e.item() for e in expected], rel=1e-5)


def test_summary_std_keeps_a_small_spread_under_a_large_mean_and_is_zero_for_one_element():
    x = (1e4 + torch.randn(100_000) * 1e-1).float()  # a sum-of-squares formula in float32 loses it all
    assert summary(x)[2].item() == pytest.approx(x.double().std().item(), rel=1e-3)
    assert summary(torch.tensor([5.0])).tolist() == [5.0, 5.0, 0.0, 5.0, 5.0]
