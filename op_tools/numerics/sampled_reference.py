"""A sample of a call's result recomputed on the host in float64: the invariant of ops that have no cheap algebraic
one (elementwise ops, activations, normalisations).

At the call, on the device: a few elements (elementwise ops) or rows (normalisations) of the result are gathered with
the input elements they come from (``take``, ``index_select``: a few small kernels, no copy of the tensors); they
travel to the host with the tool's other results (``device_readback.py``, no synchronisation). When they have
arrived, the host reruns the op on them in float64 and bounds the difference by what rounding allows the device:
the result's own rounding plus ``SLACK`` units of the type it is computed in (float32 for a narrow result: a GPU's
transcendental functions are within a few of its ulps), relative to the result (or, for an op whose result may cancel,
the values it is made from), plus what a normalisation's float32 statistics may err by.

The reference runs on the host, not on the hardware under suspicion, and needs no float64 on the device (many NPUs
have none). Which elements are sampled depends on the call's shape and a rotation (the check's count), never on
values or on a random stream. What a sample misses: a wrong element outside it (a flipped bit lands in a sample of 16
of a million elements one time in 60,000).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import torch

from .rounding_bounds import gamma

ELEMENTS = 16  # sampled per elementwise call
ROWS = 2  # sampled per normalisation
ROTATIONS = 8  # different samples of one call site, in turn
SLACK = 8  # ulps of the result a device's elementwise kernel may differ from the correctly rounded value by
_F64 = torch.float64
_HOST = torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What the host needs to rerun a sample: the function, the arguments with each sampled tensor replaced by its
    slot (an index into the values read back), and the values' sizes and shapes."""

    func: Callable
    args: tuple
    kwargs: dict
    shapes: tuple[tuple[int, ...], ...]  # of each slot; the last is the result's sample
    out_dtype: torch.dtype
    kind: str  # "elementwise", "cancelling" (an elementwise op whose result may cancel: bounded by its inputs),
    # "terms" (a sum whose terms ``terms`` gives: its roundings bounded by their magnitudes),
    # "layer_norm", "rms_norm"
    width: int = 0  # a normalisation's reduction length
    weight_slot: int | None = None
    bias_slot: int | None = None
    scalars: int = 0  # Python float arguments: a kernel may round each to the result's type first
    terms: Callable | None = None  # for "terms": the sum of the terms' magnitudes, from the arguments in float64
    slack: int = SLACK  # ulps of the computing type the kernel's own roundings may add (a longer chain: more)
    # a normalisation's roundings to a narrow result's type before the result's own (its statistic, reciprocal root
    # and normalised value, as torch 2.4's rms_norm rounds them; transformers' RMSNorm only the normalised value)
    narrow_roundings: int = 3


@dataclasses.dataclass(frozen=True)
class _Slot:
    index: int


def _unravel(position: int, shape: torch.Size) -> list[int]:
    coords = []
    for size in reversed(shape):
        position, c = divmod(position, size)
        coords.append(c)
    return coords[::-1]


@functools.lru_cache(maxsize=512)
def _element_indices(out_shape: tuple[int, ...], in_shapes: tuple[tuple[int, ...], ...],
                     rotation: int) -> tuple[tuple[int, ...], ...]:
    """Row-major positions of ``ELEMENTS`` result elements spread over the result, and of the input elements each
    comes from (an input broadcast to the result: its size-1 and missing dimensions read position 0)."""
    total = math.prod(out_shape)
    count = min(ELEMENTS, total)
    step = total / count
    positions = sorted({int(j * step + rotation * step / ROTATIONS) % total for j in range(count)})
    found = []
    for shape in in_shapes:
        strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        lead = len(out_shape) - len(shape)
        found.append(tuple(sum(c * s for c, s, n in zip(_unravel(p, torch.Size(out_shape))[lead:], strides, shape)
                               if n != 1) for p in positions))
    return (*found, tuple(positions))


class _IndexCache:
    """The index tensors of a sample, on its device, made once per (shapes, rotation, device): a call site's calls
    repeat their shapes, so the indices cross to the device once, not per check."""

    def __init__(self) -> None:
        self._made: dict = {}

    def get(self, key, device: torch.device, values: tuple[tuple[int, ...], ...]) -> list[torch.Tensor]:
        made = self._made.get((key, device))
        if made is None:
            if len(self._made) > 1024:
                self._made.clear()
            # built on the host and copied without blocking: a tensor made on the device from a list is a blocking
            # copy, a synchronisation per new sample shape (10 to 15 a step with every call checked)
            joined = torch.tensor([v for part in values for v in part], dtype=torch.long).to(device, non_blocking=True)
            made = list(joined.split([len(part) for part in values]))
            self._made[(key, device)] = made
        return made


_INDICES = _IndexCache()


def _floating(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def positions(shape: tuple[int, ...], rotation: int) -> tuple[int, ...]:
    """The row-major positions sampled in a result of ``shape`` at ``rotation``."""
    return _element_indices(tuple(shape), (), rotation % ROTATIONS)[-1]


def _sampled_index(t: torch.Tensor, rotation: int) -> torch.Tensor:
    """The positions sampled in a tensor shaped like ``t`` at ``rotation``, as an index on its device (cached)."""
    (index,) = _INDICES.get(("elementwise", tuple(t.shape), (), rotation % ROTATIONS), t.device,
                            (positions(tuple(t.shape), rotation),))
    return index


def taken_before(t: torch.Tensor, rotation: int) -> torch.Tensor:
    """An in-place call's input at the positions its result will be sampled at: taken before the call writes it."""
    return torch.take(t.detach(), _sampled_index(t, rotation))


def elementwise_sample(func: Callable, args: tuple, kwargs: dict, out: torch.Tensor, rotation: int,
                       cancelling: bool = False, taken: dict | None = None,
                       terms: Callable | None = None) -> tuple[list[torch.Tensor], Recipe] | None:
    """The sampled elements of an elementwise call (its floating tensor arguments broadcast to ``out``) and the
    recipe to rerun them; None where it does not apply (no floating result, an argument on another device that is not
    a scalar, an input wider than the result: an autocast's cast, which the sample cannot see). ``cancelling``: the
    op's result may be far smaller than its inputs through cancellation (gelu of a negative input): it is bounded
    relative to them. ``taken``: {argument position: its sample taken before the call} for an in-place call's input
    (``taken_before``). ``terms``: the op is a sum, and ``terms(*args, **kwargs)`` (in float64 on the host) the sum of
    its terms' magnitudes, which bound its roundings before the result's own."""
    if not _floating(out) or out.numel() == 0:
        return None
    taken = taken or {}
    flat = [*args, *kwargs.values()]
    tensors = [(k, t) for k, t in enumerate(flat) if isinstance(t, torch.Tensor)]
    sampled = []
    kept = list(flat)
    for k, t in tensors:
        if t.device != out.device:
            if t.numel() != 1:
                return None
            kept[k] = t.detach().to(_HOST)  # a CPU scalar tensor: as it is
            continue
        if not t.is_floating_point() or torch.finfo(t.dtype).bits > torch.finfo(out.dtype).bits:
            return None
        sampled.append((k, t))
    if not sampled:
        return None
    rotation %= ROTATIONS
    in_shapes = tuple(tuple(t.shape) for _, t in sampled)
    indices = _element_indices(tuple(out.shape), in_shapes, rotation)
    device_indices = _INDICES.get(("elementwise", tuple(out.shape), in_shapes, rotation), out.device, indices)
    values = [taken[k] if k in taken else torch.take(t.detach(), i) for (k, t), i in zip(sampled, device_indices)]
    values.append(torch.take(out.detach(), device_indices[-1]))
    for slot, (k, _) in enumerate(sampled):
        kept[k] = _Slot(slot)
    shapes = tuple((len(i),) for i in indices)
    recipe = Recipe(func, tuple(kept[:len(args)]), dict(zip(kwargs, kept[len(args):])), shapes, out.dtype,
                    "terms" if terms is not None else "cancelling" if cancelling else "elementwise",
                    scalars=sum(type(a) is float for a in flat), terms=terms)
    return values, recipe


@dataclasses.dataclass(frozen=True)
class AdamElement:
    """One index of a fused Adam call (``invariants.fused_adam_element``): the tensors it updates in place, what it
    reads, and its hyperparameters (``lr``, ``beta1``, ``beta2``, ``weight_decay``, ``eps``, ``maximize``,
    ``decoupled``)."""

    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor
    hyper: dict
    rotation: int
    place: str = ""  # which parameter (``invariants.list_place``)
    grad_scale: torch.Tensor | None = None  # GradScaler's: the gradient is divided by it
    found_inf: torch.Tensor | None = None  # GradScaler's: nonzero, the update is skipped
    max_exp_avg_sq: torch.Tensor | None = None  # ``amsgrad``'s running maximum of the second moment

    def written(self) -> list[torch.Tensor]:
        """What the call writes (its parameter, moments and ``amsgrad``'s maximum), in the sample's order."""
        return [self.param, self.exp_avg, self.exp_avg_sq, *(() if self.max_exp_avg_sq is None else
                                                              (self.max_exp_avg_sq,))]

    def tensors(self) -> list[torch.Tensor]:
        """The tensors of the lists at its index: what it writes, and the gradient."""
        return [*self.written(), self.grad]


ADAM_SLACK = 32  # a fused Adam's update is a chain of some ten float32 roundings (moments, square root, quotient)


def adam_taken_before(element: AdamElement) -> list[torch.Tensor]:
    """A fused Adam call's parameter, moments (and maximum) and gradient at the positions its sample will be of,
    before it runs (it writes all but the gradient)."""
    index = _sampled_index(element.param, element.rotation)
    return [torch.take(t.detach(), index) for t in element.tensors()]


def adam_sample(element: AdamElement, taken: list[torch.Tensor]) -> tuple[list[torch.Tensor], Recipe] | None:
    """The sample of a fused Adam call (``taken``: ``adam_taken_before``'s) and the recipe that reruns its update on
    the host in float64 (``adam_update``): the parameter, first and second moments (and ``amsgrad``'s maximum) after
    it, joined; None where the moments' or gradient's layout differs from the parameter's."""
    param = element.param
    written = element.written()
    if not _floating(param) or param.numel() == 0 or any(t.shape != param.shape for t in element.tensors()):
        return None
    index = _sampled_index(param, element.rotation)
    after = torch.cat([torch.take(t.detach(), index) for t in written])
    # copies of the step and of GradScaler's scalars: the values are joined when their batch is sent, after the next
    # step has added 1 to the step
    scalars = {name: t for name, t in (("grad_scale", element.grad_scale), ("found_inf", element.found_inf))
               if t is not None}
    values = [*taken, *(t.detach().reshape(1).clone() for t in (element.step, *scalars.values())), after]
    count, sampled = len(index), len(taken)  # sampled: param, exp_avg, exp_avg_sq, [maximum,] grad
    shapes = ((count,),) * sampled + ((1,),) * (1 + len(scalars)) + ((len(written) * count,),)
    kwargs = {**element.hyper, **{name: _Slot(sampled + 1 + k) for k, name in enumerate(scalars)}}
    if element.max_exp_avg_sq is not None:
        kwargs["max_exp_avg_sq"] = _Slot(3)
    args = (_Slot(0), _Slot(1), _Slot(2), _Slot(sampled - 1), _Slot(sampled))  # param, moments, grad, step
    recipe = Recipe(adam_update, args, kwargs, shapes, param.dtype, "terms", terms=adam_terms, slack=ADAM_SLACK)
    return values, recipe


def _adam_moments(param, exp_avg, exp_avg_sq, grad, step, lr, beta1, beta2, weight_decay, eps, maximize, decoupled,
                  grad_scale=None, max_exp_avg_sq=None):
    if grad_scale is not None:
        grad = grad / grad_scale
    grad = -grad if maximize else grad
    if not decoupled:
        grad = grad + weight_decay * param
    exp_avg = exp_avg + (1 - beta1) * (grad - exp_avg)
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
    maximum = exp_avg_sq if max_exp_avg_sq is None else torch.maximum(max_exp_avg_sq, exp_avg_sq)
    step_size = lr / (1 - beta1 ** step)
    denominator = maximum.sqrt() / math.sqrt(1 - beta2 ** step) + eps
    decay = lr * weight_decay * param if decoupled else 0 * param
    moments = [exp_avg, exp_avg_sq, *(() if max_exp_avg_sq is None else (maximum,))]
    return grad, moments, decay, step_size * exp_avg / denominator


def adam_update(param, exp_avg, exp_avg_sq, grad, step, found_inf=None, **hyper) -> torch.Tensor:
    """A fused Adam's update as PyTorch defines it (``torch.optim.adam``/``adamw``, ``FusedAdam``), in the arguments'
    type: the parameter, first and second moments (and ``amsgrad``'s maximum) after it, joined (as they were where
    GradScaler found inf)."""
    if found_inf is not None and float(found_inf[0]) != 0:
        maximum = hyper.get("max_exp_avg_sq")
        return torch.cat([param, exp_avg, exp_avg_sq, *(() if maximum is None else (maximum,))])
    _, moments, decay, update = _adam_moments(param, exp_avg, exp_avg_sq, grad, float(step[0]), **hyper)
    return torch.cat([param - decay - update, *moments])


def adam_terms(param, exp_avg, exp_avg_sq, grad, step, found_inf=None, **hyper) -> torch.Tensor:
    """The magnitudes of the terms each of ``adam_update``'s results sums."""
    if found_inf is not None and float(found_inf[0]) != 0:
        return adam_update(param, exp_avg, exp_avg_sq, grad, step, found_inf, **hyper).abs()
    beta1, beta2 = hyper["beta1"], hyper["beta2"]
    grad, moments, decay, update = _adam_moments(param, exp_avg, exp_avg_sq, grad, float(step[0]), **hyper)
    second = beta2 * exp_avg_sq.abs() + (1 - beta2) * grad * grad
    return torch.cat([param.abs() + decay.abs() + update.abs(), beta1 * exp_avg.abs() + (1 - beta1) * grad.abs(),
                      second, *([torch.maximum(moments[2], second)] if len(moments) > 2 else [])])


def norm_sample(func: Callable, x: torch.Tensor, normalized: tuple[int, ...], weight, bias, eps, out: torch.Tensor,
                rotation: int, rms: bool, narrow_roundings: int = 3) -> tuple[list[torch.Tensor], Recipe] | None:
    """``ROWS`` rows of a layer norm's (``rms``: an RMS norm's) input and result, with its weight and bias whole;
    ``narrow_roundings``: ``Recipe``'s."""
    width = math.prod(normalized)
    if not _floating(out) or out.numel() == 0 or width == 0 or tuple(x.shape[x.dim() - len(normalized):]) != \
            tuple(normalized) or x.dtype != out.dtype:
        return None
    rows = x.numel() // width
    rotation %= ROTATIONS
    chosen = tuple(sorted({(j * rows // ROWS + rotation * rows // (ROWS * ROTATIONS)) % rows
                           for j in range(min(ROWS, rows))}))
    (index,) = _INDICES.get(("rows", chosen), out.device, (chosen,))
    values = [x.detach().reshape(rows, width).index_select(0, index),
              out.detach().reshape(rows, width).index_select(0, index)]
    shapes = [(len(chosen), *normalized), (len(chosen), *normalized)]
    slots: list = [None, None]
    for k, t in enumerate((weight, bias)):
        if isinstance(t, torch.Tensor):
            slots[k] = _Slot(len(values) - 1)
            # a copy: the values are joined only when their batch is sent, after an optimizer may have stepped
            values.insert(len(values) - 1, t.detach().reshape(-1).clone())
            shapes.insert(len(shapes) - 1, tuple(t.shape))
    args = (_Slot(0), normalized, slots[0], eps) if rms else (_Slot(0), normalized, slots[0], slots[1], eps)
    weight_slot, bias_slot = (None if slot is None else slot.index for slot in slots)
    recipe = Recipe(func, args, {}, tuple(shapes), out.dtype, "rms_norm" if rms else "layer_norm", width,
                    weight_slot=weight_slot, bias_slot=bias_slot, narrow_roundings=narrow_roundings)
    return values, recipe


def excess(recipe: Recipe, values: list[float]) -> float:
    """The largest difference between the device's sampled result and the host's float64 rerun, as a multiple of
    what rounding allows (above 1: wrong; inf where one is nan or inf and the other not the same)."""
    parts, start = [], 0
    for shape in recipe.shapes:
        size = math.prod(shape)
        parts.append(torch.tensor(values[start:start + size], dtype=_F64).reshape(shape))
        start += size
    got = parts[-1]

    def filled(value):
        return parts[value.index] if isinstance(value, _Slot) else \
            value.to(_F64) if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    args, kwargs = tuple(filled(a) for a in recipe.args), {k: filled(v) for k, v in recipe.kwargs.items()}
    with torch.no_grad():
        expected = recipe.func(*args, **kwargs)
    expected = expected.to(_F64).reshape(got.shape)
    finfo = torch.finfo(recipe.out_dtype)
    # the result rounded once, from a computation in its type or, for a narrow type, in float32 (its "opmath")
    computed = torch.finfo(torch.float32) if finfo.bits < 32 else finfo
    # plus a rounding of each Python float argument to the result's type, which a kernel may make before using it
    # (the CPU's foreach kernels do: a bfloat16 list times 0.9 is off by 1.4 of its half-ulps)
    relative = (1 + recipe.scalars) * finfo.eps / 2 + SLACK * computed.eps / 2
    magnitude = expected.abs()
    if recipe.kind == "cancelling":
        for part in parts[:-1]:
            if part.shape == got.shape:
                magnitude = torch.maximum(magnitude, part.abs())
    elif recipe.width:  # a normalisation's statistics in float32 (or the input's type), summed in any order
        u = computed.eps / 2
        relative += 2 * gamma(recipe.width, u)
        if finfo.bits < 32:
            # a kernel may round its statistic, its reciprocal root and the normalised value to a narrow input's
            # type before the result (torch 2.4's own rms_norm does: 2.4 times the bound above in bfloat16)
            relative += recipe.narrow_roundings * finfo.eps / 2
        if recipe.bias_slot is not None:
            magnitude = magnitude + 2 * parts[recipe.bias_slot].abs()
        if recipe.kind == "layer_norm":  # the mean's error, relative to the spread it is divided by
            x = parts[0].flatten(1)
            spread = (x.var(1, unbiased=False) + 1e-30).sqrt()
            scale = (x.abs().amax(1) / spread).reshape((-1,) + (1,) * (got.dim() - 1))
            weight = parts[recipe.weight_slot].abs() if recipe.weight_slot is not None else 1.0
            magnitude = magnitude + weight * scale
    allowed = relative * magnitude + finfo.tiny  # a device may flush subnormal results to zero
    if recipe.kind == "terms":  # the result rounded once; the sum's own roundings and its scalars' by its terms
        assert recipe.terms is not None  # set with the kind
        with torch.no_grad():
            terms = torch.as_tensor(recipe.terms(*args, **kwargs), dtype=_F64).reshape(-1)
        terms = terms.expand(got.shape) if terms.numel() == 1 else terms.reshape(got.shape)
        allowed = finfo.eps / 2 * magnitude + (recipe.scalars * finfo.eps / 2 + recipe.slack * computed.eps / 2) * \
            torch.maximum(terms, magnitude) + finfo.tiny
    same = (got == expected) | (torch.isnan(got) & torch.isnan(expected))
    ratio = torch.where(same, torch.zeros_like(got), (got - expected).abs() / allowed)
    ratio = torch.where(torch.isnan(ratio), torch.full_like(ratio, math.inf), ratio)
    return float(ratio.max()) if ratio.numel() else 0.0
