"""The batch-norm statistics kernels ``nn.SyncBatchNorm`` runs, as a device computes them.

``torch.nn.modules._functions.SyncBatchNorm`` splits batch norm into kernels a device has and the CPU lacks: each
rank's ``batch_norm_stats``, ``batch_norm_gather_stats_with_counts`` over what the ranks all-gathered,
``batch_norm_elemt``, and in backward ``batch_norm_backward_reduce`` then (after an all-reduce of its sums)
``batch_norm_backward_elemt``. These compute what aten/src/ATen/native/cuda/Normalization.cu(h) computes, with
torch ops on the host, vectorised over channels:

- statistics in the accumulate type (float32 for float16/bfloat16 inputs), returned in it; the variance biased,
  ``invstd = 1 / sqrt(var + eps)`` (0 where both are 0);
- the gather merges the ranks' ``(mean, invstd, count)`` rows weighted by their counts and updates the running
  statistics in place (their schema does not say so, CUDA's kernel writes them): ``running = (1 - momentum) *
  running + momentum * batch``, the variance unbiased over the total count;
- results keep a channels-last input's layout; ``batch_norm_backward_elemt`` divides by the sum of its int32
  ``count`` (every rank's element count per channel).

``batch_norm_update_stats`` has a CPU kernel, but it returns float16 statistics for a float16 input where CUDA's
returns float32: sim's returns what CUDA's does.
"""

from __future__ import annotations

import math

import torch

from .kernels import accumulate_dtype, device_kernel


def _per_channel(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A ``(C,)`` tensor shaped to broadcast along ``like``'s dimension 1."""
    return t.reshape(1, -1, *([1] * (like.dim() - 2)))


def _reduced_dims(t: torch.Tensor) -> list[int]:
    return [0, *range(2, t.dim())]


def _mean_var(input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each channel's mean and biased variance, in the accumulate type."""
    acc = accumulate_dtype(input.dtype)
    if input.numel() == 0:  # CUDA's Welford starts at 0 and divides 0 by 0 for the variance only
        mean = torch.zeros(input.size(1), dtype=acc, device=input.device)
        return mean, torch.full_like(mean, math.nan)
    var, mean = torch.var_mean(input.to(acc), _reduced_dims(input), correction=0)
    return mean, var


def _memory_format(t: torch.Tensor) -> torch.memory_format:
    """``suggest_memory_format()``: channels-last for a 4-d or 5-d tensor laid out so, else contiguous."""
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if t.dim() == 5 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


def _check_input(op: str, input: torch.Tensor) -> None:
    if input.dim() < 2:
        raise RuntimeError(f"{op}: expected an input of at least 2 dimensions (batch, channels, ...), "
                           f"got {tuple(input.shape)}")


def _expect_dtype(op: str, name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    # CUDA's kernel reads the tensor through an accessor of that type, which refuses another
    if t.dtype != dtype:
        raise RuntimeError(f"{op}: expected {name} to have dtype {dtype}, got {t.dtype}")


def _same_stat_dtypes(mean: torch.Tensor, invstd: torch.Tensor) -> None:
    if mean.dtype != invstd.dtype:
        raise RuntimeError("mean and invstd need to have the same data types")  # CUDA's words


def _update_running(running: torch.Tensor | None, batch: torch.Tensor, momentum: torch.Tensor) -> None:
    """``running = (1 - momentum) * running + momentum * batch`` in ``batch``'s (the accumulate) type, in place."""
    if running is not None:
        running.copy_((1 - momentum) * running.to(batch.dtype) + momentum * batch)


@device_kernel("batch_norm_stats")
def batch_norm_stats(input, eps):
    """``(mean, invstd)`` per channel, in the accumulate type; the variance biased."""
    _check_input("batch_norm_stats", input)
    mean, var = _mean_var(input)
    invstd = (var + eps).rsqrt()
    if eps == 0:
        invstd = invstd.masked_fill(var == 0, 0)
    return mean, invstd


@device_kernel("batch_norm_gather_stats_with_counts")
def batch_norm_gather_stats_with_counts(input, mean, invstd, running_mean, running_var, momentum, eps, counts):
    """The global ``(mean, invstd)`` of the ranks' rows ``mean``, ``invstd`` (``(world, C)``) and ``counts``
    (``(world,)``, in the running statistics' dtype); the running statistics updated in place."""
    op = "batch_norm_gather_stats_with_counts"
    stat_dtype = running_mean.dtype if running_mean is not None else input.dtype
    acc = accumulate_dtype(stat_dtype)
    for name, t, dtype in (("mean", mean, acc), ("invstd", invstd, acc), ("counts", counts, stat_dtype)):
        _expect_dtype(op, name, t, dtype)
    n = counts.to(acc).reshape(-1, 1)
    total = n.sum(0)
    # CUDA merges the rows one by one (Welford's parallel step); this is its closed form
    global_mean = (n * mean).sum(0) / total.clamp_min(1)  # no rows: CUDA's running mean stays 0
    var_n = (n * ((1 / invstd).square() - eps)).sum(0) + (n * (mean - global_mean).square()).sum(0)
    global_invstd = (var_n / total + eps).rsqrt()
    momentum = torch.tensor(momentum, dtype=acc, device=mean.device)
    _update_running(running_mean, global_mean, momentum)
    _update_running(running_var, var_n / (total - 1), momentum)
    return global_mean, global_invstd


@device_kernel("batch_norm_gather_stats")
def batch_norm_gather_stats(input, mean, invstd, running_mean, running_var, momentum, eps, count):
    """``batch_norm_gather_stats_with_counts`` with every rank's count ``count``."""
    dtype = running_mean.dtype if running_mean is not None else input.dtype
    counts = torch.full((mean.size(0),), count, dtype=dtype, device=mean.device)
    return batch_norm_gather_stats_with_counts(input, mean, invstd, running_mean, running_var, momentum, eps, counts)


@device_kernel("batch_norm_elemt")
def batch_norm_elemt(input, weight, bias, mean, invstd, eps):
    """``weight * (input - mean) * invstd + bias`` in the accumulate type; ``eps`` unused, as on CUDA."""
    _check_input("batch_norm_elemt", input)
    acc = accumulate_dtype(input.dtype)
    out = input.to(acc) - _per_channel(mean.to(acc), input)
    if weight is not None:  # CUDA's order: gamma * (x - mean) * invstd + beta
        out = _per_channel(weight.to(acc), input) * out
    out = out * _per_channel(invstd.to(acc), input)
    if bias is not None:
        out = out + _per_channel(bias.to(acc), input)
    return out.to(input.dtype).contiguous(memory_format=_memory_format(input))


@device_kernel("batch_norm_backward_reduce")
def batch_norm_backward_reduce(grad_out, input, mean, invstd, weight, input_g, weight_g, bias_g):
    """``(sum_dy, sum_dy_xmu, grad_weight, grad_bias)`` of this rank's elements; each None unless asked for (the
    sums by ``input_g``)."""
    _check_input("batch_norm_backward_reduce", input)
    _same_stat_dtypes(mean, invstd)
    acc, dims = accumulate_dtype(input.dtype), _reduced_dims(input)
    dy = grad_out.to(acc)
    sum_dy = dy.sum(dims)
    sum_dy_xmu = (dy * (input.to(acc) - _per_channel(mean.to(acc), input))).sum(dims)
    weight_dtype = weight.dtype if weight is not None else mean.dtype
    grad_weight = (sum_dy_xmu * invstd.to(acc)).to(weight_dtype) if weight_g else None
    grad_bias = sum_dy.to(weight_dtype) if bias_g else None
    if not input_g:
        return None, None, grad_weight, grad_bias
    return sum_dy.to(mean.dtype), sum_dy_xmu.to(mean.dtype), grad_weight, grad_bias


@device_kernel("batch_norm_backward_elemt")
def batch_norm_backward_elemt(grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    """The input's gradient from the all-reduced sums; ``count`` (int32) holds each rank's elements per channel."""
    _check_input("batch_norm_backward_elemt", input)
    _same_stat_dtypes(mean, invstd)
    _expect_dtype("batch_norm_backward_elemt", "count", count, torch.int32)
    acc = accumulate_dtype(input.dtype)
    total = count.sum()

    def channel(t):
        return _per_channel(t.to(acc), input)

    invstd_c = channel(invstd)
    mean_dy = channel(sum_dy) / total
    projection = invstd_c * invstd_c * channel(sum_dy_xmu) / total
    scale = channel(weight) * invstd_c if weight is not None else invstd_c
    grad_in = (grad_out.to(acc) - mean_dy - (input.to(acc) - channel(mean)) * projection) * scale
    layout = _memory_format(input) if _memory_format(grad_out) != torch.contiguous_format else torch.contiguous_format
    return grad_in.to(input.dtype).contiguous(memory_format=layout)


@device_kernel("batch_norm_update_stats")
def batch_norm_update_stats(input, running_mean, running_var, momentum):
    """``(mean, var)`` per channel in the accumulate type, the variance biased; the running statistics updated in
    place with the unbiased variance."""
    _check_input("batch_norm_update_stats", input)
    if (running_mean is None) != (running_var is None):
        raise RuntimeError("batch_norm_update_stats: expected both running_mean and running_var, or neither")
    mean, var = _mean_var(input)
    if running_mean is not None:
        n = input.numel() // input.size(1)
        bessel = n / (n - 1) if n != 1 else math.inf  # CUDA divides in double: one element gives inf
        momentum_acc = torch.tensor(momentum, dtype=accumulate_dtype(running_mean.dtype), device=mean.device)
        _update_running(running_mean, mean.to(momentum_acc.dtype), momentum_acc)
        _update_running(running_var, (var * bessel).to(momentum_acc.dtype), momentum_acc)
    return mean, var
