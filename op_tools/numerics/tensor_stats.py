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
per tensor its ``aminmax`` and block sums, per device one ``_foreach_norm`` for all their norms and one ``cat`` of
the elements left over from the blocks; then for a read-back batch of calls one product of all their block sums
with the weights: on a fast device or sim each launch costs microseconds of host work whatever its size, and most
tensors of a step are small. The divisions by ``numel`` and
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
    if x.is_complex():  # a conjugate view (ifft's result) resolved first: its real view is refused
        x = torch.view_as_real(x.resolve_conj())
    if not x.is_floating_point():  # integers and bools: converted (float32 cannot hold every int64 exactly)
        x = x.to(torch.float32)
    return x


def _accumulation(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _folded(x: torch.Tensor, acc: torch.dtype, pieces: list[torch.Tensor]) -> None:
    """Append to ``pieces`` ``x``'s block sums in its flat order, in ``acc``, as two ``(_BLOCKS,)`` rows to be added
    (``_reducer``): its ``r`` elements left over, which go to blocks ``0..r-1``, padded with ``-0.0`` (which adds
    nothing to any sum), then the sums of its consecutive runs. A tensor of fewer elements than blocks has its values
    padded with ``+0.0``, then a row of ``-0.0``: exactly its values padded with zeros. The pieces of a call are
    joined by one ``cat`` (a copy: its tensors may change before the batch is read back) and added for a whole
    read-back batch at once: one launch a call where adding each tail to its row took two a tensor (a slice and an
    add), and one tensor held a call where each tensor's row was one. A contiguous ``x`` is read through
    ``as_strided`` views of its memory, one launch-free op each, where flattening and slicing it costs three (each
    op is microseconds of host work on a fast device, and on sim)."""
    n = x.numel()
    blocks, rest = divmod(n, _BLOCKS)
    if not blocks:
        pieces += (x if x.dim() == 1 else x.reshape(-1), _filler(x.device, acc, _BLOCKS - n, 0.0),
                   _filler(x.device, acc, _BLOCKS, -0.0))
        return
    if x.is_contiguous() and not x.is_neg():
        whole = x.as_strided((_BLOCKS, blocks), (blocks, 1))  # the same memory and kernel as the flat rows' view
        if rest:
            pieces.append(x.as_strided((rest,), (1,), x.storage_offset() + blocks * _BLOCKS))
    else:
        flat = x.reshape(-1)
        whole = flat[: blocks * _BLOCKS].view(_BLOCKS, blocks)
        if rest:
            pieces.append(flat[blocks * _BLOCKS:])
    pieces += (_filler(x.device, acc, _BLOCKS - rest, -0.0), whole.sum(1, dtype=acc))  # contiguous rows: the fast sum


_fillers: dict[tuple[torch.device, torch.dtype, int, float], torch.Tensor] = {}


def _filler(device: torch.device, dtype: torch.dtype, n: int, value: float) -> torch.Tensor:
    """A ``(n,)`` tensor of ``value`` (``0.0`` or ``-0.0``), made once: at most two per length up to ``_BLOCKS``."""
    key = (device, dtype, n, math.copysign(1.0, value))
    t = _fillers.get(key)
    if t is None:
        t = _fillers[key] = torch.full((n,), value, dtype=dtype, device=device)
    return t


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
    tensors, two 1-D tensors)`` each, which ``split_stats`` takes apart once read back one after the other: the
    minimum and maximum of every tensor, then their norms; then the sum and the 16 fingerprints of each before their
    division by ``sqrt(numel)`` (accumulated in float32, or float64 for float64 tensors). Per tensor its ``aminmax`` and
    block sums; per group one ``_foreach_norm``, one ``cat`` of the block sums and the elements left over from the
    blocks, one product with the fingerprint weights for all the block sums and one ``stack``: a run recording's
    calls have a few tensors each, and on a fast device or sim each launch, and each call into torch, not its
    arithmetic, is the cost.
    ``deferred``: the block sums are left as a ``device_readback.Reduced``, which ``DeviceReadback`` joins and
    multiplies by the weights for all the calls of a read-back batch at once (the same numbers, row by row). The
    minima, maxima and norms are stacked per call even then: left as 0-d tensors until the batch is sent, they would
    be three objects a tensor held across the garbage collector's young collections, promoted into its oldest
    generation (a real-size Llama step: 12k objects promoted instead of 18k, each costing ~2.3 us of full
    collections, against one launch a call). Call it under
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
        extrema: list[torch.Tensor] = []
        pieces: list[torch.Tensor] = []
        for x in xs:  # two passes over a tensor in turn: the second reads it from the cache. ``aminmax`` first: bound
            # by its arithmetic, it pays little for reading memory, and the sum after it, bound by memory, pays less
            extrema += torch.aminmax(x)  # min and max exact in any dtype: promoted by the stack
            _folded(x, acc, pieces)
        extrema += foreach_norms(xs, 2, acc)  # each tensor's min and max, then the norms: ``split_stats`` reads so
        folded = torch.cat(pieces)  # promotes a half tail to ``acc`` exactly, as adding it to the row did
        sums = _reducer(device, acc)
        if deferred:
            joined.append((indices, [torch.stack(extrema), Reduced(folded, sums, 1 + FINGERPRINTS, len(xs))]))
        else:
            joined.append((indices, [torch.stack(extrema), sums([folded]).reshape(-1)]))
    return joined


_reducers: dict[tuple[torch.device, torch.dtype], Callable[[list[torch.Tensor]], torch.Tensor]] = {}


def _reducer(device: torch.device, acc: torch.dtype) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    """The block sums of calls (``_folded``'s pieces joined, ``(k, 2, _BLOCKS)`` each) to ``(k, 1 + FINGERPRINTS)``
    for their ``k`` tensors: the sum and the fingerprints; one function per device and accumulation dtype, which
    ``DeviceReadback`` hands the calls of a whole batch."""
    reducer = _reducers.get((device, acc))
    if reducer is None:
        weights = _fingerprint_weights(device, acc)

        def reducer(calls: list[torch.Tensor]) -> torch.Tensor:
            tails, rows = (torch.cat(calls) if len(calls) > 1 else calls[0]).view(-1, 2, _BLOCKS).unbind(1)
            return ((tails + rows).unsqueeze(1) * weights).sum(2, dtype=acc)  # each element as the tail's add gave

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
    return [[values[2 * k], values[2 * k + 1], values[2 * count + k],
             *values[3 * count + k * width: 3 * count + (k + 1) * width]] for k in range(count)]


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
