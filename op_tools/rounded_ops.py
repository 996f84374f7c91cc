"""Which ops round each result once: the per-op fact behind the verdict's sensitivity (``comparison.ERROR_RULES``).

An op listed here computes every output element on its own, from a few inputs, in a type wider than a narrow output
(bfloat16 and float16 kernels compute in float32, on CUDA as on the CPU) and rounds it once: a correct element is
within half an ulp of the exact value, a faithful one within one. So a device error of 2 ulps is a fault, whatever
the same-dtype CPU run shows. Every op not listed (reductions, matmuls, convolutions, norms, softmax, attention)
sums, and keeps the looser rule whose witness, the same-dtype run's error, grows with the length of its sums.

Only forward results: a binary op's gradient sums over the dimensions an input was broadcast along (``x * weight``
in an RMSNorm), and the CPU's bfloat16 backward kernels (``silu_backward``) are not rounded once either.

    >>> rounded_once("torch.nn.functional.silu"), rounded_once("torch.Tensor.__imul__"), rounded_once("torch.mm")
    (True, True, False)
"""

from __future__ import annotations

import functools

_ACTIVATIONS = ("silu", "gelu", "relu", "relu6", "leaky_relu", "elu", "selu", "celu", "mish", "hardswish",
                "hardsigmoid", "hardtanh", "sigmoid", "tanh", "softplus", "softsign", "logsigmoid", "tanhshrink",
                "threshold")
_ELEMENTWISE = ("exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "reciprocal", "neg",
                "negative", "abs", "sin", "cos", "erf", "square", "clamp", "clip", "clamp_min", "clamp_max",
                "add", "sub", "subtract", "rsub", "mul", "multiply", "div", "divide", "true_divide", "addcmul",
                "addcdiv", "lerp", "pow", "maximum", "minimum", "where", "masked_fill")
_CASTS = ("to", "type", "type_as", "copy")  # to a dtype given as an argument: the reference keeps the wide value
_DUNDERS = tuple(f"__{side}{op}__" for op in ("add", "sub", "mul", "truediv", "div", "pow", "neg", "abs")
                 for side in ("", "r", "i"))

ROUNDED_ONCE: frozenset[str] = frozenset(_ACTIVATIONS + _ELEMENTWISE + _CASTS + _DUNDERS)


@functools.lru_cache(maxsize=4096)
def rounded_once(op_name: str) -> bool:
    """Whether the op's forward results are rounded once (by the last part of its name; ``mul_`` as ``mul``)."""
    name = op_name.rpartition(".")[2]
    return name in ROUNDED_ONCE or name.rstrip("_") in ROUNDED_ONCE
