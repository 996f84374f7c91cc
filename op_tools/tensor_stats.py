"""Statistics of tensors, computed on their device: what a run recording keeps of each tensor instead of its data.

Per tensor, in ``STAT_FIELDS`` order: the minimum, maximum, mean and L2 norm of its values, its counts of nan and
inf, and 16 fingerprints (``sum(w[j, b] * x[i]) / sqrt(numel)`` over the elements ``i`` of block ``b``, the tensor
cut into 1021 blocks, with fixed pseudo-random signs ``w``). When every element moves by a relative ``r`` (noise,
rounding), the other statistics hardly move, while each fingerprint moves by about ``r * rms``, independently:
their root mean square change estimates the elementwise difference of two runs to about 18%.

Four passes over the tensor, each a reduction accumulating in float32 (float64 for float64 tensors), no copy of a
floating tensor, no matmul (TF32 would round the operands): ``aminmax``, ``sum``, ``vector_norm``, the block sums;
then 16 x 1021 products. The nan and inf counts are not computed on this path: when the minimum, maximum, mean and
norm read back are all finite there is none; otherwise ``nonfinite_counts`` counts them (a second transfer, for
tensors holding nan or inf only).

Where it runs: every step of ``tensor_stats`` on the tensor's device, asynchronously; ``stats_to_host`` stacks a
call's vectors into one tensor per device, so that a call costs one device-to-host transfer (one per device for a
call spanning devices, ``Tensor.to``).
"""

from __future__ import annotations

import math

import torch

FINGERPRINTS = 16
STAT_FIELDS = ("min", "max", "mean", "norm", "nan", "inf", *(f"fp{j}" for j in range(FINGERPRINTS)))
DEVICE_FIELDS = ("min", "max", "mean", "norm", *(f"fp{j}" for j in range(FINGERPRINTS)))  # tensor_stats' vector
_BLOCKS = 1021  # prime: a tensor's own periodic structure rarely lines up with the blocks'
_weights: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _fingerprint_weights(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    w = _weights.get((device, dtype))
    if w is None:
        generator = torch.Generator().manual_seed(_BLOCKS)  # private: the user's random stream is untouched
        signs = torch.randint(0, 2, (FINGERPRINTS, _BLOCKS), generator=generator).to(dtype) * 2 - 1
        w = _weights[(device, dtype)] = signs.to(device)
    return w


def _flat(t: torch.Tensor) -> torch.Tensor:
    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    if not x.is_floating_point():  # integers and bools: converted (float32 cannot hold every int64 exactly)
        x = x.to(torch.float32)
    return x.reshape(-1)


def tensor_stats(t: torch.Tensor) -> torch.Tensor:
    """The ``DEVICE_FIELDS`` of a non-empty tensor, as a 1-D tensor on its device (float32, or float64)."""
    x = _flat(t)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    n = x.numel()
    low, high = torch.aminmax(x)
    blocks, rest = divmod(n, _BLOCKS)
    folded = torch.nn.functional.pad(x[blocks * _BLOCKS:].to(acc), (0, _BLOCKS - rest))
    if blocks:
        folded = folded + x[: blocks * _BLOCKS].view(_BLOCKS, blocks).sum(1, dtype=acc)
    fingerprints = (_fingerprint_weights(x.device, acc) * folded).sum(1) / math.sqrt(n)
    head = torch.stack([low.to(acc), high.to(acc), x.sum(dtype=acc) / n, torch.linalg.vector_norm(x, dtype=acc)])
    return torch.cat([head, fingerprints])


def nonfinite_counts(t: torch.Tensor) -> tuple[int, int]:
    """``(nan count, inf count)`` of a tensor (one transfer)."""
    x = _flat(t)
    return tuple(int(v) for v in torch.stack([torch.isnan(x).sum(), torch.isinf(x).sum()]).tolist())


def with_counts(t: torch.Tensor, values: list[float]) -> list[float]:
    """``tensor_stats`` values read back, in ``STAT_FIELDS`` order: the nan and inf counts inserted (0 and 0 when
    the values are finite, else counted on ``t``)."""
    nan = inf = 0
    if not all(math.isfinite(v) for v in values[:4]):
        nan, inf = nonfinite_counts(t)
    return [*values[:4], nan, inf, *values[4:]]


def stats_to_host(vectors: list[torch.Tensor]) -> list[list[float]]:
    """``vectors`` (from ``tensor_stats``) as lists of floats, in order: one stack and one transfer per device."""
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(vectors):
        by_device.setdefault(v.device, []).append(i)
    out: list[list[float]] = [[] for _ in vectors]
    for indices in by_device.values():
        rows = [vectors[i] for i in indices]
        if any(r.dtype == torch.float64 for r in rows):
            rows = [r.to(torch.float64) for r in rows]
        for i, values in zip(indices, torch.stack(rows).tolist()):
            out[i] = values
    return out
