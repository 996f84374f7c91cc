"""Which ops round each result once: the per-op fact behind the verdict's sensitivity (``comparison.ERROR_RULES``).

An op declared so (``op_facts``' ``rounded_once``) computes every output element on its own, from a few inputs, in
a type wider than a narrow output (bfloat16 and float16 kernels compute in float32, on CUDA as on the CPU) and rounds
it once: a correct element is within half an ulp of the exact value, a faithful one within one. So a device error of
2 ulps is a fault, whatever the same-dtype CPU run shows. Softmax is one too: an element comes from a whole row, but
through a float32 sum of positive terms (CUDA's and the CPU's kernels alike) whose relative error, ``n 2^-24`` in the
worst order and ``sqrt(n) 2^-24`` typically, stays below half a float16 ulp up to 4,096 elements in the worst order
and far beyond that in any real one. Every other op (reductions, matmuls, convolutions, norms, attention) sums in its
result's precision or with its terms' signs mixed, and keeps the looser rule whose witness, the same-dtype run's
error, grows with the length of its sums (attention: ``rounding_bounds``).

Only forward results: a binary op's gradient sums over the dimensions an input was broadcast along (``x * weight``
in an RMSNorm), and the CPU's bfloat16 backward kernels (``silu_backward``) are not rounded once either.

    >>> rounded_once("torch.nn.functional.silu"), rounded_once("torch.Tensor.__imul__"), rounded_once("torch.mm")
    (True, True, False)
"""

from __future__ import annotations

from .op_facts import OpsWith, cached_on_facts, op_facts

# The ops are declared in ``op_facts`` (``rounded_once``); ``name in ROUNDED_ONCE`` asks it.
ROUNDED_ONCE = OpsWith("rounded_once")


@cached_on_facts  # asked per compared call
def rounded_once(op_name: str) -> bool:
    """Whether the op's forward results are rounded once (by the last part of its name; ``mul_`` as ``mul``)."""
    return op_facts(op_name).rounded_once
