"""Where the comparison's statistics are computed: the one place to move work between the host and the device.

``error_stats(d, r, atol, rtol)`` measures a floating tensor ``d`` against its float64 reference ``r``:
max |d - r|, the max relative difference, the normalised error ``max |d - r| / (|r| + mean|r|)``, the cosine
similarity and whether ``allclose(atol, rtol)`` holds; None when a value is not finite (the caller handles nan
and inf elementwise). ``normalised_error(s, r)`` is the normalised error alone (of the same-dtype run). With
``relative=(share, least)`` both measure the relative error instead, ``max |d - r| / max(|r|, share * mean|r|,
least)``: the measure of an op rounded once (``comparison.ERROR_RULES``).

- small tensors on the host (below ``TORCH_MIN`` elements): numpy, whose per-call overhead is a fraction of
  torch's on the little tensors of a real model's many small ops;
- larger tensors, on the host or on a device: torch ops chunk by chunk (on the host, chunks that stay in the
  processor's cache), every statistic read back in one transfer; on the host, once a process has compared enough
  to pay for compiling it, one fused pass (``fused_statistics``). ``r`` is moved to ``d``'s device once (``d`` is
  never copied). OpAutoCompare decides where a tensor is compared (``autocompare._compared_value``).
"""

from __future__ import annotations

import math
import threading

import numpy as np
import torch

from . import fused_statistics

TORCH_MIN = 1 << 15
# Tensors this large are compared on their device, against the reference uploaded once, when the device computes
# in float64: only the statistics come back. Smaller ones are copied to the host (one copy, then numpy or torch
# there: fewer device launches than the dozen statistics would take).
DEVICE_STATISTICS_MIN = 1 << 20
_TINY = float(np.finfo(np.float64).tiny)
_NUMPY_FLOATS = frozenset({torch.float16, torch.float32, torch.float64})

# The ufuncs and their reductions, bound once: not the array methods (same values, less overhead per call).
_subtract, _absolute, _add, _divide = np.subtract, np.absolute, np.add, np.divide
_max, _sum, _maximum = np.maximum.reduce, np.add.reduce, np.maximum


def wide(t: torch.Tensor) -> torch.Tensor:
    """float64 (complex: its real view in float64), detached and contiguous, on ``t``'s device."""
    t = t.detach().resolve_conj().resolve_neg()
    if t.is_complex():
        return torch.view_as_real(t.to(torch.complex128)).contiguous()
    return t.to(torch.float64).contiguous()


def error_stats(d: torch.Tensor, r: torch.Tensor, atol: float, rtol: float, relative: tuple | None = None):
    """``(max_abs, max_rel, error, cosine, allclose)`` of ``d`` against ``r``, or None if a value is not finite."""
    if d.is_cpu and d.numel() < TORCH_MIN and not d.is_complex():
        return _numpy_stats(d, r, atol, rtol, relative)
    return _torch_stats(d, r, atol, rtol, relative)


def normalised_error(s: torch.Tensor, r: torch.Tensor, keep: torch.Tensor | None = None,
                     relative: tuple | None = None) -> float:
    """``max |s - r| / (|r| + mean|r|)`` (``relative``: as in ``error_stats``) over the elements in ``keep`` (all if
    None) where the difference is finite."""
    if keep is not None:
        s, r = wide(s)[keep.to(s.device)], wide(r)[keep.to(r.device)]
    if s.numel() == 0:
        return 0.0
    if s.is_cpu and s.numel() < TORCH_MIN and not s.is_complex():
        with np.errstate(all="ignore"):  # the widening too: a signalling nan (uninitialised memory) warns there
            sn, rn = _numpy(s), _numpy(r)
            diff = np.abs(sn - rn)
            magnitude = np.abs(rn)
            scale = _scale(float(magnitude.mean()), relative)
            combine = _add if relative is None else _maximum
            finite = np.isfinite(diff)
            if finite.all():
                return float((diff / combine(magnitude, scale)).max())
            return float((diff[finite] / combine(magnitude[finite], scale)).max()) if finite.any() else 0.0
    with torch.no_grad():
        flat, rw = s.detach().reshape(-1), wide(r).to(s.device).reshape(-1)
        if flat.is_complex():
            flat = wide(flat).reshape(-1)
        scale = _scale(torch.linalg.vector_norm(rw, 1).div_(rw.numel()), relative)
        largest = float(torch.stack(_over_ranges(_range_error, flat, rw, scale, relative is not None)).max())
        if math.isfinite(largest):
            return largest
        # an overflow in the same-dtype run: measured over the elements where the difference is finite
        magnitude = rw.abs()
        ratio = torch.sub(flat, rw).abs_().div_(magnitude.add_(scale) if relative is None else
                                                 magnitude.clamp_(min=scale))
        finite = torch.isfinite(ratio)
        return float(ratio[finite].max()) if bool(finite.any()) else 0.0


def _numpy(t: torch.Tensor) -> np.ndarray:
    """A float64 numpy view (or copy) of a host tensor, widened by numpy where it can (cheaper on small tensors)."""
    dtype = t.dtype
    if dtype in _NUMPY_FLOATS and not (t.is_conj() or t.is_neg()):
        try:
            array = (t.detach() if t.requires_grad else t).numpy()
            return array if dtype is torch.float64 else array.astype(np.float64)
        except (RuntimeError, TypeError):  # conj/neg bits, sparse or other layouts
            pass
    return wide(t).numpy()


@np.errstate(all="ignore")  # as a decorator: no errstate object built on each of the ~430 calls per step
def _numpy_stats(d: torch.Tensor | np.ndarray, r: torch.Tensor | np.ndarray, atol: float, rtol: float,
                 relative: tuple | None = None):
    # tensors widened here, under the errstate: a signalling nan (uninitialised memory) warned in the cast to float64
    dn = (_numpy(d) if isinstance(d, torch.Tensor) else d).ravel()
    rn = (_numpy(r) if isinstance(r, torch.Tensor) else r).ravel()
    diff = _subtract(dn, rn)
    _absolute(diff, out=diff)
    max_abs = float(_max(diff))
    if not math.isfinite(max_abs):
        return None
    if max_abs == 0:  # identical values: no error of any kind
        return 0.0, 0.0, 0.0, 1.0, True
    else:
        magnitude = _absolute(rn)
        scale = _scale(float(_sum(magnitude)) / magnitude.size, relative)
        # every diff <= max_abs <= atol <= atol + rtol * |ref|: the elementwise test is needed only above atol
        allclose = max_abs <= atol or bool((diff <= atol + rtol * magnitude).all())
        max_rel = float(_max(_divide(diff, _add(magnitude, 1e-6))))
        combine = _add if relative is None else _maximum
        error = float(_max(_divide(diff, combine(magnitude, scale, out=magnitude), out=magnitude)))
    # ndarray.dot: the same BLAS dot as ``@`` on 1-d arrays, at half the call overhead
    dd, rr = float(dn.dot(dn)), float(rn.dot(rn))
    return max_abs, max_rel, error, _cosine(dd, rr, float(dn.dot(rn)), max_abs), allclose


def _torch_stats(d: torch.Tensor, r: torch.Tensor, atol: float, rtol: float, relative: tuple | None = None):
    """Chunk by chunk: each chunk's temporaries stay in the processor's cache, so memory is read about once (the
    statistics take a dozen passes, which on a large tensor would each stream it from memory). On the host, large
    tensors are split between threads, one range each (torch releases the GIL while it computes)."""
    with torch.no_grad():
        if d.is_complex():
            d = wide(d)
        flat = d.detach().reshape(-1)
        rw = wide(r).to(d.device).reshape(-1)
        share, least = (1.0, _TINY) if relative is None else relative
        values = fused_statistics.fused(flat, rw, -rtol, share, least, relative is not None)  # None: not used here
        if values is None:
            values = _row(flat, rw, rtol, relative).tolist()  # the one read back
    return finished(values, atol)


def unread_stats(d: torch.Tensor, r: torch.Tensor, rtol: float, relative: tuple | None = None) -> torch.Tensor | None:
    """``error_stats``' figures of a real tensor ``d`` on a device as one tensor there, not read back yet: several
    are read in one transfer (``comparison.launch_stats``). None for a host or complex tensor (``error_stats``
    measures those)."""
    if d.is_cpu or d.is_complex():
        return None
    with torch.no_grad():
        return _row(d.detach().reshape(-1), wide(r).to(d.device).reshape(-1), rtol, relative)


def finished(values: list[float], atol: float):
    """``(max_abs, max_rel, error, cosine, allclose)`` from the seven figures, or None if a value is not finite."""
    max_abs, max_rel, error, margin, dd, rr, dr = values
    if not math.isfinite(max_abs):
        return None
    if max_abs == 0:
        return 0.0, 0.0, 0.0, 1.0, True
    return max_abs, max_rel, error, _cosine(dd, rr, dr, max_abs), max_abs <= atol or margin <= atol


def _row(flat: torch.Tensor, rw: torch.Tensor, rtol: float, relative: tuple | None) -> torch.Tensor:
    """The seven figures ``[max |d-r|, max relative, error, allclose margin, d.d, r.r, d.r]`` of flat ``flat`` against
    float64 ``rw``, as one tensor on their device (under no_grad)."""
    if not flat.is_cpu and flat.numel() <= _CHUNK_DEVICE:
        return _whole_stats(flat, rw, -rtol, relative)
    scale = _scale(torch.linalg.vector_norm(rw, 1).div_(rw.numel()), relative)
    # per chunk: max |d-r|, max relative, normalised error, allclose margin; sums of d*d, r*r, d*r
    table = torch.stack(_over_ranges(_range_stats, flat, rw, scale, -rtol, relative is not None))
    return torch.cat([table[:, :4].amax(0), table[:, 4:].sum(0)])


def _whole_stats(flat: torch.Tensor, rw: torch.Tensor, minus_rtol: float, relative: tuple | None) -> torch.Tensor:
    """The seven statistics of a tensor on a device that fits one chunk, on the whole tensors: no buffers, slices or
    table to join (on a device each call into torch is a launch, about 20 here against 34 for the chunked form; the
    cache the host's chunks fit is not a device's concern). As many temporaries as the chunks' buffers."""
    wide_d = flat.to(torch.float64)
    diff = torch.sub(wide_d, rw).abs_()
    magnitude = rw.abs()
    scale = _scale(magnitude.mean(), relative)
    tmp = torch.empty_like(diff)  # one scratch for the three quotients and the margin: no temporary each
    return torch.stack([
        diff.max(), torch.div(diff, torch.add(magnitude, 1e-6, out=tmp), out=tmp).max(),
        torch.div(diff, (torch.maximum if relative is not None else torch.add)(magnitude, scale, out=tmp),
                  out=tmp).max(),
        torch.add(diff, magnitude, alpha=minus_rtol, out=tmp).max(), torch.dot(wide_d, wide_d), torch.dot(rw, rw),
        torch.dot(wide_d, rw),
    ])


def _range_stats(flat: torch.Tensor, rw: torch.Tensor, start: int, stop: int, chunk: int, scale, minus_rtol: float,
                 relative: bool):
    wide_d, diff, magnitude, scratch = _buffers(rw.device, min(chunk, stop - start), 4)
    rows = []
    for at in range(start, stop, chunk):
        k = min(at + chunk, stop) - at
        dc, rc, df, mg, tmp = wide_d[:k], rw[at:at + k], diff[:k], magnitude[:k], scratch[:k]
        dc.copy_(flat[at:at + k])
        largest = torch.sub(dc, rc, out=df).abs_().max()
        if rc.is_cpu and largest.item() == 0:  # identical (views, copies, gathers): nothing but |r|^2 to add
            squares = torch.dot(rc, rc)
            rows.append(torch.stack([largest, largest, largest, largest, squares, squares, squares]))
            continue
        torch.abs(rc, out=mg)
        rows.append(torch.stack([
            largest, torch.div(df, torch.add(mg, 1e-6, out=tmp), out=tmp).max(),
            torch.div(df, (torch.maximum if relative else torch.add)(mg, scale, out=tmp), out=tmp).max(),
            torch.add(df, mg, alpha=minus_rtol, out=tmp).max(), torch.dot(dc, dc), torch.dot(rc, rc),
            torch.dot(dc, rc),
        ]))
    return rows


def _over_ranges(work, flat: torch.Tensor, rw: torch.Tensor, *extra) -> list:
    """``work(flat, rw, start, stop, chunk, *extra)`` over the whole tensor, chunk by chunk: the rows of every chunk."""
    return work(flat, rw, 0, rw.numel(), _CHUNK_HOST if flat.is_cpu else _CHUNK_DEVICE, *extra)


# Host chunks of a few MB: each op's temporaries stay in the processor's last-level cache, and torch still spreads
# each op over its threads. Device chunks bound the temporaries' memory.
_CHUNK_HOST = 1 << 18
_CHUNK_DEVICE = 1 << 22
_local = threading.local()


def _buffers(device: torch.device, size: int, count: int) -> list:
    """``count`` float64 buffers of at least ``size`` elements, reused across calls on the host (fresh memory costs
    a page fault per page on first touch) and made anew on a device (its caching allocator does the same)."""
    if device.type != "cpu":
        return [torch.empty(size, dtype=torch.float64, device=device) for _ in range(count)]
    held = getattr(_local, "buffers", None)
    if held is None or len(held) < count or held[0].numel() < size:
        held = _local.buffers = [torch.empty(max(size, _CHUNK_HOST), dtype=torch.float64) for _ in range(count)]
    return [b[:size] for b in held[:count]]


def _range_error(flat: torch.Tensor, rw: torch.Tensor, start: int, stop: int, chunk: int, scale, relative: bool):
    diff, magnitude = _buffers(rw.device, min(chunk, stop - start), 2)
    rows = []
    for at in range(start, stop, chunk):
        k = min(at + chunk, stop) - at
        rc, df, mg = rw[at:at + k], diff[:k], magnitude[:k]
        torch.sub(flat[at:at + k], rc, out=df).abs_()
        magnitude = torch.abs(rc, out=mg)
        rows.append(df.div_(magnitude.clamp_(min=scale) if relative else magnitude.add_(scale)).max())
    return rows


def _scale(mean, relative: tuple | None):
    """The magnitude an element is measured against at least: mean|r| (a float or a 0-d tensor), or with ``relative``
    ``(share, least)``, ``max(share * mean|r|, least)``."""
    share, least = (1.0, _TINY) if relative is None else relative
    if isinstance(mean, torch.Tensor):
        return (mean if relative is None else mean.mul_(share)).clamp_(min=least)
    return max(share * mean, least)


def _cosine(dd: float, rr: float, dr: float, max_abs: float) -> float:
    norms = math.sqrt(dd) * math.sqrt(rr)
    if norms > 0:
        return dr / norms
    return 1.0 if max_abs == 0 else 0.0
