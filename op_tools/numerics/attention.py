"""``scaled_dot_product_attention`` taken apart: its arguments by name, its math path with PyTorch's mask semantics, and
the dropout mask of a call that drew one, replayed so the call can be compared.

A call with ``dropout_p > 0`` draws its mask on the device. When the device took PyTorch's math path
(``_fused_sdp_choice`` says MATH: sim, the CPU, any device without a fused kernel for the call), rerunning that path
from the generator state the call started from draws the same mask; the generator is then put back where the call
left it, so the run's random stream is untouched. The reference then applies that mask (``with_dropout_mask``). A
fused kernel (flash, memory-efficient) draws its mask inside the kernel in its own order: not replayed, the call
stays skipped as random.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

MATH = 0  # torch.nn.attention.SDPBackend.MATH, as _fused_sdp_choice returns it
_POSITIONAL = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
_KEYWORD_ONLY = ("scale", "enable_gqa")


def attention_arguments(args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by name, defaults filled in (``scaled_dot_product_attention``'s signature)."""
    bound: dict[str, Any] = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
                             "enable_gqa": False}
    bound.update(zip(_POSITIONAL, args))
    bound.update((k, v) for k, v in kwargs.items() if k in _POSITIONAL or k in _KEYWORD_ONLY)
    return bound


def additive_mask(mask, dtype: torch.dtype):
    """A boolean mask as attention.cpp converts it before the math path (True takes part: 0; False: -inf); the math op
    itself would add the booleans as 0 and 1."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, torch.zeros((), dtype=dtype, device=mask.device), float("-inf"))


def _gqa(enable_gqa: bool) -> dict:
    """The math path's ``enable_gqa`` where set: torch before 2.5 has no such argument (nor grouped queries)."""
    return {"enable_gqa": True} if enable_gqa else {}


def attention_math(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                   enable_gqa=False):
    """``scaled_dot_product_attention`` on PyTorch's math path, whatever fused kernel the device has: the output."""
    return torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, additive_mask(attn_mask, query.dtype), dropout_p, is_causal, None, scale=scale,
        **_gqa(enable_gqa))[0]


def replayed_dropout_mask(args: tuple, kwargs: dict, result: torch.Tensor, rng: tuple[Callable, Callable],
                          state_before: torch.Tensor) -> torch.Tensor | None:
    """The dropout mask the call drew (True: kept), on the host; None when the device did not take the math path.

    ``rng`` is ``(get_state, set_state)`` of the device's generator and ``state_before`` its state before the call;
    ``result`` the call's output, whose dtype the replay computes in (autocast casts the inputs the same way)."""
    a = attention_arguments(args, kwargs)
    query, key, value, mask = a["query"], a["key"], a["value"], a["attn_mask"]
    options = {"scale": a["scale"], **_gqa(a["enable_gqa"])}
    dtype = result.dtype
    query, key, value, mask = (t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                               for t in (query, key, value, mask))
    if not 0 < float(a["dropout_p"]) < 1:
        return None
    get_state, set_state = rng
    with torch.no_grad():
        try:
            if int(torch._fused_sdp_choice(query, key, value, mask, a["dropout_p"], a["is_causal"], **options)) != MATH:
                return None
        except (RuntimeError, NotImplementedError):  # no choice registered for the device: no known path
            return None
        state_after = get_state()
        try:
            set_state(state_before)
            _, weights = torch.ops.aten._scaled_dot_product_attention_math(
                query, key, value, additive_mask(mask, dtype), a["dropout_p"], a["is_causal"], None, **options)
        finally:
            set_state(state_after)
    return (weights != 0).cpu()


def with_dropout_mask(keep: torch.Tensor) -> Callable:
    """``scaled_dot_product_attention`` with the dropout mask ``keep`` instead of a draw: the reference of a call whose
    mask was replayed (PyTorch's own ``dropout_mask`` argument warns that it is for tests; the same product here)."""

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                  enable_gqa=False):
        _, weights = torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, additive_mask(attn_mask, query.dtype), 0.0, is_causal, None, scale=scale,
            **_gqa(enable_gqa))
        if value.dim() >= 3 and value.size(-3) != weights.size(-3):  # grouped-query attention: heads share a value
            value = value.repeat_interleave(weights.size(-3) // value.size(-3), dim=-3)
        kept = weights.masked_fill(~keep.to(weights.device), 0)
        return (kept / (1 - float(dropout_p))) @ value

    return attention
