"""How far apart two recorded tensors are, from their statistics alone, and how far is too far.

``difference(a, b)`` is the largest of: the change of the minimum and of the maximum relative to their own size,
the change of the mean relative to the tensors' RMS, the relative change of the norm, and the root mean square
change of the fingerprints relative to the RMS, an estimate of the elementwise difference (tensor_stats.py).
Elementwise noise of a relative size ``r`` moves the extremes and that estimate by about ``r``; a different count
of nan or inf is an infinite difference. The same nan or inf in both, or nan or inf in both with one run's counts
unknown (-1), leaves only the statistics that stay finite (``nonfinite_in_both`` says so): the pair's values were
not compared, and the pair is not counted as agreeing. ``floor``: an RMS below which the tensor's size is no measure
of its rounding (``summed_gradient_floor``: a gradient summed to about zero, a conv's bias before a BatchNorm); its
differences are measured against at least that.

The tolerance of a pair of calls (comparison.py applies it) is the base tolerance of the lowest floating precision
involved, the pair's own dtypes or any used before it in either run (error carried from a bfloat16 matmul into
the float32 ops after it), grown with depth: ``base * sqrt(1 + depth / OP_COMPARE_RUNS_DEPTH_SCALE)``, ``depth``
the number of calls before it in its step; a pair diverges when its outputs differ by more than that plus
``OP_COMPARE_RUNS_CARRIED_GROWTH`` times what its inputs carried. Defaults: ``DEFAULT_TOLERANCES`` (as
``OP_COMPARE_RUNS_TOLERANCES`` declares them in op_tools/config/variables.py).
"""

from __future__ import annotations

import math

from ...config.variables import COMPARE_RUNS_TOLERANCES, parse_dtype_tolerances
from ...numerics.tensor_stats import STAT_FIELDS
from ...output.run_recording import UNKNOWN_COUNT

_MIN, _MAX, _MEAN, _NORM, _NAN, _INF, _FINGERPRINTS = range(7)  # fingerprints: from index 6 on
_STATS_AT = 3  # a recorded tensor is [where, dtype, shape, *stats]

# Lower is less precise. Integer and bool tensors are compared exactly.
PRECISION = {"float64": 4, "float32": 3, "complex64": 3, "complex128": 4, "float16": 2, "bfloat16": 1,
             "float8_e4m3fn": 0, "float8_e5m2": 0}
# One source for the defaults: the variable's declared default.
DEFAULT_TOLERANCES = parse_dtype_tolerances(COMPARE_RUNS_TOLERANCES.default)


def precision_of(dtype: str) -> int | None:
    """Rank of a floating dtype (lower: less precise), None for integer and bool dtypes."""
    if dtype in PRECISION:
        return PRECISION[dtype]
    return 0 if dtype.startswith("float8") else None


def tolerance_key(precision: int | None) -> str:
    return {None: "exact", 4: "float64", 3: "float32", 2: "float16", 1: "bfloat16", 0: "float8"}[precision]


def _close(x: float, y: float) -> bool:
    return x == y or (math.isnan(x) and math.isnan(y))


def _counts_unknown(sa: list, sb: list) -> bool:
    """Both tensors hold nan or inf, and one's counts are unknown (``UNKNOWN_COUNT``, -1: written in place before
    they were read, which depends on when each device's statistics arrived): whether the counts are the same is
    not known, which is no difference."""
    nonfinite = (sa[_NAN] or sa[_INF]) and (sb[_NAN] or sb[_INF])  # a count is read only for non-finite statistics
    return bool(nonfinite) and UNKNOWN_COUNT in (sa[_NAN], sa[_INF], sb[_NAN], sb[_INF])


def _counts(s: list) -> str:
    return "?/?" if s[_NAN] == UNKNOWN_COUNT else f"{int(s[_NAN])}/{int(s[_INF])}"


def nonfinite_in_both(a: list, b: list) -> str:
    """Why two recorded tensors' values could not be compared ('' when they could): both hold nan or inf, the same
    counts (or counts unknown in one run), so the statistics summed over every element (mean, norm, fingerprints)
    are nan or inf in both runs and only finite extremes, if any, were compared by ``difference``."""
    sa, sb = a[_STATS_AT:], b[_STATS_AT:]
    if not sa or not sb or not (sa[_NAN] or sa[_INF]):
        return ""
    if _counts_unknown(sa, sb):
        return (f"nan/inf {_counts(sa)} vs {_counts(sb)} (? unknown: written in place before it was counted) in "
                "both runs: its other values not compared")
    if (sa[_NAN], sa[_INF]) != (sb[_NAN], sb[_INF]):
        return ""
    return f"nan/inf {int(sa[_NAN])}/{int(sa[_INF])} in both runs: its other values not compared"


def _rms(t: list) -> float:
    return t[_STATS_AT + _NORM] / math.sqrt(max(math.prod(t[2]), 1))


def _sums_over_dims_of(shape: list, summed: list) -> bool:
    """Whether a tensor of ``shape`` can be ``summed`` (a tensor of more elements) summed over some of its dims,
    kept or not: its dims other than 1 are, in order, some of ``summed``'s (a conv's bias [C] of [N, C, H, W])."""
    dims = iter(summed)
    return math.prod(shape) < math.prod(summed) and all(n in dims for n in shape if n != 1)


def summed_gradient_floor(grad_input: list, grad_outputs: list, forward_inputs: list, forward_outputs: list) -> float:
    """The RMS a backward's ``grad_input`` is measured against at least (``difference``'s ``floor``), 0 for none.

    A gradient of a broadcast input (a bias, a norm's weight) is the upstream gradient ``g`` summed over the
    broadcast dims: ``k`` terms of size ``|g| * |dy/dw|`` each, whose rounding is about ``sqrt(k) * eps`` times
    that size however much the sum cancels (BatchNorm makes a conv's bias gradient exactly 0 in exact arithmetic:
    what is recorded is rounding, and two devices' roundings differ by 100% of it). So its difference is measured
    against the size the sum would have were the terms' signs independent, ``|g| * sqrt(k) * |dy/dw|`` =
    ``norm(g) / sqrt(numel) * |dy/dw|``, with ``|dy/dw|`` at most 1 (1 for an added bias, ``|x|`` for a
    multiplier ``x * w``, estimated as ``rms(y) / rms(w)``): never more than that sum's size without cancellation,
    so a fault in it larger than its rounding still shows. Only where the forward's input ``w`` of its shape and
    the forward's output ``y`` of ``g``'s are recorded."""
    if precision_of(grad_input[1]) is None or len(grad_input) <= _STATS_AT:
        return 0.0
    shape = grad_input[2]
    weights = [_rms(w) for w in forward_inputs if list(w[2]) == list(shape) and len(w) > _STATS_AT]
    floor = 0.0
    for g in grad_outputs:
        if len(g) <= _STATS_AT or precision_of(g[1]) is None or not _sums_over_dims_of(shape, g[2]):
            continue
        outputs = [_rms(y) for y in forward_outputs if list(y[2]) == list(g[2]) and len(y) > _STATS_AT]
        if not weights or not outputs:
            continue
        w, y = max(weights), min(outputs)  # the smaller |dy/dw| of the candidates: never a laxer floor
        if not (math.isfinite(w) and math.isfinite(y)):  # nan or inf in the forward: no size to estimate it from
            continue
        # a w of zeros: an added bias (y is not 0) or a multiplier (y = x * 0 is)
        derivative = min(1.0, y / w) if w > 0 else float(y > 0)
        size = g[_STATS_AT + _NORM] / math.sqrt(max(math.prod(shape), 1)) * derivative
        if math.isfinite(size):
            floor = max(floor, size)
    return floor


def difference(a: list, b: list, floor: float = 0.0) -> tuple[float, str]:
    """``(relative difference, which statistic)`` of two recorded tensors; ``(0, "")`` for equal ones. ``floor``:
    an RMS the tensors' differences are measured against at least (``summed_gradient_floor``)."""
    sa, sb = a[_STATS_AT:], b[_STATS_AT:]
    if not sa or not sb:
        return (0.0, "") if not sa and not sb else (math.inf, "empty in one run")
    if (sa[_NAN] != sb[_NAN] or sa[_INF] != sb[_INF]) and not _counts_unknown(sa, sb):
        return math.inf, f"nan/inf {int(sa[_NAN])}/{int(sa[_INF])} vs {int(sb[_NAN])}/{int(sb[_INF])}"
    numel = max(math.prod(a[2]), math.prod(b[2]), 1)
    rms = max(_rms(a), _rms(b), floor)
    size = rms if math.isfinite(rms) else 0.0  # an inf in both: finite extremes are judged on their own size
    worst, which = 0.0, ""
    for field, scale in ((_MIN, None), (_MAX, None), (_MEAN, rms), (_NORM, None)):
        x, y = sa[field], sb[field]
        if _close(x, y):
            continue
        if not (math.isfinite(x) and math.isfinite(y)):
            if sa[_NAN] or sa[_INF]:  # the same nan/inf counts: this statistic is unknown (nonfinite_in_both)
                continue
            return math.inf, STAT_FIELDS[field]
        # a norm against the norm the floor stands for; an extreme against the tensors' RMS at least
        at_least = floor * math.sqrt(numel) if field == _NORM else size
        denominator = max(abs(x), abs(y), at_least) if scale is None else scale
        rel = abs(x - y) / denominator if denominator > 0 else math.inf
        if rel > worst:
            worst, which = rel, STAT_FIELDS[field]
    deltas = [x - y for x, y in zip(sa[_FINGERPRINTS:], sb[_FINGERPRINTS:])]
    if deltas and rms > 0 and all(math.isfinite(d) for d in deltas):
        rel = math.sqrt(sum(d * d for d in deltas) / len(deltas)) / rms
        if rel > worst:
            worst, which = rel, "fingerprints"
    return worst, which
