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


def test_a_conjugate_view_is_described_by_its_values():
    # ifft's result is a conjugate view (its imaginary parts the negatives of the memory's): view_as_real refused it
    # and the call went unrecorded, on a device and on sim
    signal = torch.randn(1500)
    view = torch.fft.ifft(signal)
    assert view.is_conj()
    got, want = recorded([view])[0], expected(view.resolve_conj())
    assert (got["min"], got["max"]) == (want["min"], want["max"])
    assert got["fp3"] == pytest.approx(want["fp3"], rel=1e-4, abs=1e-4)
    assert got == recorded([view.resolve_conj()])[0]


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


def _block_sums_one_by_one(x, acc):
    """What the recording computed for each tensor alone before its calls' tails were joined: the sums of the runs,
    the tail added to the first blocks (a small tensor: its values padded with zeros), then the weights' product."""
    flat = (x.double() if acc == torch.float64 else x).reshape(-1)
    blocks, rest = divmod(flat.numel(), _BLOCKS)
    if not blocks:
        folded = torch.nn.functional.pad(flat.to(acc), (0, _BLOCKS - flat.numel()))
    else:
        folded = flat[: blocks * _BLOCKS].view(_BLOCKS, blocks).sum(1, dtype=acc)
        if rest:
            folded[:rest].add_(flat[blocks * _BLOCKS:])
    return (folded.unsqueeze(0) * _fingerprint_weights(x.device, acc)).sum(1, dtype=acc)


@pytest.mark.parametrize("device", ["cpu", "sim"])
def test_the_block_sums_of_a_call_are_each_tensors_own_to_the_bit_signed_zeros_included(device, request):
    # The elements left over from the blocks are joined per call and added to their rows for a whole read-back batch
    # at once: each block sum must be the one adding the tail to its row alone gave, bit for bit (a recording of the
    # same run must read the same across versions). Every size around the blocks, half and double tensors, zeros of
    # both signs (the padding is -0.0, which adds nothing to any number).
    from op_tools.numerics.device_readback import DeviceReadback
    from op_tools.numerics.tensor_stats import calls_stats, split_stats

    place = request.getfixturevalue("sim") if device == "sim" else "cpu"
    generator = torch.Generator().manual_seed(5)
    calls = []
    for n in (5, _BLOCKS - 1, _BLOCKS, _BLOCKS + 1, 2 * _BLOCKS, 3000, 70_000):
        mixed = torch.randn(n, generator=generator)
        mixed[::3] = -0.0
        mixed[1::5] = 0.0
        calls.append([torch.full((n,), -0.0), mixed.to(torch.bfloat16), torch.randn(n, generator=generator) * 3,
                      torch.randn(n, generator=generator, dtype=torch.float64), torch.zeros(n)])
    calls = [[t.to(place) for t in tensors] for tensors in calls]
    readback = DeviceReadback(batch=4)
    with torch.no_grad():
        for k, tensors in enumerate(calls):
            readback.put([part for _, parts in calls_stats(tensors, deferred=True) for part in parts], token=k)
        read = dict(readback.drain())
    for k, tensors in enumerate(calls):
        got, start = [None] * len(tensors), 0
        for indices, parts in calls_stats(tensors):
            size = sum(p.numel() for p in parts)
            for i, values in zip(indices, split_stats(len(indices), read[k][start:start + size])):
                got[i] = values
            start += size
        for t, values in zip(tensors, got):
            want = _block_sums_one_by_one(t, torch.float64 if t.dtype == torch.float64 else torch.float32).tolist()
            signs = [math.copysign(1, v) for v in values[3:]]
            assert values[3:] == want and signs == [math.copysign(1, v) for v in want], (t.dtype, t.numel())
