"""Comparing a device's results with a CPU reference: the verdict of OpAutoCompare and of the offline replay.

``compare_outputs(device_out, reference_out, same_dtype_out, tolerance)`` walks both results and
returns one ``Comparison`` per leaf (tensor, number, None, …)::

    >>> ref = torch.nn.functional.silu(x.cpu().double())           # the float64 reference
    >>> same = torch.nn.functional.silu(x.cpu())                      # a correct run in the device's dtype
    >>> [c.passed for c in compare_outputs(torch.nn.functional.silu(x), ref, same)]
    [True]

The verdict for a floating tensor, unless the user set a tolerance:

* both results are measured against the reference with a *normalised* error,
  ``max_i |x_i - ref_i| / (|ref_i| + mean|ref|)`` (elements near zero are measured against the
  tensor's typical magnitude, so cancellation in sums does not blow it up);
* the device fails when its error exceeds ``RATIO`` times the error of the same-dtype CPU run plus
  ``FLOOR_EPS`` machine epsilons of the device's dtype: a bfloat16 matmul is allowed the error a
  bfloat16 matmul has, a float32 op a few ulps;
* an op that rounds each result once (``rounded_ops.ROUNDED_ONCE``: elementwise ops, activations, casts) into
  bfloat16 or float16 is held to its dtype's rounding (``ERROR_RULES``): its error is relative,
  ``max |x - ref| / max(|ref|, ROUNDED_SHARE * mean|ref|)``, and it fails above ``ROUNDED_FLOOR_EPS`` eps, which a
  correct (half an ulp) or faithful (one ulp) result never exceeds and an element off by 2 ulps always does, unless
  the same-dtype run's own error shows the op is less exact on the CPU too (``ROUNDED_RATIO`` times it);
* when the reference is not wider than the device's dtype (a float64 device op, or an op the CPU
  cannot run in float64), the bound is ``SAME_PRECISION_FLOOR_EPS`` epsilons, at most
  ``SAME_PRECISION_FLOOR_MAX`` (a narrow dtype's 256 eps would pass anything);
* nan/inf must sit where the reference (or, for overflow, the same-dtype run) has them.

With a ``ToleranceSpec`` from the user, ``allclose(device, reference, atol, rtol)`` decides.
Integer and boolean tensors must match the reference (or the same-dtype run) exactly; shapes,
dtypes and structure that differ fail with the reason in ``error_info``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, Callable, overload

import torch

from ..ops.arguments import iter_items
from ..ops.op_facts import cached_on_facts, op_facts
from .error_statistics import error_stats, finished, normalised_error, unread_stats, wide
from .rounding_bounds import NARROW as _NARROW

RATIO = 4.0
FLOOR_EPS = 4.0
SAME_PRECISION_FLOOR_EPS = 256.0
# ... and at most this normalised error: 256 eps of bfloat16 is 2.0 (of float16, 0.25), more than any result is off
# by, so a bfloat16 result judged against a bfloat16 reference (the replay's captured output) passed anything. 1/16
# is 8 ulps of bfloat16, far beyond what two correct runs' roundings part by, far below a fault worth the name.
SAME_PRECISION_FLOOR_MAX = 1 / 16
# A result passes by the rule within 4x the error a correct run in its dtype has. Where that run errs by this much of
# the result's scale (an ill-conditioned call: the pseudo-inverse of a singular matrix, an eigenvector's free sign, a
# gradient that is rounding noise), a fault as large passes too: a weak pass (``Comparison.weak``), which OpAutoCompare
# counts apart.
WEAK_PASS = 0.1

# An op rounded once into a narrow dtype (float32 math inside its kernels): a correct element is within 1/2 ulp;
# 1 ulp is at most 1 eps relative, 2 ulps more. Elements below 2^-8 of the typical magnitude are measured against
# that (a float32 kernel's cancellation, e.g. gelu's 1 + erf(x) far left, is absolute, ~2^-24 of the magnitude).
ROUNDED_SHARE = 2.0 ** -8
ROUNDED_FLOOR_EPS = 1.0
ROUNDED_RATIO = 2.0


@dataclasses.dataclass(frozen=True)
class ErrorRule:
    """How an error is measured and bounded. ``rounded``: the relative error (``error_statistics``' ``relative``)
    within the larger of ``floor_eps`` eps and ``ratio`` times the same-dtype run's; otherwise the normalised error
    within their sum. ``modelled``: the result's rounding bound (``rounding_bounds``), element by element, decides
    instead, where the comparison is given one."""

    floor_eps: float
    ratio: float | None  # None: the op's (``ratio_for``)
    rounded: bool
    modelled: bool = False

    def bound(self, ratio: float, cpu_error: float, floor: float) -> float:
        return max(ratio * cpu_error, floor) if self.rounded else ratio * cpu_error + floor


ERROR_RULES = {
    "summed": ErrorRule(FLOOR_EPS, None, False),  # reductions, matmuls, attention: anything not rounded once
    "rounded once": ErrorRule(ROUNDED_FLOOR_EPS, ROUNDED_RATIO, True),
    # fused attention in a narrow dtype: another algorithm than the CPU's, bounded by what it rounds
    "attention": ErrorRule(FLOOR_EPS, None, False, modelled=True),
    # an embedding's (a gather's) gradient in a narrow dtype: the CPU's kernel sums in that dtype, a GPU's in float32
    "index sums": ErrorRule(FLOOR_EPS, None, False, modelled=True),
}


def error_rule(op_name: str, dtype: torch.dtype, reference_dtype: torch.dtype = torch.float64,
               backward: bool = False) -> ErrorRule:
    """The rule for one result: for a forward result in a narrow dtype against a wider reference, 'rounded once' for
    a ``rounded_ops`` op and 'attention' for one with ``op_facts``' ``attention_rounding``; in a narrow dtype, 'index
    sums' for the gradient of an op with ``index_sums`` and the result of one with ``accumulates_when`` (their bound,
    where the device's kernel has one, decides); 'summed' otherwise."""
    if dtype not in _NARROW:
        return ERROR_RULES["summed"]
    facts = op_facts(op_name)
    if facts.index_sums if backward else facts.accumulates_when is not None:
        return ERROR_RULES["index sums"]
    if not backward and _eps(reference_dtype) < _eps(dtype):
        if facts.rounded_once:
            return ERROR_RULES["rounded once"]
        if facts.attention_rounding:
            return ERROR_RULES["attention"]
    return ERROR_RULES["summed"]


# The original ditorch's per-dtype tolerances: shown as atol/rtol (and the informative allclose) when
# the user sets none; the verdict does not use them.
ORIGINAL_TOLERANCES = {torch.float16: (1e-4, 1e-4), torch.bfloat16: (1e-3, 1e-3), torch.float32: (1e-5, 1e-5),
                       torch.float64: (1e-8, 1e-8)}
_DEFAULT_TOLERANCE = (1e-3, 1e-3)
_NUMBER_TOLERANCE = 1e-6
_CPU = torch.device("cpu")

COLUMNS = ("name", "allclose", "cosine_similarity", "max_abs_diff", "max_relative_diff", "atol", "rtol",
           "device_error", "cpu_error", "error_ratio", "verdict", "error_info")


# --- tolerances ---

# <OPNAME>_AUTOCOMPARE_ERROR_TOLERANCE_<DTYPE>, both parts optional; the typo check reads it too.
TOLERANCE_VAR = re.compile(r"^(?:(?P<op>\w+?)_)?AUTOCOMPARE_ERROR_TOLERANCE(?:_(?P<dtype>[A-Z0-9]+))?$")


@overload
def parse_tolerance(text: str) -> tuple[float, float]: ...
@overload
def parse_tolerance(text: None) -> None: ...
def parse_tolerance(text: str | None) -> tuple[float, float] | None:
    """``'atol,rtol'`` -> ``(atol, rtol)``; ``None`` when unset. Raises ValueError when malformed."""
    if text is None:
        return None
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 2:
        raise ValueError("needs two numbers")
    try:
        atol, rtol = float(parts[0]), float(parts[1])
    except ValueError:
        raise ValueError("not a number") from None
    if not (atol >= 0 and rtol >= 0) or math.isinf(atol) or math.isinf(rtol):
        raise ValueError("tolerances must be finite and >= 0")
    return atol, rtol


def _tolerance_pair(value: Any) -> tuple[float, float]:
    if isinstance(value, str):
        return parse_tolerance(value)
    if not isinstance(value, (list, tuple)) or len(value) != 2 or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise TypeError(f"{value!r} is not a pair (atol, rtol)")
    return parse_tolerance(f"{value[0]!r},{value[1]!r}")


def _as_dtype(key: Any) -> torch.dtype | None:
    if isinstance(key, torch.dtype):
        return key
    dtype = getattr(torch, key.removeprefix("torch."), None) if isinstance(key, str) else None
    return dtype if isinstance(dtype, torch.dtype) else None


def op_key(op_name: str) -> str:
    """The original's per-op prefix: the last component of the name, upper-cased (``torch.nn.functional.linear``
    -> ``LINEAR``, ``torch.Tensor.add_`` -> ``ADD_``)."""
    return op_name.rsplit(".", 1)[-1].upper()


def dtype_key(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.").upper()


@dataclasses.dataclass(frozen=True)
class ToleranceSpec:
    """User tolerances ``(atol, rtol, variable)``: per op and dtype > per dtype > for every dtype.

    >>> spec = ToleranceSpec.fixed(1e-3, 1e-3)
    >>> spec.lookup("torch.add", torch.float32)
    (0.001, 0.001, 'fixed')
    """

    per_op_dtype: Mapping[tuple[str, str], tuple[float, float, str]] = dataclasses.field(default_factory=dict)
    per_dtype: Mapping[str, tuple[float, float, str]] = dataclasses.field(default_factory=dict)
    default: tuple[float, float, str] | None = None

    @classmethod
    def fixed(cls, atol: float, rtol: float) -> ToleranceSpec:
        return cls(default=(atol, rtol, "fixed"))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ToleranceSpec:
        """Every ``[<OPNAME>_]AUTOCOMPARE_ERROR_TOLERANCE[_<DTYPE>]`` variable; malformed: ValueError naming it."""
        environ = os.environ if environ is None else environ
        per_op_dtype, per_dtype, default = {}, {}, None
        for name, text in environ.items():
            match = TOLERANCE_VAR.match(name)
            if match is None:
                continue
            try:
                atol, rtol = parse_tolerance(text)
            except ValueError as e:
                raise ValueError(f"{name}={text!r}: {e}; expected 'atol,rtol', e.g. '1e-3,1e-3'") from None
            op, dtype = match.group("op"), match.group("dtype")
            if op and dtype:
                per_op_dtype[(op, dtype)] = (atol, rtol, name)
            elif dtype:
                per_dtype[dtype] = (atol, rtol, name)
            elif not op:
                default = (atol, rtol, name)
        return cls(per_op_dtype, per_dtype, default)

    @classmethod
    def from_value(cls, value: Any) -> ToleranceSpec:
        """From a Python value (an argument, the config file): ``(atol, rtol)`` for every op and dtype, or a dict
        of ``{dtype: (atol, rtol)}``, ``{"default": (atol, rtol)}`` and ``{op: {dtype: (atol, rtol)}}`` entries (dtypes
        or their names; ops by name or function). Raises ValueError/TypeError saying what is wrong."""
        if isinstance(value, ToleranceSpec):
            return value
        if not isinstance(value, Mapping):
            return cls(default=(*_tolerance_pair(value), "tolerance"))
        per_op_dtype, per_dtype, default = {}, {}, None
        for key, entry in value.items():
            dtype = _as_dtype(key)
            if dtype is not None:
                per_dtype[dtype_key(dtype)] = (*_tolerance_pair(entry), f"tolerance[{dtype_key(dtype).lower()}]")
            elif key == "default":
                default = (*_tolerance_pair(entry), "tolerance[default]")
            else:
                if callable(key):
                    from ..ops.naming import resolve_op_name

                    key = resolve_op_name(key)
                if not isinstance(key, str) or not isinstance(entry, Mapping):
                    raise TypeError(f"entry {key!r}: expected a dtype, 'default' or an op name with a dict of dtypes")
                for dtype_name, pair in entry.items():
                    dtype = _as_dtype(dtype_name)
                    if dtype is None:
                        raise ValueError(f"entry {key!r}: unknown dtype {dtype_name!r}")
                    per_op_dtype[(op_key(key), dtype_key(dtype))] = (
                        *_tolerance_pair(pair), f"tolerance[{key}][{dtype_key(dtype).lower()}]")
        return cls(per_op_dtype, per_dtype, default)

    def over(self, lower: ToleranceSpec | None) -> ToleranceSpec:
        """These tolerances, with ``lower``'s where these have none (arguments over variables over the file)."""
        if lower is None:
            return self
        return ToleranceSpec({**lower.per_op_dtype, **self.per_op_dtype}, {**lower.per_dtype, **self.per_dtype},
                             self.default or lower.default)

    def __bool__(self) -> bool:
        return bool(self.per_op_dtype or self.per_dtype or self.default)

    def lookup(self, op_name: str, dtype: torch.dtype) -> tuple[float, float, str] | None:
        key = dtype_key(dtype)
        return self.per_op_dtype.get((op_key(op_name), key)) or self.per_dtype.get(key) or self.default


# --- results ---

@dataclasses.dataclass
class Comparison:
    """One compared leaf. ``device_error``/``cpu_error`` are normalised errors against the reference."""

    name: str
    passed: bool
    allclose: bool = True
    max_abs_diff: float = 0.0
    max_relative_diff: float = 0.0
    cosine_similarity: float = 1.0
    atol: float = 0.0
    rtol: float = 0.0
    device_error: float = float("nan")
    cpu_error: float = float("nan")
    error_info: str = ""
    # the smallest error correct runs of the call's signature had, where the call passed on that precedent (no
    # same-dtype run of its own)
    precedent_error: float = float("nan")

    @property
    def weak(self) -> bool:
        """Passed within a correct run's error of ``WEAK_PASS`` or more (its own, or its signature's precedent)."""
        return self.passed and (self.cpu_error >= WEAK_PASS or self.precedent_error >= WEAK_PASS)

    @property
    def error_ratio(self) -> float:
        if math.isnan(self.cpu_error) or math.isnan(self.device_error):
            return float("nan")
        if self.cpu_error == 0:
            return 1.0 if self.device_error == 0 else float("inf")
        return self.device_error / self.cpu_error

    def row(self) -> dict:
        return {
            "name": self.name, "allclose": self.allclose, "cosine_similarity": f"{self.cosine_similarity:.9f}",
            "max_abs_diff": f"{self.max_abs_diff:.9g}", "max_relative_diff": f"{self.max_relative_diff:.9g}",
            "atol": f"{self.atol:.3g}", "rtol": f"{self.rtol:.3g}",
            # nan where the difference is nan (a nan output): a value; elsewhere nan is none measured (integers)
            "device_error": "nan" if math.isnan(self.max_abs_diff) and math.isnan(self.device_error)
            else _fmt(self.device_error),
            "cpu_error": _fmt(self.cpu_error), "error_ratio": _fmt(self.error_ratio),
            "verdict": "pass" if self.passed else "FAIL", "error_info": self.error_info,
        }


def _fmt(value: float) -> str:
    return "" if math.isnan(value) else f"{value:.3g}"


def _failure(name: str, info: str) -> Comparison:
    nan = float("nan")
    return Comparison(name, False, False, nan, nan, -1.0, nan, nan, error_info=info)


# --- the comparison ---

def compare_outputs(device_out, reference_out, same_dtype_out=None, tolerance: ToleranceSpec | None = None,
                    *, op_name: str = "", prefix: str = "", history: SameDtypeHistory | None = None,
                    key: tuple = (), bounds: Callable[[int], Any] | None = None, site: str = "",
                    read: dict | None = None) -> list[Comparison]:
    """Compare every leaf of ``device_out`` with ``reference_out`` (see the module docstring for the verdict).

    ``same_dtype_out`` is the result of a correct run in the device's own dtype (e.g. the CPU's), or a
    callable returning it, called only when the verdict needs it; ``None`` when there is none.
    ``prefix`` names the leaves (``"output"``, ``"grad"``: gradients, never 'rounded once'); each is named
    ``prefix[i]``. ``history`` (with
    ``key``, the call's signature, and ``site``, the module that ran it) lets a device error well within what a
    correct run had on the same signature pass without a same-dtype run. ``bounds(i)`` gives leaf ``i``'s rounding
    bound (``rounding_bounds``), or None: a leaf whose rule is ``modelled`` is judged by it; any other, asked only
    when about to fail, also passes within it. ``read``: the leaves' statistics already read (``PendingStats``);
    else those measured on a device are read here, in one transfer.
    """
    leaves = _leaves(device_out, reference_out)
    if leaves is None:
        return [_failure(prefix or "result", f"structure differs: device returns {_describe(device_out)}, "
                                              f"reference {_describe(reference_out)}")]
    device_leaves, reference_leaves = leaves
    same = _LazySame(same_dtype_out)
    backward = prefix.startswith("grad")
    if read is None:
        pending = launch_stats(list(zip((d for _, d in device_leaves), (r for _, r in reference_leaves))),
                               tolerance, op_name, backward)
        read = pending.read() if pending is not None else {}
    results = []
    for index, ((path, d), (_, r)) in enumerate(zip(device_leaves, reference_leaves)):
        name = f"{prefix}{path}"
        precedent = None if history is None else (history, (*key, name), site)
        leaf_bound = None if bounds is None else functools.partial(bounds, index)
        results.append(_compare_leaf(name, d, r, lambda i=index: same.leaf(i), tolerance, op_name, same.lazy,  # type: ignore[misc]  # mypy cannot type a lambda's default
                                     precedent, backward, leaf_bound, read.get(index, UNREAD)))
    return results


UNREAD = object()  # a leaf whose statistics were not read with the others: compare_tensors measures it
EQUAL = object()  # an exact leaf measured with the others: no element differs


def _leaves(device_out, reference_out) -> tuple[list, list] | None:
    """``(device leaves, reference leaves)``, each ``(path, value)``, in the order ``compare_outputs`` judges them;
    None when the two structures differ."""
    if isinstance(device_out, torch.Tensor) and isinstance(reference_out, torch.Tensor):  # most ops: no walk
        return [("[0]", device_out)], [("[0]", reference_out)]
    device_leaves = list(iter_items(_as_tuple(device_out)))
    reference_leaves = list(iter_items(_as_tuple(reference_out)))
    if [p for p, _ in device_leaves] != [p for p, _ in reference_leaves]:
        return None
    return device_leaves, reference_leaves


def output_pairs(device_out, reference_out) -> list[tuple[Any, Any]]:
    """The ``(device, reference)`` leaf pairs ``compare_outputs`` judges, by index (none when they differ in
    structure): what ``launch_stats`` measures ahead of it."""
    leaves = _leaves(device_out, reference_out)
    return [] if leaves is None else [(d, r) for (_, d), (_, r) in zip(*leaves)]


class PendingStats:
    """``error_stats``' figures of the pairs measured on a device, computed there as one ``(pairs, 7)`` tensor and
    read once (``read()``: index -> ``error_stats``' result). ``host``: that tensor, or its part of a host copy made
    later (a batch's rows joined: ``VerdictQueue.read_with``), read after the wait for it."""

    __slots__ = ("indices", "atols", "host")

    def __init__(self, indices: list[int], atols: list[float | None], host: torch.Tensor) -> None:
        self.indices, self.atols, self.host = indices, atols, host

    def read(self) -> dict:
        """Index -> ``error_stats``' result, or for an exact pair ``EQUAL`` where no element differs (else it is
        compared again)."""
        read: dict = {}
        for index, atol, values in zip(self.indices, self.atols, self.host.tolist()):
            if atol is not None:
                read[index] = finished(values, atol)
            elif values[0] == 0:
                read[index] = EQUAL
        return read


def launch_stats(pairs: Sequence[tuple[Any, Any]], tolerance: ToleranceSpec | None, op_name: str,
                 backward: bool) -> PendingStats | None:
    """The statistics of the pairs whose device value is a real tensor on a device (the first device met), with a
    reference of its shape (an exact one, of its dtype, there too: the count of elements that differ), computed there
    as one tensor: a foreach op's list, a backward's gradients, read in one transfer rather than one each (a verdict
    judged later reads it with its batch's). None when no pair is measured so."""
    rows: list[torch.Tensor] = []
    atols: list[float | None] = []
    indices: list[int] = []
    device = None
    for index, (d, r) in enumerate(pairs):
        if not (isinstance(d, torch.Tensor) and isinstance(r, torch.Tensor)) or d.is_cpu or d.shape != r.shape \
                or not d.numel() or device is not None and d.device != device:
            continue
        if not (d.is_floating_point() and r.is_floating_point()):
            if d.dtype != r.dtype or d.is_complex() or d.is_floating_point() or r.device != d.device:
                continue
            # integers, booleans, indices: how many elements differ (a sum, and no transfer of its own)
            row: torch.Tensor | None = torch.ne(d, r).sum(dtype=torch.float64).expand(7)
            atol = None
        else:
            _, atol, rtol, _, relative = _measure(d, r, tolerance, op_name, backward)
            row = unread_stats(d, r, rtol, relative)
        if row is not None:
            device = d.device
            rows.append(row)
            atols.append(atol)
            indices.append(index)
    if not rows:
        return None
    return PendingStats(indices, atols, torch.stack(rows))


def _measure(d: torch.Tensor, r: torch.Tensor, tolerance: ToleranceSpec | None, op_name: str, backward: bool):
    """How ``d`` is measured: ``(the user's tolerance entry or None, atol, rtol, error rule, relative)``."""
    user = tolerance.lookup(op_name, d.dtype) if tolerance else None
    atol, rtol = (user[0], user[1]) if user else ORIGINAL_TOLERANCES.get(d.dtype, _DEFAULT_TOLERANCE)
    rule = error_rule(op_name, d.dtype, r.dtype, backward)
    return user, atol, rtol, rule, (ROUNDED_SHARE, _tiny(d.dtype)) if rule.rounded else None


class SameDtypeHistory:
    """The same-dtype errors seen per call signature and output: a precedent for later calls of the signature.

    A correct run's error on one signature (op, shapes, dtypes, device math) is mostly of one size from call to call.
    Once two calls measured it, a device error below half the bound their smaller error gives passes without a
    same-dtype run (it could not change the verdict); any error above that still gets the exact check, so a fault
    is found as before: on the first call of its signature, and on any call where it shows.

    Not always of one size: data that cancels (a sum of terms of both signs) errs far more than data that does not,
    on the same signature. Two such calls first would hold every later one to their error, and calls passed on
    the precedent are not measured, so it would never shrink: a fault of 1% passed on well-conditioned calls for
    good. So every ``REFRESH``-th call the precedent would pass is measured all the same, and the smallest error
    follows the data: a fault the precedent hid is found within ``REFRESH`` calls of its signature.

    With a ``site`` (the module running the call) the errors are kept per site as well, and a site's own smallest
    error bounds its calls where it is larger: one signature's calls in different modules (a Llama's q, k, v and o
    projections) err by different amounts, the smallest of them holding every other to its size.
    """

    NEEDED = 2
    REFRESH = 8

    def __init__(self) -> None:
        self._seen: dict[tuple, tuple[float, int]] = {}  # key -> (smallest same-dtype error, times measured)
        self._passed: dict[tuple, int] = {}  # key -> the calls the precedent was offered for since the last measure

    def bound(self, key: tuple, site: str = "") -> float | None:
        """The precedent for a call of ``key`` (at ``site``), or None: measure this call (too few measured yet, or
        its turn to be measured again)."""
        seen = self._seen.get(key)
        found = seen[0] if seen is not None and seen[1] >= self.NEEDED else None
        at_site = self._seen.get((key, site)) if site else None
        if at_site is not None and at_site[1] >= self.NEEDED and (found is None or at_site[0] > found):
            found = at_site[0]
        if found is not None:
            offered = self._passed.get(key, 0) + 1
            self._passed[key] = offered % self.REFRESH
            if offered == self.REFRESH:
                return None
        return found

    def record(self, key: tuple, cpu_error: float, site: str = "") -> None:
        if math.isfinite(cpu_error):
            for k in ((key, (key, site)) if site else (key,)):
                smallest, count = self._seen.get(k, (cpu_error, 0))
                self._seen[k] = (min(smallest, cpu_error), count + 1)


class _LazySame:
    def __init__(self, source) -> None:
        self.source = source
        self.lazy = callable(source)
        self.leaves: list | None = None

    def leaf(self, index: int):
        if self.leaves is None:
            value = self.source() if callable(self.source) else self.source
            self.leaves = None if value is None else [v for _, v in iter_items(_as_tuple(value))]
        if self.leaves is None or index >= len(self.leaves):
            return None
        return self.leaves[index]


def _as_tuple(value) -> tuple:
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        return tuple(value)
    return (value,)


def _describe(value) -> str:
    """How many leaves ``value`` holds and how they nest: ``2 value(s) ((Tensor, Tensor))`` for a pair inside a
    tuple, which flat leaves' names alone would describe as a pair."""
    leaves = list(iter_items(_as_tuple(value)))
    return f"{len(leaves)} value(s) {_nesting(_as_tuple(value))}"


def _nesting(value, shown: int = 4) -> str:
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        inner = [_nesting(v) for v in value[:shown]] + (["..."] if len(value) > shown else [])
        return ("[{}]" if isinstance(value, list) else "({})").format(", ".join(inner))
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_nesting(v)}" for k, v in list(value.items())[:shown]) + "}"
    return type(value).__name__


def _compare_leaf(name: str, d, r, same: Callable[[], Any], tolerance: ToleranceSpec | None,
                  op_name: str, lazy: bool, precedent=None, backward: bool = False,
                  bound: Callable[[], Any] | None = None, stats: Any = UNREAD) -> Comparison:
    if d is None and (r is None or backward):
        # a gradient the backward did not ask for (``autograd.grad(loss, [w])``, ``backward(inputs=...)``): autograd
        # computes none, where the reference computes every input's
        return Comparison(name, True)
    if isinstance(d, torch.Tensor) and isinstance(r, torch.Tensor):
        return compare_tensors(name, d, r, same, tolerance, op_name, lazy, precedent, backward, bound, stats)
    if isinstance(d, torch.Tensor) and r is None or d is None and isinstance(r, torch.Tensor):
        t = d if d is not None else r
        if not t.is_floating_point() or not bool((t == 0).all()):  # type: ignore[union-attr]  # t is whichever is a tensor; an unused gradient: None or zeros alike
            return _failure(name, f"device gives {_kind(d)}, reference {_kind(r)}")
        return Comparison(name, True)
    if type(d) is not type(r) and not (isinstance(d, (int, float)) and isinstance(r, (int, float))
                                       and not isinstance(d, bool) and not isinstance(r, bool)):
        return _failure(name, f"type differs: device {type(d).__name__}, reference {type(r).__name__}")
    if isinstance(d, torch.device) and d.type != "cpu":
        d = _CPU  # through the device mapping: the reference ran on the CPU what ran on the device
    if isinstance(d, float) or isinstance(r, float):
        close = d == r or (math.isnan(d) and math.isnan(r)) or abs(d - r) <= _NUMBER_TOLERANCE * (1 + abs(r))
        diff = abs(d - r) if not (math.isnan(d) and math.isnan(r)) else 0.0
        return Comparison(name, bool(close), bool(close), diff, diff / (abs(r) + 1e-6), 1.0 if close else -1.0,
                          _NUMBER_TOLERANCE, _NUMBER_TOLERANCE,
                          error_info="" if close else f"value differs: device {d!r}, reference {r!r}")
    try:
        equal = bool(d == r)
    except Exception as e:  # noqa: BLE001 - values that cannot even be compared differ
        equal, info = False, f"cannot compare: {e}"
    else:
        info = "" if equal else f"value differs: device {d!r}, reference {r!r}"
    return Comparison(name, equal, equal, 0.0 if equal else float("nan"), 0.0 if equal else float("nan"),
                      1.0 if equal else -1.0, error_info=info)


def _kind(value) -> str:
    return "None" if value is None else f"a tensor {tuple(value.shape)}"


def _on_cpu(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    t = t.detach()
    if t.device.type == "cpu" and (dtype is None or t.dtype == dtype):
        return t
    return t.to(device=_CPU, dtype=dtype or t.dtype)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """float64 (complex: its real view in float64) on the CPU, detached and contiguous. A conjugate view (a complex
    op's gradient, ifft's result) is resolved first: its real view is refused."""
    if t.is_complex():
        return torch.view_as_real(_on_cpu(t, torch.complex128).resolve_conj()).contiguous()
    return _on_cpu(t, torch.float64).contiguous()


def _wide_pair(d: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``d`` and ``r`` in float64 where they are compared: on their device when both are on one (a reference run
    there, ``device_reference``), else on the CPU."""
    if d.device == r.device and d.device.type != "cpu":
        return wide(d), wide(r)
    return _wide(d), _wide(r)


def compare_tensors(name: str, d: torch.Tensor, r: torch.Tensor, same: Callable[[], Any] = lambda: None,
                    tolerance: ToleranceSpec | None = None, op_name: str = "", lazy: bool = False,
                    precedent: tuple | None = None, backward: bool = False,
                    bound: Callable[[], Any] | None = None, stats: Any = UNREAD) -> Comparison:
    """The verdict for one device tensor ``d`` (on any device) against its reference ``r``.

    ``same()`` gives the same-dtype run's tensor (or None); with ``lazy`` it is asked for only when needed;
    ``precedent`` is ``(SameDtypeHistory, key[, site])``; ``backward``: ``d`` is a gradient; ``bound()``: see
    ``compare_outputs``' ``bounds``; ``stats``: ``error_stats``' result when already read (``launch_stats``).
    """
    if d.shape != r.shape:
        return _failure(name, f"shape differs: device {tuple(d.shape)}, reference {tuple(r.shape)}")
    exact_d = not (d.is_floating_point() or d.is_complex())
    exact_r = not (r.is_floating_point() or r.is_complex())
    if exact_d != exact_r or d.is_complex() != r.is_complex():
        return _failure(name, f"dtype differs: device {d.dtype}, reference {r.dtype}")
    if exact_d:
        if d.dtype != r.dtype:
            return _failure(name, f"dtype differs: device {d.dtype}, reference {r.dtype}")
        if stats is EQUAL:
            return Comparison(name, True, True, device_error=0.0, cpu_error=0.0)
        return _compare_exact(name, d, r, same)
    cache: list = []

    def get_same():
        if not cache:
            cache.append(same())
        return cache[0]

    if not lazy and _dtype_differs(d, get_same()):
        return _failure(name, f"dtype differs: device {d.dtype}, a correct run in its dtype gives {get_same().dtype}")
    user, atol, rtol, rule, relative = _measure(d, r, tolerance, op_name, backward)
    if d.numel() == 0:
        return Comparison(name, True, True, atol=atol, rtol=rtol, device_error=0.0, cpu_error=0.0)
    result = Comparison(name, True, atol=atol, rtol=rtol)
    infos = []
    if stats is UNREAD:
        stats = error_stats(d, r, atol, rtol, relative)
    all_finite = stats is not None
    dw = rw = finite_d = finite_r = None  # float64 torch copies: only for nan/inf and the same-dtype check
    if all_finite:
        (result.max_abs_diff, result.max_relative_diff, result.device_error, result.cosine_similarity,
         result.allclose) = stats
    else:
        if d.device == r.device and d.device.type != "cpu":
            # a reference on the device meeting inf/nan: one wrong the same way as the result would agree with it,
            # so the CPU's judges (the same-dtype run is asked for: a device reference has none)
            get_same()
        dw, rw = _wide_pair(d, r)
        result.allclose = bool(torch.allclose(dw, rw, atol=atol, rtol=rtol, equal_nan=True))
        finite_d, finite_r = torch.isfinite(dw), torch.isfinite(rw)
        both = finite_d & finite_r
        agree = (dw == rw) | (torch.isnan(dw) & torch.isnan(rw))
        bad = ~both & ~agree
        if bool(bad.any()):
            s = get_same()
            sw = _wide(s) if isinstance(s, torch.Tensor) and s.shape == d.shape else None
            if sw is None or not bool(((dw == sw) | (torch.isnan(dw) & torch.isnan(sw)))[bad].all()):
                result.passed = False
                infos.append(f"nan/inf differ at {int(bad.sum())} of {d.numel()} elements "
                             f"(device {_nonfinite(dw[bad])}, reference {_nonfinite(rw[bad])})")
            else:
                infos.append(f"{int(bad.sum())} element(s) overflow in {d.dtype} as in a correct {d.dtype} run")
        # |d - r| where nan/inf differ: nan where either is nan, else inf (what the elementwise error there is)
        nonfinite_error = float((dw[bad] - rw[bad]).abs().max()) if not result.passed else 0.0
        dw, rw = dw[both], rw[both]
        stats = error_stats(dw, rw, atol, rtol, relative) if dw.numel() else None
        if stats is not None:
            result.max_abs_diff, result.max_relative_diff, result.device_error, result.cosine_similarity = stats[:4]
        else:
            result.device_error = 0.0
        if not result.passed:  # the finite elements' error would read as a small (or 0) error for a nan output
            result.max_abs_diff = result.max_relative_diff = result.device_error = nonfinite_error
    if user is not None:
        result.passed = result.allclose
        if not result.passed:
            infos.append(f"not allclose under {user[2]}={user[0]:g},{user[1]:g}")
    elif result.passed:
        _default_verdict(result, d, r, get_same, lazy, finite_d, finite_r, all_finite, infos, op_name, precedent,
                         rule, relative, bound,
                         backward and d.dtype in _NARROW and op_facts(op_name).rounded_once)
    result.error_info = "; ".join(infos)
    return result


def _dtype_differs(d: torch.Tensor, s) -> bool:
    return isinstance(s, torch.Tensor) and s.dtype != d.dtype and (s.is_floating_point() or s.is_complex()) and \
        not (WIDENED[0] and torch.promote_types(d.dtype, s.dtype) == d.dtype)


# Set once OpDtypeCast has run in this process: a result wider than a correct run in the call's own dtype gives (the
# op run widened where autocast would lower it, on purpose) is the user's choice, not the op's fault. Its values are
# still judged, against that run's error. Never unset: OpAutoCompare may judge a call after OpDtypeCast stopped.
WIDENED = [False]


@cached_on_facts  # asked per compared call
def ratio_for(op_name: str) -> float:
    """How many times the CPU's same-dtype error a correct device may reach on this op (more where its device kernels
    legitimately use another algorithm than the CPU's: ``op_facts``' ``algorithm_ratio``)."""
    ratio = op_facts(op_name).algorithm_ratio
    return RATIO if ratio is None else ratio


@functools.cache  # asked twice per comparison; torch.finfo builds an object each time
def _eps(dtype: torch.dtype) -> float:
    """Machine epsilon of a floating dtype, or of a complex dtype's real part."""
    return torch.finfo(dtype.to_real() if dtype.is_complex else dtype).eps


@functools.cache
def _tiny(dtype: torch.dtype) -> float:
    """The smallest normal number of a dtype: below it a correct result is within half a subnormal step."""
    return torch.finfo(dtype.to_real() if dtype.is_complex else dtype).tiny


def _default_verdict(result: Comparison, d, r, get_same, lazy, finite_d, finite_r, all_finite, infos,
                     op_name: str, precedent, rule: ErrorRule = ERROR_RULES["summed"],
                     relative: tuple | None = None, bound: Callable[[], Any] | None = None, bulk: bool = False) -> None:
    """``bulk``: the result is the gradient of an elementwise op in a narrow dtype, which the ratio rule passes only
    where the elements of its bulk (``_bulk_error``) are within the ratio of the same-dtype run's error there too."""
    eps, ref_eps = _eps(d.dtype), _eps(r.dtype)
    if ref_eps >= eps:  # the reference is no more precise than the device: only a loose floor is meaningful
        limit = SAME_PRECISION_FLOOR_EPS * eps
        if result.device_error > min(limit, SAME_PRECISION_FLOOR_MAX):
            result.passed = False
            above = f"{SAME_PRECISION_FLOOR_EPS:g} eps of {d.dtype}" if limit <= SAME_PRECISION_FLOOR_MAX else \
                f"{SAME_PRECISION_FLOOR_MAX:g} (8 ulps of bfloat16; 256 eps of {d.dtype} would pass anything)"
            infos.append(f"error {result.device_error:.3g} above {above} (reference computed in {r.dtype})")
        return
    if rule.modelled and bound is not None and all_finite and _modelled_verdict(result, d, r, bound, infos):
        return
    floor = rule.floor_eps * eps
    if result.device_error <= floor and lazy:
        return
    ratio = rule.ratio or ratio_for(op_name)
    if lazy and precedent is not None and all_finite and not bulk:
        seen = precedent[0].bound(*precedent[1:])
        if seen is not None and result.device_error <= rule.bound(ratio, seen / 2, floor):
            result.precedent_error = seen
            return  # well within what correct runs of this signature had: no same-dtype run could change this
    s = get_same()
    if _dtype_differs(d, s):
        result.passed = False
        infos.append(f"dtype differs: device {d.dtype}, a correct run in its dtype gives {s.dtype}")
        return
    if isinstance(s, torch.Tensor) and s.shape == d.shape:
        result.cpu_error = normalised_error(s, r, None if all_finite else finite_d & finite_r, relative)
        if precedent is not None:
            precedent[0].record(precedent[1], result.cpu_error, *precedent[2:])
    cpu_error = 0.0 if math.isnan(result.cpu_error) else result.cpu_error
    if result.device_error <= rule.bound(ratio, cpu_error, floor):
        if not (bulk and cpu_error > floor and all_finite and isinstance(s, torch.Tensor) and s.shape == d.shape):
            return
        worse, own = _bulk_error(d, r), _bulk_error(s, r)
        if worse <= rule.bound(ratio, own, floor):
            return
        result.passed = False
        infos.append(f"error {worse:.3g} on the bulk (elements of at least 1/4 the largest magnitude) > {ratio:g} x "
                     f"cpu {d.dtype} error there {own:.3g} + {rule.floor_eps:g} eps (the worst element's cpu error, "
                     f"{cpu_error:.3g}, excuses no more)")
        return
    if bound is not None and not rule.rounded and all_finite:
        model = bound()
        if model is not None and _worst_share(d, r, model) <= 1:
            infos.append(model.says)
            return
    result.passed = False
    if rule.rounded:
        infos.append(f"error {result.device_error:.3g} > {rule.floor_eps:g} eps of {d.dtype} (2 ulps of a result "
                     f"rounded once) and > {ratio:g} x cpu {d.dtype} error {cpu_error:.3g}")
    else:
        infos.append(f"error {result.device_error:.3g} > {ratio:g} x cpu {d.dtype} error {cpu_error:.3g} "
                     f"+ {FLOOR_EPS:g} eps")


def _bulk_error(x: torch.Tensor, r: torch.Tensor) -> float:
    """``max |x - r| / |r|`` over the elements of ``r`` of at least a quarter of its largest magnitude. An elementwise
    op's gradient computed from a saved narrow output cancels where the op saturates (tanh's ``1 - y^2``): a correct
    run errs by much of the mean magnitude there, and 4x that worst element's error passed a 30% fault on every
    element. The largest elements are far from saturation (``1 - y^2`` at least a quarter of the largest factor for
    the same upstream), each within an ulp or two of a correct run's. Taking those of the mean magnitude instead
    left a 10% fault unseen where most elements saturate (tanh of inputs of standard deviation 4)."""
    reference = wide(r)
    magnitude = reference.abs()
    largest = float(magnitude.max())
    if not largest:
        return 0.0
    bulk = magnitude >= largest / 4
    difference = wide(x).to(reference.device).sub_(reference).abs_()
    return float(difference[bulk].div_(magnitude[bulk]).max())


def _modelled_verdict(result: Comparison, d: torch.Tensor, r: torch.Tensor, bound: Callable[[], Any],
                      infos: list) -> bool:
    """Judge ``d`` by its rounding bound alone; False when there is none (the ratio rule then decides). Every such
    bound allows at least an eps of each element (its rounding and one more rounding inside), so a result within
    that passes without computing it."""
    dw: torch.Tensor | None = None
    rw: torch.Tensor | None = None
    if d.numel() <= _MODEL_CHUNK:
        dw, rw = _wide_pair(d, r)
        parts: Any = [(None, dw, rw)]
    else:  # in parts: a large gradient is never widened whole
        parts = _wide_parts(d, r)
    if all(bool(((pd - pr).abs() <= _eps(d.dtype) * pr.abs()).all()) for _, pd, pr in parts):
        return True
    model = bound()
    if model is None:
        return False
    share = _worst_share(d, r, model, dw, rw)
    if math.isnan(share):
        return False
    if share <= 1:
        infos.append(model.says)
    else:
        result.passed = False
        infos.append(f"error {share:.3g} x what rounding allows ({model.says.removeprefix('within ')})")
    return True


def _worst_share(d: torch.Tensor, r: torch.Tensor, model, dw: torch.Tensor | None = None,
                 rw: torch.Tensor | None = None) -> float:
    """The largest ``|d - r|`` as a share of what ``model`` allows per element (above 1: beyond any correct
    rounding); nan when the model has no bound for this dtype. A tensor of more than ``_MODEL_CHUNK`` elements is
    judged part by part where the model allows per part (``judges_parts``)."""
    if d.numel() > _MODEL_CHUNK and getattr(model, "judges_parts", False):
        worst = 0.0
        for part, pd, pr in _wide_parts(d, r):
            share = _share(pd, pr, d, model, part)
            if math.isnan(share):
                return share
            worst = max(worst, share)
        return worst
    dw = _wide(d) if dw is None else dw
    rw = _wide(r) if rw is None else rw
    return _share(dw, rw, d, model)


def _share(dw: torch.Tensor, rw: torch.Tensor, d: torch.Tensor, model, part: slice | None = None) -> float:
    """``_worst_share`` of one part: ``dw``, ``rw`` in float64 (a complex tensor's real views, measured by each
    element's modulus, as the model's magnitudes are)."""
    difference = dw - rw
    if d.is_complex():  # the pairs of reals as moduli: the bound has one value per complex element
        difference, rw = torch.linalg.vector_norm(difference, dim=-1), torch.linalg.vector_norm(rw, dim=-1)
    allowed = model.allowed(d.dtype, rw) if part is None else model.allowed(d.dtype, rw, part)
    if allowed is None:
        return math.nan
    excess = difference.abs() / allowed
    return float(excess.max()) if excess.numel() else 0.0


# Elements a rounding bound judges at a time: an embedding's gradient is a model's largest tensor (a vocabulary of
# 128k by 4,096 is 4.2 GB in float64), and widened whole with its temporaries it took several times that
_MODEL_CHUNK = 1 << 22


def _wide_parts(d: torch.Tensor, r: torch.Tensor):
    """``(part, d's part, r's part)`` over the flattened tensors, ``_MODEL_CHUNK`` elements at a time, each in
    float64 where they are compared (``_wide_pair``); ``part``, the slice of the flattened elements."""
    flat_d, flat_r = d.reshape(-1), r.reshape(-1)
    for start in range(0, flat_d.numel(), _MODEL_CHUNK):
        part = slice(start, start + _MODEL_CHUNK)
        yield (part, *_wide_pair(flat_d[part], flat_r[part]))


def _nonfinite(values: torch.Tensor) -> str:
    kinds = []
    if bool(torch.isnan(values).any()):
        kinds.append("nan")
    if bool(torch.isinf(values).any()):
        kinds.append("inf")
    if bool(torch.isfinite(values).any()):
        kinds.append("finite")
    return "/".join(kinds)


def _compare_exact(name: str, d: torch.Tensor, r: torch.Tensor, same: Callable[[], Any]) -> Comparison:
    if d.device == r.device and d.device.type != "cpu" and torch.equal(d, r):  # a reference on the device
        return Comparison(name, True, True, device_error=0.0, cpu_error=0.0)
    dc, rc = _on_cpu(d), _on_cpu(r)
    if torch.equal(dc, rc):
        return Comparison(name, True, True, device_error=0.0, cpu_error=0.0)
    s = same()
    if isinstance(s, torch.Tensor) and s.shape == d.shape and s.dtype == d.dtype and torch.equal(dc, _on_cpu(s)):
        # e.g. a comparison made in the device's dtype: a correct implementation in that dtype gives it too
        return Comparison(name, True, False, device_error=0.0, cpu_error=0.0,
                          error_info="equals the same-dtype run, not the float64 one")
    mismatched = dc != rc
    count = int(mismatched.sum())
    wide_d, wide_r = dc.double(), rc.double()
    max_abs = float((wide_d - wide_r).abs().max()) if d.dtype != torch.bool else 1.0
    return Comparison(name, False, False, max_abs, max_abs / (float(wide_r.abs().max()) + 1e-6), -1.0,
                      error_info=f"{d.dtype} values differ at {count} of {d.numel()} elements (must match exactly)")
