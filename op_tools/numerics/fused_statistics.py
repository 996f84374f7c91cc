"""The comparison's statistics in one fused pass over host memory, compiled once per process by ``torch.compile``.

``error_statistics`` computes them with a dozen eager torch calls per chunk: each call streams the chunk again, and
a real-size training step compares some 300 million elements (an AdamW step alone compares every parameter eight
times), 40% of OpAutoCompare's time on sim. Inductor fuses the same arithmetic into one loop that reads each tensor
once, threaded: 5x less time on a 4-million-element tensor.

Compiling costs about 10 s on first use (a second or so once inductor's cache on disk holds it), so it is used only in
a process that has already compared ``COMPILE_AFTER`` elements eagerly: a real training run, not a test or a script
comparing a few small tensors. Where it cannot compile (no C++ compiler, a torch without inductor), the first failure
is logged and the eager path stays. Tensors are compared on the host only (``error_statistics`` passes CPU tensors).

While a tool is active, ``torch.compile``'s stance is "force_eager" (``core/compiled_regions``): the fused function is
run with the default stance for the duration of its call, and with torch-function handling off, so that dynamo never
traces a tool's mode. The frames it compiles are counted (``own_frames``), so that the tools do not announce them as
the user's compiled code.
"""

from __future__ import annotations

import logging
import threading

import torch

COMPILE_AFTER = 1 << 26  # elements compared eagerly in this process before compiling pays for itself (~one step)
FUSED_MIN = 1 << 16  # smaller: the compiled call's fixed cost (dynamo's guards and wrappers, ~100 us) outweighs it

_lock = threading.Lock()
_seen = 0  # elements compared eagerly so far
_state = "idle"  # "idle" (not compiled yet), "ready", "failed"
_compiled = None
_own_frames = 0


def _statistics(d: torch.Tensor, r: torch.Tensor, minus_rtol: torch.Tensor, share: torch.Tensor,
                least: torch.Tensor, relative: bool) -> torch.Tensor:
    """``[max |d-r|, max relative, error, allclose margin, d.d, r.r, d.r]`` as ``error_statistics._range_stats``."""
    wide = d.to(torch.float64)
    difference = (wide - r).abs()
    magnitude = r.abs()
    scale = torch.maximum(magnitude.mean() * share, least)
    denominator = torch.maximum(magnitude, scale) if relative else magnitude + scale
    return torch.stack([difference.amax(), (difference / (magnitude + 1e-6)).amax(), (difference / denominator).amax(),
                        (difference + magnitude * minus_rtol).amax(), (wide * wide).sum(), (r * r).sum(),
                        (wide * r).sum()])


def own_frames() -> int:
    """Frames dynamo compiled for these statistics in this process (not the user's compiled code)."""
    return _own_frames


def fused(d: torch.Tensor, r: torch.Tensor, minus_rtol: float, share: float, least: float,
          relative: bool) -> list[float] | None:
    """The seven statistics of the flat host tensors ``d`` (any floating dtype) and ``r`` (float64), or None where the
    fused pass is not (yet) used: the caller computes them eagerly."""
    global _seen
    n = r.numel()
    if _state == "failed" or n < FUSED_MIN or not d.is_cpu:
        return None
    if _state == "idle":
        _seen += n
        if _seen < COMPILE_AFTER:
            return None
    scalars = torch.tensor([minus_rtol, share, least], dtype=torch.float64)
    with _lock:  # one compile; dynamo's caches are not meant for concurrent first calls
        return _run(d, r, scalars, relative)


def _run(d: torch.Tensor, r: torch.Tensor, scalars: torch.Tensor, relative: bool) -> list[float] | None:
    global _state, _compiled, _own_frames
    try:
        from torch._dynamo.utils import counters

        if _compiled is None:
            logging.getLogger("op_tools").info("op_tools: compiling the comparison statistics into one pass "
                                               "(once per process, about 10 s)")
            compile_ = getattr(torch.compile, "__wrapped_by_op_tools__", torch.compile)  # not compiled_regions' watch
            _compiled = compile_(_statistics, dynamic=True)
        before = counters["frames"]["total"]
        try:
            # The stance is process-wide: for the length of this call, compiled code on another thread runs compiled.
            with torch.compiler.set_stance("default"), torch._C.DisableTorchFunction(), torch.no_grad():
                values = _compiled(d, r, scalars[0], scalars[1], scalars[2], relative).tolist()
        finally:
            _own_frames += counters["frames"]["total"] - before
    except Exception as error:  # noqa: BLE001 - no compiler, no inductor, an unsupported dtype: stay eager
        _fail(f"torch.compile failed ({type(error).__name__}: {error})")
        return None
    if _state == "idle" and _own_frames == 0:  # dynamo disabled (TORCHDYNAMO_DISABLE=1): it ran whole tensors eagerly
        _fail("torch.compile compiled nothing (dynamo disabled?)")
        return values
    _state = "ready"
    return values


def _fail(why: str) -> None:
    global _state
    _state = "failed"
    logging.getLogger("op_tools").info("op_tools: comparison statistics stay eager: %s", why)
