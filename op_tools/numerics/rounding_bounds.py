"""What a correct result may err, element by element, where the algorithm is known: the bounds the verdict checks
beside (or instead of) its ratio to the CPU's own error.

Each bound gives ``allowed(dtype, reference)``, the largest ``|device - reference|`` per element (float64, the
result's shape) that rounding in a correct kernel of the device's ``dtype`` can give, and ``says``, the note a
passing result carries:

* ``AnyOrderSum(magnitudes, n)``: each element a sum of ``n`` terms whose magnitudes sum to ``magnitudes``, added
  in any order (``sum``, ``mean``, a broadcast input's gradient);
* ``AttentionRounding``: ``softmax(q k^T scale + mask) v`` as fused attention kernels compute it in a narrow dtype;
* ``RoundedTerms``: a sum of terms of one sign, each rounded to a narrow dtype first (``cross_entropy``).

Both follow Higham, Accuracy and Stability of Numerical Algorithms (2nd ed.): summing ``n`` terms in floating point,
in whatever order, errs by at most ``gamma_n * sum |terms|``, ``gamma_n = n u / (1 - n u)``, ``u`` half the
accumulation type's eps (4.2); a dot product of length ``d`` by ``gamma_d * sum |products|`` (3.1).
"""

from __future__ import annotations

import functools
import math

import torch

from .attention import attention_arguments
from .reference import isolated

_FLOAT32_U = torch.finfo(torch.float32).eps / 2
NONFINITE_BOUND = -1.0  # ``worst_excess`` of a check whose bound is not finite: its operands hold inf or nan


def worst_excess(difference: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """The largest ``|difference| / allowed`` of an on-device check (OpSelfCheck's), a 0-d tensor in the check's type:
    inf where the difference is nan (a nan made from finite operands is a violation); ``NONFINITE_BOUND`` where any
    bound is inf or nan: the operands hold inf or nan (a diverged run's weights, a rank that sent nan), so the result
    may too, rightly, and nothing can be judged. Inf and nan are OpOverflowCheck's to find. 0 where there is nothing
    to judge (a collective of no elements, which PowerSGD's hook makes when it compresses every gradient)."""
    if difference.numel() == 0:
        return difference.new_zeros(())
    ratio = difference.abs() / allowed
    excess = torch.where(torch.isnan(ratio), torch.full_like(ratio, math.inf), ratio).amax()
    return torch.where(torch.isfinite(allowed).all(), excess, torch.full_like(excess, NONFINITE_BOUND))


NARROW = frozenset(t for t in (torch.float16, torch.bfloat16, getattr(torch, "float8_e4m3fn", None),
                               getattr(torch, "float8_e5m2", None)) if t is not None)


@functools.cache
def _finfo(dtype: torch.dtype) -> torch.finfo:
    return torch.finfo(dtype.to_real() if dtype.is_complex else dtype)


def gamma(n: float, u: float) -> float:
    """Higham's ``gamma_n``: the worst relative error of ``n`` roundings of unit roundoff ``u`` (a sum of ``n + 1``
    terms in any order)."""
    return n * u / (1 - n * u) if n * u < 1 else math.inf


def _wide(t: torch.Tensor) -> torch.Tensor:
    """float64 where the reference is: the CPU's, or the device's own (``device_reference``)."""
    return t.detach().to(dtype=torch.float64)


class AnyOrderSum:
    """Each element of the result sums ``n`` terms whose magnitudes sum to ``magnitudes``.

    Each term is computed in up to ``term_roundings`` roundings (an input element: none; a product: one); with
    ``terms_rounded`` each is then rounded to the result's dtype before the sum (autograd materialises a broadcast
    input's gradient terms, then sums them in float32: a narrow dtype's rounding per term). The result's own last
    roundings (to a narrow dtype, a mean's scaling) add an eps of it. The CPU's own error on the call is one order
    among many, and a GPU's blocked sums may err several times more: the H200's RMSNorm gradient of a (..., 1) factor
    summed over 512 elements did, at ~46 float32 eps.
    """

    def __init__(self, magnitudes: torch.Tensor, n: int, term_roundings: int = 1, terms_rounded: bool = False) -> None:
        self.magnitudes, self.n, self.term_roundings, self.terms_rounded = magnitudes, n, term_roundings, terms_rounded
        self.says = f"within the rounding of a sum of {n} terms in any order"

    judges_parts = True  # allowed() takes a part of the flattened result (a large gradient judged in parts)

    def allowed(self, dtype: torch.dtype, reference: torch.Tensor, part: slice | None = None) -> torch.Tensor | None:
        accumulation = torch.float32 if dtype in NARROW else dtype
        u = _finfo(accumulation).eps / 2
        worst = gamma(self.n + self.term_roundings, u)
        if not math.isfinite(worst):
            return None
        if self.terms_rounded and dtype in NARROW:
            worst += _finfo(dtype).eps / 2
        magnitudes = self.magnitudes if part is None else self.magnitudes.reshape(-1)[part]
        return worst * _wide(magnitudes) + self.n * _finfo(accumulation).tiny + _finfo(dtype).eps * reference.abs()


class AttentionRounding:
    """``softmax(q k^T scale + mask) v`` computed as flash, memory-efficient, cuDNN and math kernels do in bfloat16 or
    float16: scores, softmax and every sum in float32, the probabilities rounded to the inputs' dtype before they
    weigh ``v`` (flash), the output rounded once.

    An output element ``o = sum_j p_j v_j`` then errs by at most
    ``u |o|`` (its rounding) ``+ (u + 2 (d + 4) u32 s + 2 (n + 8) u32) * sum_j p_j |v_j|`` (each probability's
    rounding, its score's float32 dot product of length ``d`` and magnitude ``s``, the exponentials, the float32 sums
    over ``n`` keys and the rescalings of an online softmax), plus half a subnormal step per probability. ``u`` is
    half the dtype's eps, ``u32`` float32's. The weighted magnitudes ``sum_j p_j |v_j|`` are the attention rerun in
    float64 on ``|v|``; ``s`` bounds the row's scores (``scale |q_i| max_j |k_j| + max |mask|``).

    The CPU's same-dtype error is no measure here: the fused kernel is another algorithm, and a ratio wide enough
    for it (16x) let a bfloat16 fault of 10% pass. This bound holds for any such kernel and is tight where a row's
    attention is concentrated (a causal mask's first rows, a head that attends to few keys), where a fault of one
    ulp shows.
    """

    def __init__(self, weighted: torch.Tensor, scores: torch.Tensor, value_sums: torch.Tensor, keys: int,
                 head_dim: int) -> None:
        self.weighted, self.scores, self.value_sums, self.keys, self.head_dim = \
            weighted, scores, value_sums, keys, head_dim
        self.says = f"within the rounding of attention over {keys} keys"

    def allowed(self, dtype: torch.dtype, reference: torch.Tensor) -> torch.Tensor | None:
        info = _finfo(dtype)
        u = info.eps / 2
        per_weight = u + 2 * (self.head_dim + 4) * _FLOAT32_U * self.scores + 2 * (self.keys + 8) * _FLOAT32_U
        subnormal_step = info.tiny * info.eps  # a probability below the smallest normal is rounded to this step
        return u * reference.abs() + (1 + u) * per_weight * self.weighted + subnormal_step / 2 * self.value_sums \
            + info.tiny


class RoundedTerms:
    """Each element of the result sums (or averages) terms of one sign, each computed in float32 and rounded to the
    ``narrow`` dtype first: ``cross_entropy`` of narrow logits, whose ``log_softmax`` runs in their dtype.

    A correct device rounds each term to within half an ulp of ``narrow`` (``u``), so, the terms sharing a sign, the
    sum errs by at most ``u`` times its own magnitude, plus the float32 sum's ``gamma_n``, plus each term's float32
    computation before its rounding (``x - (max + log(sum))``: a few float32 roundings of values up to ``scale``).
    The CPU's error on the same call is one draw of those roundings: on an H200, a loss over 8 rows erred 5.6 times
    the CPU's, whose roundings had happened to cancel.
    """

    def __init__(self, narrow: torch.dtype, n: int, scale: float, summed: int) -> None:
        self.narrow, self.n, self.scale, self.summed = narrow, n, scale, summed
        self.says = f"within one {str(narrow).removeprefix('torch.')} rounding of each of its terms"

    def allowed(self, dtype: torch.dtype, reference: torch.Tensor) -> torch.Tensor | None:
        worst = gamma(self.n + 1, _FLOAT32_U)
        if not math.isfinite(worst):
            return None
        narrow = _finfo(self.narrow)
        magnitudes = _wide(reference).abs()
        # per term: its float32 computation, then its rounding to the narrow type (a subnormal's half step included)
        per_term = 4 * _FLOAT32_U * self.scale + narrow.tiny * narrow.eps
        return (narrow.eps / 2 + worst) * (magnitudes + self.summed * per_term) + self.summed * per_term + \
            _finfo(dtype).eps * magnitudes


def rounded_terms(device_args: tuple, args: tuple, kwargs: dict) -> RoundedTerms | None:
    """The ``RoundedTerms`` of a ``cross_entropy`` call whose logits (the first of ``device_args``, in the device's
    dtypes) are narrow, from its float64 CPU arguments; None otherwise."""
    source = next((a for a in device_args if isinstance(a, torch.Tensor)), None)
    logits = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if source is None or source.dtype not in NARROW or logits is None or not logits.numel():
        return None
    classes = logits.size(1) if logits.dim() >= 2 else logits.size(0)
    rows = logits.numel() // max(1, classes)
    weights = [t for t in (*args[1:], *kwargs.values()) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    largest = max([1.0, *(float(t.detach().abs().max()) for t in weights if t.numel())])
    scale = (float(logits.detach().abs().max()) + math.log(max(2, classes))) * largest
    reduction = kwargs.get("reduction", args[6] if len(args) > 6 else "mean")
    return RoundedTerms(source.dtype, rows + classes, scale, rows if reduction == "sum" else 1)


def attention_rounding(func, args: tuple, kwargs: dict) -> AttentionRounding | None:
    """The ``AttentionRounding`` of a ``scaled_dot_product_attention`` call on float64 CPU arguments, from one more
    float64 run of ``func`` on ``|value|``; None when the arguments are not those of such a call."""
    bound = attention_arguments(args, kwargs)
    query, key, value = bound["query"], bound["key"], bound["value"]
    if not all(isinstance(t, torch.Tensor) and t.dim() >= 2 and t.is_floating_point() for t in (query, key, value)):
        return None
    absolute = list(args)
    with isolated(), torch.no_grad():
        if len(absolute) > 2:
            absolute[2] = value.detach().abs()
            weighted = func(*absolute, **kwargs)
        else:
            weighted = func(*absolute, **{**kwargs, "value": value.detach().abs()})
    if not isinstance(weighted, torch.Tensor):
        return None
    query, key, value = query.detach(), key.detach(), value.detach()
    scale = bound.get("scale")
    scale = 1 / math.sqrt(query.size(-1)) if scale is None else abs(float(scale))
    key_norms = key.norm(dim=-1, keepdim=True).amax(dim=-2, keepdim=True)  # (..., kv heads, 1, 1)
    value_sums = value.abs().sum(dim=-2, keepdim=True)  # (..., kv heads, 1, dv): an upper bound over any mask
    if query.dim() >= 3 and key.dim() >= 3 and query.size(-3) != key.size(-3):  # grouped-query attention
        groups = query.size(-3) // key.size(-3)
        key_norms = key_norms.repeat_interleave(groups, dim=-3)
        value_sums = value_sums.repeat_interleave(groups, dim=-3)
    scores = scale * query.norm(dim=-1, keepdim=True) * key_norms
    mask = bound.get("attn_mask")
    if isinstance(mask, torch.Tensor) and mask.is_floating_point():
        finite = mask[torch.isfinite(mask)]
        if finite.numel():
            scores = scores + finite.abs().max()
    return AttentionRounding(weighted.detach(), scores, value_sums, key.size(-2), query.size(-1))
