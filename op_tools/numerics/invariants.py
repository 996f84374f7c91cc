"""Invariants an op's result must satisfy, checked on its device without a CPU reference: each gives, for one call, a
0-d float64 tensor on the device, the largest violation as a multiple of what rounding allows (above 1: wrong).

* **Matrix products** (``linear``, ``matmul``, ``mm``, ``bmm``, ``@``): the column checksum of algorithm-based fault
  tolerance, over tiles of ``TILE`` rows. A tile's rows of ``A @ B`` summed equal ``(its rows of A summed) @ B``; the
  check computes both sides from the call's operands and result (reductions and a product ``TILE`` times smaller
  than the op's) and bounds their difference by what any summation order of the device's kernel may give, per tile
  and column: ``(gamma_K(u_acc) + u_out) * sum|A||B|`` (Higham, 3.1 and 4.2), with ``u_acc`` half of float32's eps
  for narrow operands (they are multiplied exactly and summed in float32), of the operands' own dtype otherwise,
  plus a rounding of each operand where the device declares TF32/HF32 products or autocast casts them, plus the
  check's own roundings.
* **Softmax** (``softmax``): each row sums to 1, within ``u_out`` (each element rounded once) plus the float32 sum's
  ``gamma_n``; rows whose input holds no finite value are left out (their nan is the definition).

A fault that keeps the invariant passes: one element of a product off while another is off by the opposite amount in
the same column (a column checksum sees their sum), a softmax whose rows are permuted. What they catch: a product or
softmax computed wrong in a few elements (a flipped bit, a faulty lane) or all (noise, a wrong kernel), where the
error exceeds the rounding any correct kernel has.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .device_math import MANTISSA_BITS, DeviceMath

_F64 = torch.float64
TILE = 16  # rows summed per checksum: the bound grows with it, the check's product shrinks as 1/TILE
_WIDENED = 1.001  # a float32 norm or sum of up to millions of terms errs by far less than this, relatively
_NARROW = (torch.float16, torch.bfloat16)


def _u(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def _gamma(n: int, u: float) -> float:
    return n * u / (1 - n * u) if n * u < 1 else math.inf


def _accumulation(dtype: torch.dtype, math_: DeviceMath) -> tuple[float, float]:
    """``(u of the accumulation, u of an operand's rounding before it is multiplied)`` for a product in ``dtype``:
    under autocast a float32 operand is rounded to the autocast dtype first."""
    if dtype in _NARROW:
        return _u(torch.float32), 0.0
    if math_.autocast_dtype is not None and dtype == torch.float32:
        return _u(torch.float32), _u(math_.autocast_dtype)
    reduced = dict(math_.reduced).get("matmul")
    operand = 2.0 ** -(MANTISSA_BITS.get(reduced, 23) + 1) if reduced and dtype == torch.float32 else 0.0
    return _u(dtype), operand


def _excess(difference: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """The largest ``|difference| / allowed`` (nan where the difference is nan: a nan result is a violation), in the
    check's type: float32 unless the op's is float64 (many NPUs have no float64 kernels)."""
    ratio = difference.abs() / allowed
    return torch.where(torch.isnan(ratio), torch.full_like(ratio, math.inf), ratio).amax()


def product_checksum(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None,
                     math_: DeviceMath) -> torch.Tensor | None:
    """The tiled column checksum of ``out = a @ b (+ bias)`` (``a``: (..., M, K), ``b``: (..., K, N), broadcasting
    batch dimensions); None for shapes it does not cover (vectors).

    The rows are summed in tiles of ``TILE`` (all ``M`` when ``M`` is not a multiple of it): per tile and column,
    ``sum_r out_rn`` against ``(sum_r a_r) @ b``, a product ``TILE`` times smaller than the op's. A tile's worst-case
    rounding grows with its rows, so a small tile keeps one wrong element, or noise, far above it. Everything runs in
    the product's own precision or float32 (no float64 copy): the check's own roundings (its sums and its product) are
    added to the bound. The magnitudes ``sum_r sum_k |a_rk| |b_kn|`` are bounded by Cauchy-Schwarz from the columns'
    norms (no ``|b|`` is made); a result element is at most its magnitude, so its rounding is bounded by the same."""
    if a.dim() < 2 or b.dim() < 2 or out.dim() < 2 or not out.is_floating_point() or out.numel() == 0:
        return None
    rows, depth = a.size(-2), a.size(-1)
    tile = TILE if rows % TILE == 0 else rows
    u_acc, u_operand = _accumulation(a.dtype, math_)
    a, b, out = a.detach(), b.detach(), out.detach()
    wide = _F64 if b.dtype == _F64 else torch.float32  # the check's type
    tiles = (rows // tile, tile)
    checksum = out.unflatten(-2, tiles).sum(-2, dtype=wide)
    expected = a.unflatten(-2, tiles).sum(-2, dtype=wide) @ b.to(wide)
    column_norms = torch.linalg.vector_norm(b, 2, dim=-2, keepdim=True, dtype=wide)
    tile_magnitudes = a.abs().unflatten(-2, tiles).sum(-2, dtype=wide)  # (..., M/T, K)
    magnitude = column_norms * torch.linalg.vector_norm(tile_magnitudes, 2, dim=-1, keepdim=True) * _WIDENED
    if bias is not None:
        bias_wide = bias.detach().to(wide)
        expected = expected + tile * bias_wide
        magnitude = magnitude + tile * bias_wide.abs()
    u_check = _u(wide)
    allowed = (_gamma(depth + 1, u_acc) + 2 * u_operand + _gamma(depth + 1, u_check) + 3 * _gamma(tile + 1, u_check) +
               u_check) * magnitude + tile * torch.finfo(out.dtype).tiny
    if out.dtype in _NARROW:  # its own rounding dominates: bounded by the tile's |out| (one more pass), not loosely
        allowed = allowed + _u(out.dtype) * torch.linalg.vector_norm(out.unflatten(-2, tiles), 1, dim=-2,
                                                                      dtype=wide) * _WIDENED
    else:
        allowed = allowed + _u(out.dtype) * magnitude
    return _excess(checksum - expected, allowed)


def linear_checksum(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                    math_: DeviceMath) -> torch.Tensor | None:
    """``linear``'s: ``out = x weight^T + bias`` over all of ``x``'s leading dimensions as rows."""
    if x.dim() < 1 or weight.dim() != 2 or out.numel() == 0:
        return None
    return product_checksum(x.reshape(-1, x.size(-1)), weight.t(), out.reshape(-1, out.size(-1)), bias, math_)


def softmax_row_sums(x: torch.Tensor, out: torch.Tensor, dim: int) -> torch.Tensor | None:
    """Each row of ``out = softmax(x, dim)`` sums to 1 (rows of ``x`` without a finite value left out)."""
    if not out.is_floating_point() or out.numel() == 0:
        return None
    n = out.size(dim)
    wide = _F64 if out.dtype == _F64 else torch.float32
    sums = out.detach().sum(dim, dtype=wide)
    live = torch.isfinite(x.detach()).any(dim)
    allowed = _u(out.dtype) * 2 + 2 * _gamma(n + 1, _u(wide))  # the device's float32 sum, and the check's
    return _excess(torch.where(live, sums - 1, torch.zeros_like(sums)), torch.full_like(sums, allowed))


def _arg(args: tuple, kwargs: dict, position: int, name: str, default=None):
    if position < len(args):
        return args[position]
    return kwargs.get(name, default)


def _linear(args, kwargs, out, math_):
    return linear_checksum(_arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "weight"),
                           _arg(args, kwargs, 2, "bias"), out, math_)


def _matmul(args, kwargs, out, math_):
    return product_checksum(_arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "other"), out, None, math_)


def _softmax(args, kwargs, out, math_):
    dim = _arg(args, kwargs, 1, "dim")
    if not isinstance(dim, int):
        return None
    return softmax_row_sums(_arg(args, kwargs, 0, "input"), out, dim)


# op name (as the tools name calls) -> check(args, kwargs, result, device math) -> excess or None
CHECKS: dict[str, Callable] = {
    "torch.nn.functional.linear": _linear,
    "torch.matmul": _matmul, "torch.Tensor.matmul": _matmul, "torch.Tensor.__matmul__": _matmul,
    "torch.mm": _matmul, "torch.spmm": _matmul, "torch.Tensor.mm": _matmul, "torch.bmm": _matmul,
    "torch.Tensor.bmm": _matmul,
    "torch.nn.functional.softmax": _softmax, "torch.softmax": _softmax, "torch.Tensor.softmax": _softmax,
}
# The functions a tool wraps by default (targeted dispatch, no mode seeing every call): those of CHECKS that can be
# wrapped under their own name (torch.mm is torch.spmm's object, and @ reaches the tools as Tensor.matmul's call).
WRAPPED = tuple(name for name in CHECKS if name not in ("torch.mm", "torch.spmm", "torch.Tensor.__matmul__"))
# what each check is called in a finding
KINDS = {**{name: "column checksum" for name in CHECKS}, "torch.nn.functional.softmax": "row sums",
         "torch.softmax": "row sums", "torch.Tensor.softmax": "row sums"}


def check(name: str, args: tuple, kwargs: dict, result, math_: DeviceMath) -> torch.Tensor | None:
    """The excess of a call of ``name`` (a 0-d float64 tensor on its device), or None: no invariant for it, or for
    these arguments."""
    checker = CHECKS.get(name)
    if checker is None or not isinstance(result, torch.Tensor):
        return None
    with torch.no_grad():
        return checker(args, kwargs, result, math_)
