"""Statistics of tensors, computed on their device: what a run recording keeps of each tensor instead of its data.

Per tensor, in ``STAT_FIELDS`` order: the minimum, maximum, mean and L2 norm of its values, its counts of nan and
inf, and 16 fingerprints (``sum(w[j, b] * x[i]) / sqrt(numel)`` over the elements ``i`` of block ``b``, with fixed
pseudo-random signs ``w``; the tensor is cut into 1021 runs of consecutive elements, the ``r`` elements left over
going to blocks ``0..r-1``). When every element moves by a relative ``r`` (noise, rounding), the other statistics
hardly move, while each fingerprint moves by about ``r * rms``, independently: their root mean square change
estimates the elementwise difference of two runs to about 18%.

Three passes over the tensor, each a reduction accumulating in float32 (float64 for float64 tensors), no copy of a
contiguous floating tensor, no matmul (TF32 would round the operands): ``aminmax``, the block sums, the norm; then
17 x 1021 products, whose first row (all ones) gives the sum. The tensors of a call together (``calls_stats``):
per tensor its block sums and ``aminmax``, per device one ``_foreach_norm`` for all their norms, one product of all
their block sums with the weights and one ``cat``: on a fast device or sim each launch costs
microseconds of host work whatever its size, and most tensors of a step are small. The divisions by ``numel`` and
``sqrt(numel)`` are left to the host (``host_values``). The nan and inf counts are not computed on this path: when
the minimum, maximum, sum and norm read back are all finite there is none; otherwise ``nonfinite_counts`` counts them
(a second transfer, for tensors holding nan or inf only).

Where it runs: ``calls_stats`` on the tensors' device, asynchronously, one tensor per device, which the run recording
hands to a ``DeviceReadback`` (copied to the host in batches of calls, without a synchronisation); ``stats_to_host``
reads them at once (one transfer per device).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from .device_readback import Reduced

FINGERPRINTS = 16
STAT_FIELDS = ("min", "max", "mean", "norm", "nan", "inf", *(f"fp{j}" for j in range(FINGERPRINTS)))
STATS_WIDTH = 3 + 1 + FINGERPRINTS  # values per tensor read back: min, max, norm, sum, fingerprints
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
    return _values(t).reshape(-1)


def _values(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a real floating tensor of any shape, without a copy where ``t`` is one already."""
    x = t  # not detached: callers run under no_grad (a detach is one more op, ~30 us on sim)
    if x.is_complex():
        x = torch.view_as_real(x)
    if not x.is_floating_point():  # integers and bools: converted (float32 cannot hold every int64 exactly)
        x = x.to(torch.float32)
    return x


def _accumulation(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _folded(x: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``(_BLOCKS,)`` block sums of ``x``'s values in their flat order, in ``acc``: consecutive runs, the ``r``
    elements left over added to blocks ``0..r-1``; a tensor of fewer elements than blocks is its own values, padded
    with zeros. A contiguous ``x`` is read through ``as_strided`` views of its memory, one launch-free op each, where
    flattening and slicing it costs three (each op is microseconds of host work on a fast device, and on sim)."""
    n = x.numel()
    blocks, rest = divmod(n, _BLOCKS)
    if not blocks:
        return torch.nn.functional.pad(x.reshape(-1).to(acc), (0, _BLOCKS - n))  # zeros: nothing added to the sums
    if x.is_contiguous() and not x.is_neg():
        start = x.storage_offset()
        whole = x.as_strided((_BLOCKS, blocks), (blocks, 1))  # the same memory and kernel as the flat rows' view
        tail = x.as_strided((rest,), (1,), start + blocks * _BLOCKS) if rest else None
    else:
        flat = x.reshape(-1)
        whole = flat[: blocks * _BLOCKS].view(_BLOCKS, blocks)
        tail = flat[blocks * _BLOCKS:] if rest else None
    folded = whole.sum(1, dtype=acc)  # contiguous rows: the fast sum
    if tail is not None:
        folded[:rest].add_(tail)  # a fresh tensor of ours; not ``+=``, whose store back is a copy
    return folded


_no_foreach_norm: set[tuple[str, torch.dtype | None]] = set()  # (device type, dtype) where _foreach_norm fails


def foreach_norms(xs: list[torch.Tensor], order: float = 2, dtype: torch.dtype | None = None,
                  one=None) -> list[torch.Tensor]:
    """The ``order``-norm of each tensor (accumulated in ``dtype``), on its device: one fused ``_foreach_norm`` where
    the backend has it (remembered per device type where it has not), else ``one(x)`` per tensor (by default
    ``vector_norm``)."""
    key = (xs[0].device.type, dtype)
    if key not in _no_foreach_norm:
        try:
            return list(torch._foreach_norm(xs, order, dtype=dtype))
        except (RuntimeError, NotImplementedError, TypeError):  # no foreach kernel, or a torch without ``dtype``
            _no_foreach_norm.add(key)
    return [one(x) if one is not None else torch.linalg.vector_norm(x, order, dtype=dtype) for x in xs]


def calls_stats(tensors: list[torch.Tensor], deferred: bool = False) -> list[tuple[list[int], list]]:
    """The statistics of non-empty tensors, on their devices, per device (and accumulation dtype): ``(indices of the
    tensors, two 1-D tensors)`` each, which ``split_stats`` takes apart once read back one after the other: ``(min,
    max, norm)`` of every tensor, then the sum and the 16 fingerprints of each before their division by
    ``sqrt(numel)`` (accumulated in float32, or float64 for float64 tensors). Per tensor its block sums and
    ``aminmax``; per group one ``_foreach_norm``, one product with the fingerprint weights for all the block sums and
    one ``stack``: a run recording's calls have a few tensors each, and on a fast device or sim each launch, and each
    call into torch, not its arithmetic, is the cost. ``deferred``: the block sums are left as
    ``device_readback.Reduced`` rows, which ``DeviceReadback`` joins and multiplies by the weights for all the calls
    of a read-back batch at once (the same numbers, row by row). The minima, maxima and norms are stacked per call
    even then: left as 0-d tensors until the batch is sent, they would be three objects a tensor held across the
    garbage collector's young collections, promoted into its oldest generation (a real-size Llama step: 12k objects
    promoted instead of 18k, each costing ~2.3 us of full collections, against one launch a call). Call it under
    ``torch.no_grad()``."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    # not flattened (every reduction here takes any shape), but copied where not contiguous: the norm accumulates
    # in the flat order, as it always has, so that recordings of the same run compare equal across versions
    values = [x if x.is_contiguous() else x.reshape(-1) for x in map(_values, tensors)]
    for i, x in enumerate(values):
        groups.setdefault((x.device, _accumulation(x)), []).append(i)
    joined = []
    for (device, acc), indices in groups.items():
        xs = [values[i] for i in indices]
        folded = [_folded(x, acc) for x in xs]
        pieces = []
        for x, norm in zip(xs, foreach_norms(xs, 2, acc)):
            pieces += [*torch.aminmax(x), norm]  # 0-d each; min and max exact in any dtype: promoted by the stack
        sums = _reducer(device, acc)
        if deferred:
            joined.append((indices, [torch.stack(pieces), Reduced(folded, sums, 1 + FINGERPRINTS)]))
        else:
            stacked = folded[0].unsqueeze(0) if len(folded) == 1 else torch.stack(folded)  # (k, _BLOCKS)
            joined.append((indices, [torch.stack(pieces), sums(stacked).reshape(-1)]))
    return joined


_reducers: dict[tuple[torch.device, torch.dtype], Callable[[torch.Tensor], torch.Tensor]] = {}


def _reducer(device: torch.device, acc: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """``(k, _BLOCKS)`` block sums to ``(k, 1 + FINGERPRINTS)``: the sum and the fingerprints; one function per device
    and accumulation dtype, which ``DeviceReadback`` joins the rows of."""
    reducer = _reducers.get((device, acc))
    if reducer is None:
        weights = _fingerprint_weights(device, acc)

        def reducer(stacked: torch.Tensor) -> torch.Tensor:
            return (stacked.unsqueeze(1) * weights).sum(2, dtype=acc)

        _reducers[(device, acc)] = reducer
    return reducer


def host_values(t: torch.Tensor, values: list[float]) -> list[float]:
    """``t``'s statistics read back, as the ``STAT_FIELDS`` of ``t``."""
    return finished_values(t.numel() * (2 if t.is_complex() else 1), values, lambda: nonfinite_counts(t))


def finished_values(n: int, values: Sequence[float], counts) -> list[float]:
    """A tensor's statistics read back for a tensor of ``n`` real values, as its ``STAT_FIELDS``; ``counts()`` gives its
    ``(nan, inf)`` counts, asked only where a statistic is not finite."""
    low, high, norm, total, *fingerprints = values
    nan = inf = 0
    if not (math.isfinite(low) and math.isfinite(high) and math.isfinite(norm) and math.isfinite(total)):
        nan, inf = counts()
    scale = 1 / math.sqrt(n)
    return [low, high, total / n, norm, nan, inf, *[f * scale for f in fingerprints]]


def nonfinite_counts(t: torch.Tensor) -> tuple[int, int]:
    """``(nan count, inf count)`` of a tensor (one transfer)."""
    x = _flat(t)
    nan, inf = (int(v) for v in torch.stack([torch.isnan(x).sum(), torch.isinf(x).sum()]).tolist())
    return nan, inf


def split_stats(count: int, values: list[float]) -> list[list[float]]:
    """One group of ``calls_stats`` read back, for its ``count`` tensors: ``min, max, norm, sum, *fingerprints``
    each."""
    width = (len(values) - 3 * count) // count if count else 0
    return [[*values[3 * k: 3 * k + 3], *values[3 * count + k * width: 3 * count + (k + 1) * width]]
            for k in range(count)]


def stats_to_host(tensors: list[torch.Tensor]) -> list[list[float]]:
    """``calls_stats`` of non-empty tensors read at once, as lists of floats (``min, max, norm, sum,
    *fingerprints``) in order: one transfer per group (a synchronisation: ``DeviceReadback`` reads them without)."""
    out: list[list[float]] = [[] for _ in tensors]
    with torch.no_grad():
        for indices, parts in calls_stats(tensors):
            for i, values in zip(indices, split_stats(len(indices), torch.cat(parts).tolist())):
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
