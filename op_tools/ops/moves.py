"""A tensor moved to another device or dtype, differentiably, its gradient handed back as it comes: OpFallback's CPU
copies and their results, OpDtypeCast's widened tensors where a gradient may be sparse."""

from __future__ import annotations

import torch

try:  # what Function.apply does first outside functorch's transforms
    from torch._functorch.utils import unwrap_dead_wrappers
except ImportError:  # a torch without it has no dead wrappers to unwrap
    def unwrap_dead_wrappers(args: tuple) -> tuple:
        return args


class Moved(torch.autograd.Function):
    """``t.to(device, dtype)``, whose backward hands the gradient back in ``t``'s device and dtype and in the
    gradient's own layout and strides (``keeping_strides``). ``Tensor.to``'s backward converts it to ``t``'s layout
    as well, which PyTorch refuses for a sparse gradient: an ``Embedding(sparse=True)`` run on the CPU failed the
    user's ``backward()``. Written with ``setup_context`` and a generated vmap rule, so that calls inside
    ``torch.func`` transforms (``vmap``, ``grad``) run through it as well."""

    generate_vmap_rule = True

    @classmethod
    def apply(cls, *args, **kwargs):
        # ``Function.apply`` binds the arguments to ``forward``'s signature (``inspect.signature``: tens of µs, twice
        # for each call OpFallback runs) wherever ``setup_context`` is defined, to fill in defaults, which ``forward``
        # has none of; outside functorch's transforms it then calls the C++ apply, as here.
        if kwargs or torch._C._are_functorch_transforms_active():
            return super().apply(*args, **kwargs)
        return super(torch.autograd.Function, cls).apply(*unwrap_dead_wrappers(args))

    @staticmethod
    def forward(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        return t.to(device=device, dtype=dtype, copy=True)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
        ctx.back = (inputs[0].device, inputs[0].dtype)
        ctx.forward = (inputs[1], inputs[2])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        device, dtype = ctx.back
        return keeping_strides(grad, device, dtype), None, None

    @staticmethod
    def jvp(ctx, tangent: torch.Tensor, *_):  # forward AD through it as through ``Tensor.to``
        return tangent.to(device=ctx.forward[0], dtype=ctx.forward[1])


def keeping_strides(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(device, dtype)`` with ``t``'s strides, stride 0 included: ``Tensor.to`` keeps those of a dense tensor
    but makes an expanded one (``sum()``'s gradient) contiguous, and a backward kernel given the contiguous gradient
    rounds otherwise than the one the device's (or a CPU run's) backward is given. The expanded dims move as one
    element each and are expanded again."""
    if t.layout != torch.strided or 0 not in t.stride():
        return t.to(device=device, dtype=dtype)
    one_each = [1 if stride == 0 else size for size, stride in zip(t.shape, t.stride())]
    once = t.as_strided(one_each, t.stride(), t.storage_offset()).to(device=device, dtype=dtype)
    return once.expand(t.shape)


def moved(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``t`` on ``device`` in ``dtype``, differentiable (``Moved``) where a gradient will flow."""
    if t.requires_grad and torch.is_grad_enabled():
        return Moved.apply(t, device, dtype)
    return t.to(device=device, dtype=dtype)
