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

import contextlib
import dataclasses
import functools
import math
import sys
from collections.abc import Callable

import torch

from ..ops.naming import function_from_name, resolve_op_name
from ..ops.torch_versions import autocast_enabled
from . import sampled_reference
from .device_math import MANTISSA_BITS, DeviceMath
from .rounding_bounds import gamma, worst_excess

_F64 = torch.float64
TILE = 16  # rows summed per checksum: the bound grows with it, the check's product shrinks as 1/TILE
_WIDENED = 1.001  # a float32 norm or sum of up to millions of terms errs by far less than this, relatively
_NARROW = (torch.float16, torch.bfloat16)


def _u(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def _accumulation(dtype: torch.dtype, math_: DeviceMath, family: str = "matmul") -> tuple[float, float, float]:
    """``(u of the accumulation, u of an operand's rounding before it is multiplied, u of the check's own operands'
    rounding)`` for a product of ``family`` ("matmul", "conv") in ``dtype``: under autocast a float32 operand is
    rounded to the autocast dtype first; under TF32/HF32 a float32 one to that format, the check's float32 product's
    too (it runs under the same switch)."""
    reduced = dict(math_.reduced).get(family)
    rounded = 2.0 ** -(MANTISSA_BITS.get(reduced, 23) + 1) if reduced else 0.0
    check = rounded if dtype != _F64 else 0.0
    if dtype in _NARROW:
        return _u(torch.float32), 0.0, check
    if math_.autocast_dtype is not None and dtype == torch.float32:
        return _u(torch.float32), _u(math_.autocast_dtype), check
    return _u(dtype), rounded if dtype == torch.float32 else 0.0, check


def _as_autocast_ran(math_: DeviceMath, first: torch.Tensor, second: torch.Tensor, addend: torch.Tensor | None):
    """A product's operands (and addend) as the device multiplied them: under autocast each float32 one rounded to
    its dtype (a bf16 activation times a float32 weight: the weight rounded too, which the bound took for exact, and
    accused a right linear), with the math then plain; else as they are."""
    narrow = math_.autocast_dtype
    if narrow is None:
        return first, second, addend, math_
    first, second = (t.to(narrow) if t.dtype == torch.float32 else t for t in (first, second))
    if addend is not None and addend.dtype == torch.float32:
        addend = addend.to(narrow)
    return first, second, addend, DeviceMath()  # its rounding now made by the check itself


def _allowed(depth: int, tile: int, magnitude: torch.Tensor, out_l1: torch.Tensor | None, out_dtype: torch.dtype,
             rounding: tuple[float, float, float], wide: torch.dtype, extra: float = 0.0) -> torch.Tensor:
    """What rounding allows a tile's checksum of a product of reduction length ``depth`` whose per-element
    magnitudes sum to ``magnitude`` (``sum |A||B|`` over the tile): the device's accumulation in any order
    (Higham 3.1, 4.2), its operands' rounding, the check's own sums and product, and each result element's rounding
    (bounded by the tile's ``sum |out|`` where it is given, else by the magnitudes). ``extra``: further roundings of
    the magnitude (an addmm's scaling and addition)."""
    u_acc, u_operand, u_check_operand = rounding
    u_check = _u(wide)
    allowed = (gamma(depth + 1, u_acc) + 2 * u_operand + 2 * u_check_operand + gamma(depth + 1, u_check) +
               3 * gamma(tile + 1, u_check) + u_check + extra) * magnitude + tile * torch.finfo(out_dtype).tiny
    if out_l1 is not None:
        return allowed + _u(out_dtype) * out_l1
    return allowed + _u(out_dtype) * magnitude


def _tile_of(rows: int) -> int:
    return TILE if rows % TILE == 0 else rows


def _addend_tiles(addend: torch.Tensor, out: torch.Tensor, tiles: tuple[int, int], wide: torch.dtype,
                  dim: int) -> torch.Tensor:
    """``addend`` (broadcast to ``out``) summed over each tile of dimension ``dim``."""
    if addend.dim() == 1 and dim == -2:  # a bias over columns: each tile adds it ``tile`` times
        return tiles[1] * addend.to(wide)
    return addend.expand_as(out).unflatten(dim, tiles).sum(dim, dtype=wide)


def product_checksum(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, addend: torch.Tensor | None,
                     math_: DeviceMath, beta: float = 1.0, alpha: float = 1.0) -> torch.Tensor | None:
    """The tiled column checksum of ``out = beta * addend + alpha * (a @ b)`` (``a``: (..., M, K), ``b``: (..., K,
    N), broadcasting batch dimensions; ``addend`` broadcast to ``out``: a linear's bias, an addmm's input); None for
    shapes it does not cover (vectors).

    The rows are summed in tiles of ``TILE`` (all ``M`` when ``M`` is not a multiple of it): per tile and column,
    ``sum_r out_rn`` against ``(sum_r a_r) @ b``, a product ``TILE`` times smaller than the op's. A tile's worst-case
    rounding grows with its rows, so a small tile keeps one wrong element, or noise, far above it. Everything runs in
    the product's own precision or float32 (no float64 copy): the check's own roundings (its sums and its product) are
    added to the bound. The magnitudes ``sum_r sum_k |a_rk| |b_kn|`` are bounded by Cauchy-Schwarz from the columns'
    norms (no ``|b|`` is made); a result element is at most its magnitude, so its rounding is bounded by the same."""
    if a.dim() < 2 or b.dim() < 2 or out.dim() < 2 or not out.is_floating_point() or out.numel() == 0:
        return None
    rows, depth = a.size(-2), a.size(-1)
    if b.size(-2) != depth or out.shape[-2:] != (rows, b.size(-1)):  # not this product (a DTensor's local tensors)
        return None
    tile = _tile_of(rows)
    a, b, addend, math_ = _as_autocast_ran(math_, a, b, addend)
    rounding = _accumulation(a.dtype, math_)
    a, b, out = a.detach(), b.detach(), out.detach()
    wide = _F64 if b.dtype == _F64 else torch.float32  # the check's type
    tiles = (rows // tile, tile)
    checksum = out.unflatten(-2, tiles).sum(-2, dtype=wide)
    expected = a.unflatten(-2, tiles).sum(-2, dtype=wide) @ b.to(wide)
    column_norms = torch.linalg.vector_norm(b, 2, dim=-2, keepdim=True, dtype=wide)
    tile_magnitudes = a.abs().unflatten(-2, tiles).sum(-2, dtype=wide)  # (..., M/T, K)
    magnitude = column_norms * torch.linalg.vector_norm(tile_magnitudes, 2, dim=-1, keepdim=True) * _WIDENED
    extra = 0.0
    if alpha != 1:
        expected, magnitude, extra = expected * alpha, magnitude * abs(alpha), _u(out.dtype)
    if addend is not None and beta != 0:
        added = _addend_tiles(addend.detach(), out, tiles, wide, -2)
        expected = expected + beta * added
        magnitude = magnitude + abs(beta) * _addend_tiles(addend.detach().abs(), out, tiles, wide, -2)
        extra += 2 * _u(out.dtype) if beta != 1 else _u(out.dtype)
    out_l1 = (torch.linalg.vector_norm(out.unflatten(-2, tiles), 1, dim=-2, dtype=wide) * _WIDENED
              if out.dtype in _NARROW else None)  # a narrow output's own rounding dominates: bounded by its |out|
    return worst_excess(checksum - expected, _allowed(depth, tile, magnitude, out_l1, out.dtype, rounding, wide, extra))


def linear_checksum(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                    math_: DeviceMath, share: float = 1.0) -> torch.Tensor | None:
    """``linear``'s: ``out = x weight^T + share * bias`` over all of ``x``'s leading dimensions as rows."""
    if x.dim() < 1 or weight.dim() != 2 or out.numel() == 0:
        return None
    return product_checksum(x.reshape(-1, x.size(-1)), weight.t(), out.reshape(-1, out.size(-1)), bias, math_, share)


_CONVOLUTIONS = {1: torch.conv1d, 2: torch.conv2d, 3: torch.conv3d}


def conv_checksum(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                  settings: tuple, math_: DeviceMath) -> torch.Tensor | None:
    """A convolution's checksum over tiles of ``TILE`` output channels (within a group): their outputs summed equal
    the convolution of the input with their filters summed, a convolution ``TILE`` times smaller than the op's. The
    magnitudes come from the same small convolution of ``|x|`` with the tiles' ``|w|`` summed (exact, no
    Cauchy-Schwarz); the reduction length is a filter's ``C_in / groups * prod(kernel)``. ``settings``: (stride,
    padding, dilation, groups) as the op took them."""
    spatial = weight.dim() - 2
    convolve = _CONVOLUTIONS.get(spatial)
    if convolve is None or not out.is_floating_point() or out.numel() == 0 or x.dim() not in (spatial + 1,
                                                                                                spatial + 2):
        return None
    if x.dim() == spatial + 1:  # unbatched
        x, out = x.unsqueeze(0), out.unsqueeze(0)
    stride, padding, dilation, groups = settings
    channels = weight.size(0)
    tile = _tile_of(channels // groups)
    x, weight, bias, math_ = _as_autocast_ran(math_, x, weight, bias)
    rounding = _accumulation(x.dtype, math_, "conv")
    x, weight, out = x.detach(), weight.detach(), out.detach()
    wide = _F64 if weight.dtype == _F64 else torch.float32
    tiles = (channels // tile, tile)
    checksum = out.unflatten(1, tiles).sum(2, dtype=wide)
    summed = weight.unflatten(0, tiles).sum(1, dtype=wide)
    expected = convolve(x.to(wide), summed, None, stride, padding, dilation, groups)
    magnitude = convolve(x.abs().to(wide), weight.abs().unflatten(0, tiles).sum(1, dtype=wide), None, stride, padding,
                         dilation, groups)
    if bias is not None:
        shape = (1, -1) + (1,) * spatial
        expected = expected + bias.detach().unflatten(0, tiles).sum(1, dtype=wide).reshape(shape)
        magnitude = magnitude + bias.detach().abs().unflatten(0, tiles).sum(1, dtype=wide).reshape(shape)
    depth = weight[0].numel()
    out_l1 = out.abs().unflatten(1, tiles).sum(2, dtype=wide) * _WIDENED if out.dtype in _NARROW else None
    return worst_excess(checksum - expected, _allowed(depth, tile, magnitude, out_l1, out.dtype, rounding, wide))


def softmax_row_sums(x: torch.Tensor, out: torch.Tensor, dim: int) -> torch.Tensor | None:
    """Each row of ``out = softmax(x, dim)`` sums to 1 (rows of ``x`` without a finite value left out)."""
    if not out.is_floating_point() or out.numel() == 0:
        return None
    n = out.size(dim)
    wide = _F64 if out.dtype == _F64 else torch.float32
    sums = out.detach().sum(dim, dtype=wide)
    live = torch.isfinite(x.detach()).any(dim)
    allowed = _u(out.dtype) * 2 + 2 * gamma(n + 1, _u(wide))  # the device's float32 sum, and the check's
    return worst_excess(torch.where(live, sums - 1, torch.zeros_like(sums)), torch.full_like(sums, allowed))


def addend_of(name: str, args: tuple, kwargs: dict):
    """The tensor a call of ``name`` adds to its product (None if none)."""
    place = ADDENDS.get(name)
    return None if place is None else _arg(args, kwargs, *place)


@dataclasses.dataclass(frozen=True)
class ProductOperands:
    """A product call ``out = a @ b (+ addend)`` as its backward sees it: ``inputs`` are the call's own tensors whose
    gradients are ``grad_a`` and ``grad_b`` (a linear's ``(x, weight)``: ``b`` is ``weight^T``, and ``grad_b`` the
    weight's gradient transposed)."""

    a: torch.Tensor
    b: torch.Tensor
    inputs: tuple[torch.Tensor, torch.Tensor]
    transposed: bool  # b is inputs[1] transposed

    def grads(self, grad_a: torch.Tensor | None, grad_input_1: torch.Tensor | None):
        """``(grad_a, grad_b)`` from the gradients of ``inputs``."""
        if self.transposed and grad_input_1 is not None:
            grad_input_1 = grad_input_1.t()
        return grad_a, grad_input_1


def product_operands(name: str, args: tuple, kwargs: dict) -> ProductOperands | None:
    """The operands of a product call whose backward products ``backward_checksums`` checks; None for other calls
    and for shapes whose gradients are not plain products (broadcast batch dimensions, vectors)."""
    transposed = False
    if name == "torch.nn.functional.linear":
        a, w = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "weight")
        b, second, transposed = (w.t() if isinstance(w, torch.Tensor) and w.dim() == 2 else None), w, True
    elif name in _PRODUCTS and name in ADDENDS:  # addmm, baddbmm: the input added is not a product's operand
        a, b = _arg(args, kwargs, 1, "mat1", kwargs.get("batch1")), _arg(args, kwargs, 2, "mat2", kwargs.get("batch2"))
        second = b
    elif name in _PRODUCTS:
        a, b = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "other")
        second = b
    else:
        return None
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dim() < 2 or b.dim() < 2 or \
            (b.dim() > 2 and a.shape[:-2] != b.shape[:-2]):
        return None
    return ProductOperands(a, b, (a, second), transposed)


def backward_checksums(a: torch.Tensor, b: torch.Tensor, upstream: torch.Tensor, grad_a: torch.Tensor | None,
                       grad_b: torch.Tensor | None, math_: DeviceMath) -> list[torch.Tensor]:
    """The column checksums of a product's two backward products: ``grad_a = upstream @ b^T`` and ``grad_b = a^T @
    upstream`` (rows of ``a`` beyond the matrix, for a 2-D ``b``, joined: the weight's gradient sums over them).
    Under autocast the device multiplied the operands rounded to its dtype, and rounded the results: the check
    takes them so rounded (exactly what the device had)."""
    narrow = math_.autocast_dtype
    if narrow is not None:
        grad_a, grad_b = (g.to(narrow) if g is not None and g.dtype == torch.float32 else g for g in (grad_a, grad_b))
        a, b, upstream, math_ = _as_autocast_ran(math_, a, b, upstream)
    a, b, upstream = a.detach(), b.detach(), upstream.detach()
    if b.dim() == 2:  # a linear's or a 2-D product's: every leading row one row
        a, upstream = a.reshape(-1, a.size(-1)), upstream.reshape(-1, upstream.size(-1))
        grad_a = grad_a.reshape(-1, grad_a.size(-1)) if grad_a is not None else None
    found = []
    if grad_a is not None and grad_a.shape == a.shape:
        found.append(product_checksum(upstream, b.transpose(-1, -2), grad_a, None, math_))
    if grad_b is not None and grad_b.shape == b.shape:
        found.append(product_checksum(a.transpose(-1, -2), upstream, grad_b, None, math_))
    return [f for f in found if f is not None]


def log_softmax_row_sums(x: torch.Tensor, out: torch.Tensor, dim: int) -> torch.Tensor | None:
    """Each row of ``out = log_softmax(x, dim)`` exponentiated sums to 1. An element is ``(x - max) - log(sum)``, each
    part possibly rounded to the output's type (a CPU's narrow kernel rounds ``x - max`` first): its error is at most
    ``u_out (2 |out| + 2 log n)``, which moves its exponential by as much relatively; plus the check's float32
    exponentials and sum. In a narrow type that is loose: a row shifted by 1e-2 is found in float32 and float16, not in
    bfloat16."""
    if not out.is_floating_point() or out.numel() == 0:
        return None
    n = out.size(dim)
    wide = _F64 if out.dtype == _F64 else torch.float32
    values = out.detach().to(wide)
    exponentials = values.exp()
    sums = exponentials.sum(dim)
    spread = (exponentials * (2 * values.abs() + 2 * math.log(n))).nan_to_num(0.0).sum(dim)
    live = torch.isfinite(x.detach()).any(dim)
    u = _u(wide)
    allowed = _u(out.dtype) * spread * _WIDENED + 2 * u + 2 * gamma(n + 1, u)
    return worst_excess(torch.where(live, sums - 1, torch.zeros_like(sums)), allowed)


def _arg(args: tuple, kwargs: dict, position: int, name: str, default=None):
    if position < len(args):
        return args[position]
    return kwargs.get(name, default)


def _linear(args, kwargs, out, math_, share):
    return linear_checksum(_arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "weight"),
                           _arg(args, kwargs, 2, "bias"), out, math_, share)


def _matmul(args, kwargs, out, math_, share):
    return product_checksum(_arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "other"), out, None, math_)


def _addmm(args, kwargs, out, math_, share):
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    if not isinstance(beta, (int, float)) or not isinstance(alpha, (int, float)):
        return None
    # input, mat1, mat2 (addmm) or input, batch1, batch2 (baddbmm); a Tensor method's self is the input
    return product_checksum(_arg(args, kwargs, 1, "mat1", kwargs.get("batch1")),
                            _arg(args, kwargs, 2, "mat2", kwargs.get("batch2")), out,
                            _arg(args, kwargs, 0, "input"), math_, float(beta) * share, float(alpha))


def _conv(args, kwargs, out, math_, share):
    settings = tuple(_arg(args, kwargs, i, name, default) for i, name, default in
                     ((3, "stride", 1), (4, "padding", 0), (5, "dilation", 1), (6, "groups", 1)))
    return conv_checksum(_arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "weight"),
                         _arg(args, kwargs, 2, "bias"), out, settings, math_)


def _softmax(args, kwargs, out, math_, share):
    dim = _arg(args, kwargs, 1, "dim")
    if not isinstance(dim, int):
        return None
    return softmax_row_sums(_arg(args, kwargs, 0, "input"), out, dim)


def _log_softmax(args, kwargs, out, math_, share):
    dim = _arg(args, kwargs, 1, "dim")
    if not isinstance(dim, int):
        return None
    return log_softmax_row_sums(_arg(args, kwargs, 0, "input"), out, dim)


_PRODUCTS = {"torch.nn.functional.linear": _linear,
             "torch.matmul": _matmul, "torch.Tensor.matmul": _matmul, "torch.Tensor.__matmul__": _matmul,
             "torch.mm": _matmul, "torch.spmm": _matmul, "torch.Tensor.mm": _matmul, "torch.bmm": _matmul,
             "torch.Tensor.bmm": _matmul, "torch.addmm": _addmm, "torch.Tensor.addmm": _addmm,
             "torch.baddbmm": _addmm, "torch.Tensor.baddbmm": _addmm}
_CONVS = {f"torch.nn.functional.conv{n}d": _conv for n in _CONVOLUTIONS}
_SOFTMAXES = {"torch.nn.functional.softmax": _softmax, "torch.softmax": _softmax, "torch.Tensor.softmax": _softmax,
              "torch.nn.functional.log_softmax": _log_softmax, "torch.log_softmax": _log_softmax,
              "torch.Tensor.log_softmax": _log_softmax}
def in_place(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a sampled elementwise call writes its first argument (``silu(x, inplace=True)``; an in-place foreach
    op, the tensors of its first list; a fused Adam, its parameters and moments)."""
    if name in FOREACH or name in FUSED_ADAM:
        return name.endswith("_")
    return name == "torch.nn.functional.silu" and bool(_arg(args, kwargs, 1, "inplace", False))


# The magnitudes of the terms a sum adds, in float64 on the host: an optimizer's update is small beside what it
# updates, and the sum's roundings before the result's own are relative to its terms (``sampled_reference``'s
# "terms" bound), not to its inputs, which may be ten times the result (the first moment's first step: a tenth of
# the gradient).
def _sum_terms(x, y, alpha=1):
    return abs(x) + abs(alpha * y)


def _product_terms(x, t1, t2, value=1):
    return abs(x) + abs(value * t1 * t2)


def _quotient_terms(x, t1, t2, value=1):
    return abs(x) + abs(value * t1 / t2)


def _lerp_terms(start, end, weight):
    return abs(start) + abs(weight * (end - start))


# An optimizer's foreach kernels (``torch._foreach_<op>``, in place with a trailing underscore): each index of its
# lists is one elementwise call of the op's per-tensor function. One index per call is sampled, turning with the
# rotation, so that over a run's steps every parameter's update is checked. The per-tensor function, and for a sum
# its terms' magnitudes.
_FOREACH_OPS: dict[str, tuple[Callable, Callable | None]] = {
    "add": (torch.add, _sum_terms), "sub": (torch.sub, _sum_terms), "mul": (torch.mul, None),
    "div": (torch.div, None), "addcmul": (torch.addcmul, _product_terms), "addcdiv": (torch.addcdiv, _quotient_terms),
    "lerp": (torch.lerp, _lerp_terms), "sqrt": (torch.sqrt, None), "exp": (torch.exp, None),
    "reciprocal": (torch.reciprocal, None), "maximum": (torch.maximum, None), "minimum": (torch.minimum, None),
}
_FOREACH_VALUE = frozenset(("addcmul", "addcdiv"))  # their fourth argument is the per-tensor function's ``value=``
FOREACH = frozenset(f"torch._foreach_{op}{suffix}" for op in _FOREACH_OPS for suffix in ("", "_"))


@dataclasses.dataclass(frozen=True)
class ElementCall:
    """One index of a foreach call as the per-tensor call it stands for, and the rotation of its sample."""

    func: Callable
    args: tuple
    kwargs: dict
    out: torch.Tensor
    rotation: int
    place: str = ""  # which index of the lists, and its shape: which parameter, for an optimizer

    def tensors(self) -> list[torch.Tensor]:
        """Its tensor arguments and its result."""
        return [*(a for a in (*self.args, *self.kwargs.values()) if isinstance(a, torch.Tensor)), self.out]


def foreach_element(name: str, args: tuple, kwargs: dict, result, rotation: int) -> ElementCall | None:
    """The index ``rotation`` (modulo the lists' length) of a call of foreach op ``name``; ``result``: the call's (a
    list; None for an in-place op, whose first list holds its results). None where the call does not take that
    form: lists passed by keyword or of unequal lengths, a ``value`` held on the device (reading it would wait)."""
    op = name.removeprefix("torch._foreach_")
    func, _ = _FOREACH_OPS[op.rstrip("_")]
    first = args[0] if args else None
    if not isinstance(first, (list, tuple)) or not first:
        return None
    count = len(first)
    index = rotation % count
    picked: list = []
    for value in args:
        if isinstance(value, (list, tuple)):
            if len(value) != count:
                return None
            value = value[index]
        picked.append(value)
    element_kwargs = {key: value[index] if isinstance(value, (list, tuple)) else value for key, value in kwargs.items()}
    if op.rstrip("_") in _FOREACH_VALUE and len(picked) > 3:
        value = picked.pop(3)
        if isinstance(value, torch.Tensor):  # the scalars of every index, as a tensor on the CPU
            if not value.is_cpu:
                return None
            value = value.reshape(-1)[index if value.numel() == count else 0].item()
        element_kwargs["value"] = value
    out = picked[0] if op.endswith("_") else \
        result[index] if isinstance(result, (list, tuple)) and len(result) == count else None
    if not isinstance(out, torch.Tensor):
        return None
    return ElementCall(func, tuple(picked), element_kwargs, out, rotation // count, list_place(index, count, out))


def list_place(index: int, count: int, tensor: torch.Tensor) -> str:
    """Where a foreach or fused call's sample was: "parameter 3 of 39, 512x1376" (an optimizer's lists are its
    parameters, in ``param_groups`` order)."""
    return f"parameter {index} of {count}, {'x'.join(map(str, tensor.shape)) or 'scalar'}"


# ``torch._foreach_norm`` (``clip_grad_norm_``'s gradient norms): one index of its list per call, turning with the
# rotation, its norm computed again on the device by ``vector_norm`` (another kernel) and compared within what any
# summation order of either may give.
FOREACH_NORM = "torch._foreach_norm"
_NORM_ORDERS = (1.0, 2.0, math.inf)


def foreach_norm_excess(args: tuple, kwargs: dict, result, rotation: int) -> tuple[torch.Tensor, str] | None:
    """``(excess, place)`` of index ``rotation`` (modulo the list's length) of a ``_foreach_norm`` call: its norm
    against ``vector_norm`` of the same tensor, accumulated in float32 (float64 for float64), in the bound of both
    sums in any order (Higham 4.2: ``gamma_n`` relative for ``n`` terms of one sign; a 2-norm's square root halves
    it), the roundings of the squares, the square roots and the result's dtype. The max-norm is exact but for the
    result's rounding. None for the forms not checked: another order, lists that do not line up, an empty tensor,
    (DTensors: the caller's)."""
    tensors = _arg(args, kwargs, 0, "self")
    order = _arg(args, kwargs, 1, "ord", 2)
    if not isinstance(tensors, (list, tuple)) or not tensors or not isinstance(result, (list, tuple)) or \
            len(result) != len(tensors) or not isinstance(order, (int, float)) or float(order) not in _NORM_ORDERS:
        return None
    index = rotation % len(tensors)
    x, out = tensors[index], result[index]
    if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor) or x.numel() == 0 or \
            x.layout is not torch.strided or not out.is_floating_point():
        return None
    order, n = float(order), x.numel() * (2 if x.is_complex() else 1)
    wide = _F64 if x.dtype in (_F64, torch.complex128) else torch.float32
    u, u_out = _u(wide), _u(out.dtype)  # the device's sum and the check's: both accumulate in ``wide``
    with torch.no_grad():
        expected = torch.linalg.vector_norm(x.detach(), order, dtype=wide if not x.is_complex() else None).to(wide)
        if order == math.inf:
            relative = u_out
        elif order == 1.0:  # two sums in any order
            relative = 2 * gamma(n + 1, u) + u_out
        else:  # per side: the squares rounded and summed in any order (halved by the square root), the root
            relative = gamma(n + 1, u) + 4 * u + u_out
        magnitude = torch.maximum(expected, out.detach().to(wide).abs())
        allowed = magnitude * relative * _WIDENED + torch.finfo(out.dtype).tiny
        return worst_excess(out.detach().to(wide) - expected, allowed), list_place(index, len(tensors), x)


# The fused Adam kernels (``torch.optim.Adam``/``AdamW(fused=True)``, transformers' Trainer's default optimizer):
# name -> whether the weight decay is decoupled (AdamW's)
_FUSED_ADAMS = {"torch._fused_adam_": False, "torch._fused_adamw_": True}
FUSED_ADAM = frozenset(_FUSED_ADAMS)
_ADAM_HYPER = ("lr", "beta1", "beta2", "weight_decay", "eps")


def fused_adam_element(name: str, args: tuple, kwargs: dict, rotation: int) -> sampled_reference.AdamElement | None:
    """The index ``rotation`` (modulo the lists' length) of a fused Adam call: its parameter, gradient, moments and
    step, ``amsgrad``'s running maximum and GradScaler's scale and inf flag where given, and its hyperparameters.
    None for the forms not checked: a learning rate held in a tensor (``capturable``), lists that do not line up."""
    scale, found_inf = kwargs.get("grad_scale"), kwargs.get("found_inf")
    if len(args) < 6 or \
            any(t is not None and not (isinstance(t, torch.Tensor) and t.numel() == 1) for t in (scale, found_inf)):
        return None
    params, grads, exp_avgs, exp_avg_sqs, maxima, steps = args[:6]
    amsgrad = bool(kwargs.get("amsgrad"))
    lists = (params, grads, exp_avgs, exp_avg_sqs, steps, *((maxima,) if amsgrad else ()))
    if not all(isinstance(values, (list, tuple)) for values in lists) or not params or \
            any(len(values) != len(params) for values in lists):
        return None
    hyper = {key: kwargs.get(key) for key in _ADAM_HYPER}
    if not all(type(value) in (int, float) for value in hyper.values()):
        return None
    index = rotation % len(params)
    return sampled_reference.AdamElement(
        params[index], grads[index], exp_avgs[index], exp_avg_sqs[index], steps[index],
        {**hyper, "maximize": bool(kwargs.get("maximize")), "decoupled": _FUSED_ADAMS[name]},
        rotation // len(params), list_place(index, len(params), params[index]), scale, found_inf,
        maxima[index] if amsgrad else None)


def _elementwise(func, args, kwargs, out, rotation, cancelling=False, taken=None, terms=None):
    if not taken and (kwargs.get("inplace") or any(a is out for a in args)):  # its input is gone: nothing to rerun
        return None
    if kwargs.get("rounding_mode") is not None:  # a floor or truncation: the float64 quotient may round across it
        return None
    return sampled_reference.elementwise_sample(func, args, kwargs, out, rotation, cancelling, taken, terms)


def _cancelling(func, args, kwargs, out, rotation, taken=None):
    return _elementwise(func, args, kwargs, out, rotation, cancelling=True, taken=taken)


def _norm(func, args, kwargs, out, rotation, rms=False, taken=None):
    x, shape = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "normalized_shape")
    if not isinstance(x, torch.Tensor) or not isinstance(shape, (tuple, list, torch.Size, int)):
        return None
    normalized = (shape,) if isinstance(shape, int) else tuple(int(n) for n in shape)
    eps = _arg(args, kwargs, 3 if rms else 4, "eps", None if rms else 1e-5)
    return sampled_reference.norm_sample(func, x, normalized, _arg(args, kwargs, 2, "weight"),
                                         None if rms else _arg(args, kwargs, 3, "bias"), eps, out, rotation, rms)


def normalized_dims(name: str, args: tuple, kwargs: dict) -> int | None:
    """How many trailing dimensions a norm call normalises over (None: not a norm, or not known)."""
    if SAMPLED.get(name) not in (_norm, _rms_norm):
        return None
    shape = _arg(args, kwargs, 1, "normalized_shape")
    return 1 if isinstance(shape, int) else len(shape) if isinstance(shape, (tuple, list, torch.Size)) else None


def _rms_norm(func, args, kwargs, out, rotation, taken=None):
    return _norm(func, args, kwargs, out, rotation, rms=True)


def _module_rms_norm(func, args, kwargs, out, rotation, taken=None):
    """A transformers RMSNorm module's forward whose code is Llama's (``module_norms``): ``weight * (x *
    rsqrt(mean(x^2) + eps))``, its statistic in float32 and its normalised value rounded to ``x``'s type before the
    weight's product: one rounding of a narrow type more than the result's own. A weight of another type than ``x``
    (the result promoted): not covered."""
    module, x = (*args, None, None)[:2]
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if kwargs or not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor) or \
            not isinstance(eps, (int, float)) or x.dim() == 0 or weight.shape != x.shape[-1:]:
        return None
    return sampled_reference.norm_sample(torch.nn.functional.rms_norm, x, (x.size(-1),), weight, None, float(eps),
                                         out, rotation, rms=True, narrow_roundings=1)


_LLAMA_RMS_NORM = "transformers.models.llama.modeling_llama.LlamaRMSNorm.forward"


def _same_code(function, reference) -> bool:
    """Whether two functions compute alike: the same bytecode, constants and names (not their lines or file)."""
    code, other = getattr(function, "__code__", None), reference.__code__
    return code is not None and (code.co_code, code.co_consts, code.co_names) == \
        (other.co_code, other.co_consts, other.co_names)


def module_norms() -> tuple[str, ...]:
    """transformers' RMSNorm modules loaded now whose forward is Llama's, token for token (transformers copies it into
    each model's module: ``MistralRMSNorm``, ``Qwen2RMSNorm``, ...), by the names the tools report their forwards
    under. Their arithmetic (``pow``, ``mean``, ``rsqrt``, ``mul``) is not wrapped by default (hundreds of calls a
    step), so the module's forward is checked whole, as ``rms_norm``. Only models' modules already loaded are looked at
    (Llama's is imported for its code, once, when another model's is loaded): a model's module loaded after the tool
    started is not seen. A norm of another formula (Gemma's ``1 + weight``) is not Llama's code."""
    loaded = tuple(sorted(name for name in list(sys.modules)
                          if name.startswith("transformers.models.") and ".modeling_" in name))
    return _norms_in(loaded) if loaded else ()


@functools.lru_cache(maxsize=8)
def _norms_in(loaded: tuple[str, ...]) -> tuple[str, ...]:
    try:
        reference = function_from_name(_LLAMA_RMS_NORM)[2]
    except (ValueError, ImportError):  # a transformers without Llama: nothing known to be its formula
        return ()
    reference = getattr(reference, "__wrapped__", reference)  # a tool's wrapper, started before this one
    found = []
    for module_name in loaded:
        for cls in list(vars(sys.modules[module_name]).values()):
            if not (isinstance(cls, type) and cls.__name__.endswith("RMSNorm") and
                    issubclass(cls, torch.nn.Module) and cls.__module__ == module_name):
                continue
            forward = vars(cls).get("forward")
            forward = getattr(forward, "__wrapped__", forward)  # a tool's wrapper's function
            name = f"{module_name}.{cls.__qualname__}.forward"
            if _same_code(forward, reference) and resolve_op_name(forward) == name:
                found.append(name)
                SAMPLED.setdefault(name, _module_rms_norm)
                KINDS.setdefault(name, "float64 rerun of a sample")
    return tuple(found)


_ARITHMETIC = ("mul", "add", "sub", "div")
_UNARY = ("sigmoid", "tanh", "exp", "log", "sqrt", "rsqrt")
# op name -> sample(func, args, kwargs, result, rotation, taken) -> (device values, sampled_reference.Recipe) or None:
# a sample of the result rerun on the host in float64 (sampled_reference.py); ``taken``: an in-place call's input
# sample, taken before it ran
SAMPLED: dict[str, Callable] = {
    **{f"torch.{op}": _elementwise for op in _ARITHMETIC + _UNARY},
    **{f"torch.Tensor.{op}": _elementwise for op in _ARITHMETIC + _UNARY},
    # the other operators reach the tools under their method's name (x * y as torch.Tensor.mul)
    **{f"torch.Tensor.__{op}__": _elementwise for op in ("rsub", "rtruediv")},
    "torch.nn.functional.silu": _elementwise, "torch.nn.functional.gelu": _cancelling,
    "torch.nn.functional.layer_norm": _norm, "torch.nn.functional.rms_norm": _rms_norm,
    # a foreach op's sample is of one index's per-tensor call (``foreach_element``), which the tool passes on
    **{name: functools.partial(_elementwise, terms=_FOREACH_OPS[name.removeprefix("torch._foreach_").rstrip("_")][1])
       for name in sorted(FOREACH)},
}


def _present(name: str) -> bool:
    try:
        function_from_name(name)
    except ValueError:
        return False
    return True


# collectives checked by their checksums across ranks (collective_checksum.py)
COLLECTIVES = frozenset(f"torch.distributed.{name}" for name in (
    "all_reduce", "reduce", "broadcast", "reduce_scatter_tensor", "reduce_scatter_single", "all_gather_into_tensor",
    "all_gather_single", "all_to_all_single"))
ELEMENTWISE = (_elementwise, _cancelling)  # the samplers of elementwise ops: valid on DTensors' local tensors alike
# op name (as the tools name calls) -> check(args, kwargs, result, device math) -> excess or None
CHECKS: dict[str, Callable] = {**_PRODUCTS, **_CONVS, **_SOFTMAXES}
# The functions a tool wraps by default (targeted dispatch, no mode seeing every call): those of CHECKS that can be
# wrapped under their own name (@ reaches the tools as Tensor.matmul's call; torch.spmm, torch.mm's twin, is sparse's),
# and the functional activations and norms. The arithmetic operators and unary functions are checked when a LIST
# names them: every handled call costs the engine's dispatch (tens of µs), budget or not, and a step makes hundreds.
# Only those this torch has: torch 2.11 has no all_gather_single nor reduce_scatter_single.
WRAPPED = tuple(name for name in (
    *(name for name in CHECKS if name not in ("torch.spmm", "torch.Tensor.__matmul__")),
    "torch.nn.functional.silu", "torch.nn.functional.gelu", "torch.nn.functional.layer_norm",
    "torch.nn.functional.rms_norm", *sorted(COLLECTIVES), *sorted(FOREACH), *sorted(FUSED_ADAM), FOREACH_NORM)
    if _present(name))
# the checks that hold on a DTensor's local tensors (each rank's part of a sharded product is a product)
LOCAL = frozenset(_PRODUCTS)
# the argument each product adds (position, keyword): a DTensor's local result may hold a share of it
ADDENDS = {**{name: (2, "bias") for name in ("torch.nn.functional.linear", *_CONVS)},
           **{name: (0, "input") for name in ("torch.addmm", "torch.Tensor.addmm", "torch.baddbmm",
                                              "torch.Tensor.baddbmm")}}
# what each check is called in a finding
KINDS = {**{name: "column checksum" for name in _PRODUCTS}, **{name: "channel checksum" for name in _CONVS},
         **{name: "row sums" for name in _SOFTMAXES},
         **{name: "float64 rerun of a sample" for name in (*SAMPLED, *FUSED_ADAM)},
         **{name: "sums across ranks" for name in COLLECTIVES}, FOREACH_NORM: "norm computed again"}


def check(name: str, args: tuple, kwargs: dict, result, math_: DeviceMath, share: float = 1.0) -> torch.Tensor | None:
    """The excess of a call of ``name`` (a 0-d tensor on its device), or None: no invariant for it, or for these
    arguments. ``share``: the part of its addend (bias, input) the result holds (a DTensor's local ``Partial``
    result holds ``1 / ranks`` of a replicated bias)."""
    checker = CHECKS.get(name)
    if checker is None or not isinstance(result, torch.Tensor):
        return None
    device = result.device.type
    # the check's own products run as written: not cast by the user's autocast region
    with torch.no_grad(), torch.autocast(device, enabled=False) if _autocasts(device) else contextlib.nullcontext():
        return checker(args, kwargs, result, math_, share)


def _autocasts(device: str) -> bool:
    try:
        return autocast_enabled(device)
    except RuntimeError:  # a device type autocast does not know
        return False
