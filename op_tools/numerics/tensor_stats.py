"""Statistics of tensors, computed on their device: what a run recording keeps of each tensor instead of its data.

Per tensor, in ``STAT_FIELDS`` order: the minimum, maximum, mean and L2 norm of its values, its counts of nan and
inf, and 16 fingerprints (``sum(w[j, b] * x[i]) / sqrt(numel)`` over the elements ``i`` of block ``b``, with fixed
pseudo-random signs ``w``; the tensor is cut into 1021 runs of consecutive elements, the ``r`` elements left over
going to blocks ``0..r-1``). When every element moves by a relative ``r`` (noise, rounding), the other statistics
hardly move, while each fingerprint moves by about ``r * rms``, independently: their root mean square change
estimates the elementwise difference of two runs to about 18%.

Three passes over the tensor, each a reduction accumulating in float32 (float64 for float64 tensors), no copy of a
contiguous floating tensor, no matmul (TF32 would round the operands): ``aminmax``, the block sums,
``vector_norm``; then 17 x 1021 products, whose first row (all ones) gives the sum. As few launches as that
allows, and the pieces of all the tensors of a call joined by one ``stack`` and one ``cat`` (``stats_to_host``):
on a host or sim each op costs microseconds of Python whatever its size, and most tensors of a step are small.
The divisions by ``numel`` and ``sqrt(numel)`` are left to the host (``host_values``). The nan and inf counts
are not computed on this path: when the minimum, maximum, sum and norm read back are all finite there is none;
otherwise ``nonfinite_counts`` counts them (a second transfer, for tensors holding nan or inf only).

Where it runs: every step of ``tensor_stats`` on the tensor's device, asynchronously; ``joined_stats`` joins a
call's pieces into one tensor per device, which the run recording hands to a ``DeviceReadback`` (copied to the host
in batches of calls, without a synchronisation); ``stats_to_host`` reads them at once (one transfer per device).
"""

from __future__ import annotations

import math

import torch

FINGERPRINTS = 16
STAT_FIELDS = ("min", "max", "mean", "norm", "nan", "inf", *(f"fp{j}" for j in range(FINGERPRINTS)))
_BLOCKS = 1021  # prime: a tensor's own periodic structure rarely lines up with the blocks'
_weights: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _fingerprint_weights(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``(1 + FINGERPRINTS, _BLOCKS)``: a row of ones (the sum), then the fixed random signs."""
    w = _weights.get((device, dtype))
    if w is None:
        generator = torch.Generator().manual_seed(_BLOCKS)  # private: the user's random stream is untouched
        signs = torch.randint(0, 2, (FINGERPRINTS, _BLOCKS), generator=generator).to(dtype) * 2 - 1
        w = _weights[(device, dtype)] = torch.cat([torch.ones(1, _BLOCKS, dtype=dtype), signs]).to(device)
    return w


def _flat(t: torch.Tensor) -> torch.Tensor:
    x = t  # not detached: callers run under no_grad (a detach is one more op, ~30 us on sim)
    if x.is_complex():
        x = torch.view_as_real(x)
    if not x.is_floating_point():  # integers and bools: converted (float32 cannot hold every int64 exactly)
        x = x.to(torch.float32)
    return x.reshape(-1)


def tensor_stats(t: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """A non-empty tensor's statistics, on its device: ``(min, max, norm)`` as 0-d tensors, and the sum and the 16
    fingerprints before their division by ``sqrt(numel)`` (accumulated in float32, or float64). Call it under
    ``torch.no_grad()``: with grad mode on it still computes the same values, and records a graph for nothing."""
    x = _flat(t)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    n = x.numel()
    blocks, rest = divmod(n, _BLOCKS)
    w = _fingerprint_weights(x.device, acc)
    if blocks:
        whole = x[: blocks * _BLOCKS] if rest else x
        folded = whole.view(_BLOCKS, blocks).sum(1, dtype=acc)  # contiguous rows: the fast sum
        if rest:
            folded[:rest] += x[blocks * _BLOCKS:]  # a fresh tensor of ours
    else:
        folded, w = x, w[:, :n]
    low, high = torch.aminmax(x)  # exact in any dtype: promoted to float32 when joined
    return (low, high, torch.linalg.vector_norm(x, dtype=acc)), (w * folded).sum(1, dtype=acc)


def host_values(t: torch.Tensor, values: list[float]) -> list[float]:
    """``tensor_stats(t)`` read back, as the ``STAT_FIELDS`` of ``t``."""
    return finished_values(t.numel() * (2 if t.is_complex() else 1), values, lambda: nonfinite_counts(t))


def finished_values(n: int, values: list[float], counts) -> list[float]:
    """``tensor_stats`` read back for a tensor of ``n`` real values, as its ``STAT_FIELDS``; ``counts()`` gives its
    ``(nan, inf)`` counts, asked only where a statistic is not finite."""
    low, high, norm, total, *fingerprints = values
    nan = inf = 0
    if not all(math.isfinite(v) for v in values[:4]):
        nan, inf = counts()
    scale = 1 / math.sqrt(n)
    return [low, high, total / n, norm, nan, inf, *(f * scale for f in fingerprints)]


def nonfinite_counts(t: torch.Tensor) -> tuple[int, int]:
    """``(nan count, inf count)`` of a tensor (one transfer)."""
    x = _flat(t)
    nan, inf = (int(v) for v in torch.stack([torch.isnan(x).sum(), torch.isinf(x).sum()]).tolist())
    return nan, inf


def joined_stats(pieces: list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]) \
        -> list[tuple[list[int], torch.Tensor]]:
    """``tensor_stats``' results joined per device, on the device: ``(indices of the pieces, one 1-D tensor)`` for
    each, one ``stack`` and one ``cat``; ``split_stats`` takes them apart once read back."""
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, sums) in enumerate(pieces):
        by_device.setdefault(sums.device, []).append(i)
    joined = []
    for indices in by_device.values():
        scalars = torch.stack([s for i in indices for s in pieces[i][0]])
        joined.append((indices, torch.cat([scalars, *(pieces[i][1] for i in indices)])))
    return joined


def split_stats(count: int, values: list[float]) -> list[list[float]]:
    """One device's ``joined_stats`` read back, for its ``count`` pieces: ``min, max, norm, sum, *fingerprints``
    each."""
    width = (len(values) - 3 * count) // count if count else 0
    return [[*values[3 * k: 3 * k + 3], *values[3 * count + k * width: 3 * count + (k + 1) * width]]
            for k in range(count)]


def stats_to_host(pieces: list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]) -> list[list[float]]:
    """``tensor_stats``' results as lists of floats (``min, max, norm, sum, *fingerprints``), in order: per device
    one ``stack``, one ``cat`` and one transfer (a synchronisation: ``DeviceReadback`` reads them without)."""
    out: list[list[float]] = [[] for _ in pieces]
    for indices, joined in joined_stats(pieces):
        for i, values in zip(indices, split_stats(len(indices), joined.tolist())):
            out[i] = values
    return out


SUMMARY_FIELDS = ("norm", "mean", "std", "min", "max")


def summary(t: torch.Tensor) -> torch.Tensor:
    """``SUMMARY_FIELDS`` of a non-empty tensor as one float32 vector on its device, no transfer: ``aminmax``, a sum
    and two norms, accumulating in float32 (float64 for float64). The standard deviation is the norm of the
    deviations from the mean (two passes: no cancellation when the mean dwarfs the spread; ``std_mean`` costs 50x
    more on a CPU). What the training monitor keeps of an activation or an output gradient; call it under
    ``torch.no_grad()``."""
    x = _flat(t)
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()
    n = x.numel()
    low, high = torch.aminmax(x)
    mean = x.sum() / n
    std = torch.linalg.vector_norm(x - mean) / math.sqrt(max(n - 1, 1))
    return torch.stack([torch.linalg.vector_norm(x), mean, std, low, high]).float()
