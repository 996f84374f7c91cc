"""A fused attention algorithm for sim: chunked online softmax, as flash-attention computes.

By default ``F.scaled_dot_product_attention`` on sim takes PyTorch's math path (softmax of the full
score matrix), the path any PrivateUse1 device without fused kernels gets. With the algorithm
``chunked`` (``DITORCH_SIM_SDPA=chunked[:<keys per block>]``, ``set_sdpa_algorithm`` or the
``sdpa_algorithm`` block) it takes the route PyTorch offers custom backends
(aten/src/ATen/native/transformers/attention.cpp): ``aten::_fused_sdp_choice`` answers
``SDPBackend.OVERRIDEABLE`` for the inputs the kernel supports (``MATH`` otherwise: dropout,
float64, not 4-d, an explicit mask with ``is_causal``), and the work is done by
``aten::_scaled_dot_product_fused_attention_overrideable`` and its ``_backward``, whose autograd
formula PyTorch provides.

PyTorch consults ``_fused_sdp_choice_stub``, a C++ DispatchStub that Python cannot register, so
sim registers a kernel for ``scaled_dot_product_attention`` on ``AutogradPrivateUse1`` that asks the
op ``_fused_sdp_choice`` and dispatches as attention.cpp does (and, while ``chunked`` is selected, a
host kernel for calls that reach the device under ``inference_mode``). With ``math`` selected and
plain tensors it runs PyTorch's own composite kernel, untouched.

DTensors (tensor parallel attention, as PyTorch's fsdp_tp_example writes it): on CUDA the flash
kernel has a sharding rule, while PyTorch's math path builds its causal mask as a plain tensor and
fails on DTensors. So on sim DTensor attention takes the fused op whichever algorithm is selected,
with a sharding rule registered through DTensor's public ``register_sharding`` (shard over heads or
batch, as flash's rule does); each rank's kernel then runs the selected algorithm on its shard:
``chunked``, or ``math``: the output as PyTorch's math op computes it, the gradients from the saved
logsumexp in one block of every key (float32), equal to the single-process math path within float32
rounding. (Recomputing the math op through autograd inside the backward kernel, reentrant, aborted the
process under FSDP2 with tensor parallel.)

The kernel (per batch and head, vectorised with torch ops on the host): keys in blocks; for each
block the scores ``q k^T * scale (+ bias)``, a running row maximum and sum, the output rescaled
as the maximum grows; it saves the logsumexp. Backward recomputes each block's probabilities from
the saved logsumexp (``p = exp(s - lse)``, ``ds = p * (dp - rowsum(dO * O))``). float16 and
bfloat16 inputs are computed in float32, with the probabilities and score gradients rounded to the
input dtype before the second matmul of each pair, as flash kernels feed their tensor cores.
Grouped-query attention (fewer key/value heads than query heads) is computed by sharing each
key/value head with its group of query heads. The numbers are correct to the dtype's rounding but
not bit-identical to the math path: another algorithm, as on a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import sys
import threading

import torch

from .kernels import KERNELS, device_kernel, overload

ENV_VAR = "DITORCH_SIM_SDPA"
FORM = "math, or chunked[:<keys per block>]"
ALGORITHMS = ("math", "chunked")
MATH = 0  # torch.nn.attention.SDPBackend.MATH
OVERRIDEABLE = 4  # SDPBackend.OVERRIDEABLE
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class SdpaAlgorithm:
    """Which attention algorithm sim runs; ``block_size`` keys per block for ``chunked``."""

    name: str = "math"
    block_size: int = 64

    def __post_init__(self) -> None:
        if self.name not in ALGORITHMS:
            raise ValueError(f"sim: unknown attention algorithm {self.name!r}; expected one of {', '.join(ALGORITHMS)}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"sim: block_size must be a positive integer, got {self.block_size!r}")


def parse_algorithm(text: str) -> SdpaAlgorithm:
    """``DITORCH_SIM_SDPA``'s value; a malformed one is a ValueError naming the variable."""
    name, sep, block = text.strip().partition(":")
    try:
        if sep and name != "chunked":
            raise ValueError
        return SdpaAlgorithm(name or "math", int(block) if sep else SdpaAlgorithm.block_size)
    except ValueError:
        raise ValueError(f"{ENV_VAR}={text!r}: expected {FORM}") from None


# ---- the kernel: chunked online softmax on host tensors --------------------------------------------


def _share_kv_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads repeated for their query-head groups: query head h reads kv head h // group."""
    group = heads // x.size(1)
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def _as_operand(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # A flash kernel feeds its second matmul with probabilities in the input dtype.
    return x.to(dtype).float() if dtype in _LOW_PRECISION else x


def _block_scores(q, k_block, bias, start: int, is_causal: bool, scale: float):
    scores = torch.matmul(q, k_block.transpose(-2, -1)).mul_(scale)
    end = start + k_block.size(-2)
    if bias is not None:
        scores.add_(bias[..., start:end])
    if is_causal:  # PyTorch's is_causal: query i sees keys 0..i (top-left aligned)
        rows = torch.arange(q.size(-2)).unsqueeze(-1)
        scores.masked_fill_(torch.arange(start, end) > rows, float("-inf"))
    return scores


def _prepare(query, key, value, attn_bias, scale):
    heads, seq_q, seq_k = query.size(1), query.size(2), key.size(2)
    acc = torch.float32
    q = query.to(acc)
    k = _share_kv_heads(key, heads).to(acc)
    v = _share_kv_heads(value, heads).to(acc)
    bias = None
    if attn_bias is not None:
        bias = torch.broadcast_to(attn_bias.to(acc), (query.size(0), heads, seq_q, seq_k))
    return q, k, v, bias, scale if scale is not None else 1.0 / math.sqrt(query.size(-1))


def chunked_attention(query, key, value, attn_bias=None, is_causal=False, scale=None, block_size=64):
    """``(output, logsumexp)`` of attention over (batch, heads, length, dim) host tensors."""
    dtype = query.dtype
    q, k, v, bias, scale = _prepare(query, key, value, attn_bias, scale)
    shape = q.shape[:-1]
    row_max = q.new_full(shape, float("-inf"))
    row_sum = q.new_zeros(shape)
    out = q.new_zeros((*shape, v.size(-1)))
    shift = row_max
    for start in range(0, k.size(-2), block_size):
        scores = _block_scores(q, k[..., start:start + block_size, :], bias, start, is_causal, scale)
        new_max = torch.maximum(row_max, scores.amax(-1))
        shift = torch.where(new_max == float("-inf"), 0.0, new_max)  # rows that saw no key yet
        probs = torch.exp(scores - shift.unsqueeze(-1))
        rescale = torch.exp(row_max - shift)
        row_sum = row_sum * rescale + probs.sum(-1)
        out = out * rescale.unsqueeze(-1) + torch.matmul(_as_operand(probs, dtype), v[..., start:start + block_size, :])
        row_max = new_max
    empty = row_sum == 0  # every key masked: output 0, as the math path's _safe_softmax gives
    out = torch.where(empty.unsqueeze(-1), 0.0, out / row_sum.unsqueeze(-1))
    logsumexp = torch.where(empty, float("-inf"), shift + row_sum.log())
    return out.to(dtype), logsumexp


def chunked_attention_backward(grad_out, query, key, value, attn_bias, out, logsumexp, is_causal=False,
                               scale=None, block_size=64, bias_grad=False):
    """``(grad_query, grad_key, grad_value, grad_bias or None)``, recomputing each block's probabilities."""
    dtype = query.dtype
    q, k, v, bias, scale = _prepare(query, key, value, attn_bias, scale)
    grad_o = grad_out.to(torch.float32)
    delta = (grad_o * out.to(torch.float32)).sum(-1, keepdim=True)  # rowsum(dO * O)
    lse = torch.where(logsumexp == float("-inf"), float("inf"), logsumexp).unsqueeze(-1)  # masked rows: p = 0
    grad_q = torch.zeros_like(q)
    grad_k = torch.empty_like(k)
    grad_v = torch.empty_like(v)
    grad_scores = q.new_empty((*q.shape[:-1], k.size(-2))) if bias_grad else None
    for start in range(0, k.size(-2), block_size):
        end = start + block_size
        k_block, v_block = k[..., start:end, :], v[..., start:end, :]
        probs = torch.exp(_block_scores(q, k_block, bias, start, is_causal, scale) - lse)
        grad_v[..., start:end, :] = torch.matmul(_as_operand(probs, dtype).transpose(-2, -1), grad_o)
        grad_probs = torch.matmul(grad_o, v_block.transpose(-2, -1))
        grad_s = probs * (grad_probs - delta)
        if grad_scores is not None:
            grad_scores[..., start:end] = grad_s
        grad_s = _as_operand(grad_s, dtype)
        grad_q += torch.matmul(grad_s, k_block) * scale
        grad_k[..., start:end, :] = torch.matmul(grad_s.transpose(-2, -1), q) * scale
    kv_heads = key.size(1)
    if kv_heads != q.size(1):  # each shared key/value head gets its group's gradients, summed
        grad_k = grad_k.unflatten(1, (kv_heads, -1)).sum(2)
        grad_v = grad_v.unflatten(1, (kv_heads, -1)).sum(2)
    grad_bias = None
    if grad_scores is not None:
        grad_bias = grad_scores.sum_to_size(attn_bias.shape).to(attn_bias.dtype)
    return grad_q.to(dtype), grad_k.to(key.dtype), grad_v.to(value.dtype), grad_bias


# ---- the choice and the ops, as sim's kernels --------------------------------------------------------


class _Selected:
    """The selected algorithm, and the kernels that route attention to it."""

    def __init__(self) -> None:
        self.algorithm = SdpaAlgorithm()
        self._library: torch.library.Library | None = None
        self._lock = threading.Lock()

    def set(self, algorithm: SdpaAlgorithm) -> None:
        with self._lock:
            self.algorithm = algorithm
            if self._library is None:  # sim's first activation
                self._library = torch.library.Library("aten", "IMPL")
                self._library.impl("scaled_dot_product_attention", _route, "AutogradPrivateUse1")
            if algorithm.name == "chunked":
                KERNELS[overload("scaled_dot_product_attention")] = _route_on_host
            else:
                KERNELS.pop(overload("scaled_dot_product_attention"), None)


SELECTED = _Selected()


def _supported(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa) -> bool:
    if dropout_p > 0.0 or (is_causal and attn_mask is not None):
        return False
    if any(t.dim() != 4 or t.is_nested or t.dtype != query.dtype for t in (key, value)) or query.dim() != 4:
        return False
    if query.dtype not in _DTYPES or query.size(0) != key.size(0) or key.shape[:3] != value.shape[:3]:
        return False
    heads, kv_heads = query.size(1), key.size(1)
    if heads != kv_heads and not (enable_gqa and heads % kv_heads == 0):
        return False
    if query.size(-1) != key.size(-1):
        return False
    if attn_mask is not None:
        if attn_mask.dtype not in (torch.bool, query.dtype):
            return False
        try:
            torch.broadcast_shapes(attn_mask.shape, (query.size(0), heads, query.size(2), key.size(2)))
        except RuntimeError:
            return False
    return True


@device_kernel("_fused_sdp_choice")
def fused_sdp_choice(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                     enable_gqa=False):
    """``SDPBackend.OVERRIDEABLE`` for what the chunked kernel supports while it is selected, else ``MATH``."""
    if (SELECTED.algorithm.name == "chunked" and torch._C._get_overrideable_sdp_enabled()
            and _supported(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)):
        return OVERRIDEABLE
    if torch._C._get_math_sdp_enabled():
        return MATH
    raise RuntimeError("No viable backend for scaled_dot_product_attention was found. This is likely due to "
                       "turning off both the math kernel and the fused kernels.")


def _math_attention(query, key, value, attn_bias, is_causal, scale):
    return torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, attn_bias, 0.0, is_causal, None, scale=scale, enable_gqa=key.size(1) != query.size(1))[0]


def math_attention(query, key, value, attn_bias=None, is_causal=False, scale=None):
    """``(output, logsumexp)``: the output as PyTorch's math op computes it, the logsumexp in float32."""
    q, k, _, bias, scale_ = _prepare(query, key, value, attn_bias, scale)
    logsumexp = torch.logsumexp(_block_scores(q, k, bias, 0, is_causal, scale_), -1)
    return _math_attention(query, key, value, attn_bias, is_causal, scale), logsumexp


@device_kernel("_scaled_dot_product_fused_attention_overrideable")
def fused_attention(query, key, value, attn_bias=None, dropout_p=0.0, is_causal=False, return_debug_mask=False,
                    *, scale=None):
    if dropout_p > 0.0:
        raise RuntimeError("sim: the fused attention kernel does not support dropout")
    if SELECTED.algorithm.name == "chunked":
        out, logsumexp = chunked_attention(query, key, value, attn_bias, is_causal, scale,
                                           SELECTED.algorithm.block_size)
    else:  # reached only by DTensors (see _route)
        out, logsumexp = math_attention(query, key, value, attn_bias, is_causal, scale)
    if out.shape == query.shape and out.stride() != query.stride():
        # The op's meta kernel, and CUDA's flash kernel, lay the output out as the query: (batch, length, heads,
        # dim) in memory for a query transposed from it. DTensor and torch.compile plan from the meta's strides
        # (a `.transpose(1, 2).contiguous()` then copies nothing), so the output must have them.
        out = torch.empty_like(query).copy_(out)
    seed, offset = torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long)  # no dropout: unused
    return out, logsumexp, None, None, query.size(2), key.size(2), seed, offset, None


@device_kernel("_scaled_dot_product_fused_attention_overrideable_backward")
def fused_attention_backward(grad_out, query, key, value, attn_bias, grad_input_mask, out, logsumexp, cum_seq_q,
                             cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *,
                             scale=None):
    bias_grad = attn_bias is not None and grad_input_mask[3]
    # math (DTensors only): the probabilities recomputed from the saved logsumexp in one block of every key
    block_size = SELECTED.algorithm.block_size if SELECTED.algorithm.name == "chunked" else key.size(2)
    return chunked_attention_backward(grad_out, query, key, value, attn_bias, out, logsumexp, is_causal, scale,
                                      block_size, bias_grad)


# ---- DTensors: the fused op's sharding rule ----------------------------------------------------------


def _dtensor_class():
    module = sys.modules.get("torch.distributed.tensor")  # never imported here: only a DTensor's owner has it
    return getattr(module, "DTensor", None)


def _distributed(*tensors) -> bool:
    dtensor = _dtensor_class()
    return dtensor is not None and any(isinstance(t, dtensor) for t in tensors)


@functools.cache
def _register_sharding_rules() -> None:
    """The fused op's placements, as DTensor's rule for flash attention gives them: every tensor replicated,
    or query, key, value, output and logsumexp sharded over heads (tensor parallel), or over the batch."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    aten = torch.ops.aten

    def forward_rule(query, key, value, attn_bias=None, *args, **kwargs):
        rules = []
        for placement in (Replicate(), Shard(1), Shard(0)):
            lse = placement  # logsumexp is (batch, heads, length): sharded as the output
            outputs = [placement, lse, None, None, None, None, Replicate(), Replicate(), None]
            inputs = [placement] * 3 + [placement if attn_bias is not None else None] + [None] * 3
            rules.append((outputs, inputs))
        return rules

    def backward_rule(grad_out, query, key, value, attn_bias, grad_input_mask, out, logsumexp, *args, **kwargs):
        rules = []
        for placement in (Replicate(), Shard(1), Shard(0)):
            bias = placement if attn_bias is not None else None
            outputs = [placement] * 3 + [bias if attn_bias is not None and grad_input_mask[3] else None]
            # grad_out, q, k, v, bias, mask, out, lse, cum_seq_q/k, max_q/k, dropout, causal, seed, offset
            inputs = [placement] * 4 + [bias, None, placement, placement] + [None] * 6 + [Replicate()] * 2
            rules.append((outputs, inputs))
        return rules

    register_sharding(aten._scaled_dot_product_fused_attention_overrideable.default)(forward_rule)
    register_sharding(aten._scaled_dot_product_fused_attention_overrideable_backward.default)(backward_rule)


def meta_kernels() -> list:
    """A Meta kernel for the fused op's backward where torch has none (torch 2.11): DTensor's sharding propagation and
    fake tensors run it for its shapes, which are those of what it differentiates (as torch 2.13's own kernel)."""
    if torch._C._dispatch_has_kernel_for_dispatch_key(
            "aten::_scaled_dot_product_fused_attention_overrideable_backward", "Meta"):
        return []
    library = torch.library.Library("aten", "IMPL")
    library.impl("_scaled_dot_product_fused_attention_overrideable_backward", _backward_shapes, "Meta")
    return [library]


def _backward_shapes(grad_out, query, key, value, attn_bias, *args, **kwargs):
    return (torch.empty_like(query), torch.empty_like(key), torch.empty_like(value),
            torch.empty_like(attn_bias) if attn_bias is not None else None)


def _additive_mask(attn_mask, dtype):
    """attention.cpp's convert_boolean_attn_mask: True takes part (0), False is masked (-inf)."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    return torch.where(attn_mask, torch.zeros((), dtype=dtype, device=attn_mask.device), float("-inf"))


def _distributed_choice(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa) -> int:
    # DTensors take the fused op, which has a sharding rule, whenever it supports the inputs (see the docstring).
    if torch._C._get_overrideable_sdp_enabled() and _supported(query, key, value, attn_mask, dropout_p, is_causal,
                                                                enable_gqa):
        _register_sharding_rules()
        return OVERRIDEABLE
    return MATH


def _route(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    """``scaled_dot_product_attention`` on sim, dispatched as attention.cpp does for a device's choice."""
    aten = torch.ops.aten
    if _distributed(query, key, value, attn_mask):
        choice = _distributed_choice(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    elif SELECTED.algorithm.name != "chunked":  # PyTorch's own path
        return aten.scaled_dot_product_attention.default.decompose(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    else:
        choice = aten._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                        enable_gqa=enable_gqa)
    mask = _additive_mask(attn_mask, query.dtype)
    if choice == OVERRIDEABLE:
        return aten._scaled_dot_product_fused_attention_overrideable(
            query, key, value, mask, dropout_p, is_causal, False, scale=scale)[0]
    return aten._scaled_dot_product_attention_math(query, key, value, mask, dropout_p, is_causal, None,
                                                   scale=scale, enable_gqa=enable_gqa)[0]


def _route_on_host(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                   enable_gqa=False):
    # Under inference_mode the op reaches the device whole, with host tensors.
    if fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa=enable_gqa) == OVERRIDEABLE:
        return chunked_attention(query, key, value, _additive_mask(attn_mask, query.dtype), is_causal, scale,
                                 SELECTED.algorithm.block_size)[0]
    return torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, _additive_mask(attn_mask, query.dtype), dropout_p, is_causal, None, scale=scale,
        enable_gqa=enable_gqa)[0]


# ---- public API --------------------------------------------------------------------------------------


def set_sdpa_algorithm(name: str = "math", block_size: int = 64) -> None:
    """Select sim's attention algorithm: ``"math"`` (PyTorch's default path) or ``"chunked"``."""
    SELECTED.set(SdpaAlgorithm(name, block_size))


def get_sdpa_algorithm() -> SdpaAlgorithm:
    return SELECTED.algorithm


@contextlib.contextmanager
def sdpa_algorithm(name: str, block_size: int = 64):
    """Run the block with sim's attention algorithm ``name``, then restore the previous one.

    >>> with ditorch.sim.sdpa_algorithm("chunked", block_size=16):   # doctest: +SKIP
    ...     out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    """
    previous = SELECTED.algorithm
    SELECTED.set(SdpaAlgorithm(name, block_size))
    try:
        yield
    finally:
        SELECTED.set(previous)
