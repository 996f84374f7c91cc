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

import contextlib
import logging
import threading
from collections.abc import Callable

import torch

COMPILE_AFTER = 1 << 26  # elements compared eagerly in this process before compiling pays for itself (~one step)
FUSED_MIN = 1 << 16  # smaller: the compiled call's fixed cost (dynamo's guards and wrappers, ~100 us) outweighs it

_lock = threading.Lock()
_seen = 0  # elements compared eagerly so far
_state = "idle"  # "idle" (not compiled yet), "ready", "failed"
_compiled: dict[bool, Callable[..., torch.Tensor]] = {}  # relative -> the compiled statistics
_own_frames = 0
_own_graphs = 0  # graphs dynamo made of them (counted apart: a fullgraph compilation counts no frame)


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


# Two functions, one per form of the error's denominator: dynamo counts its recompilations per function (8 at most),
# and each dtype compared (float32, bfloat16, float16, float64) is one for each form.
def _relative_statistics(d, r, minus_rtol, share, least):
    return _statistics(d, r, minus_rtol, share, least, True)


def _plain_statistics(d, r, minus_rtol, share, least):
    return _statistics(d, r, minus_rtol, share, least, False)


def own_frames() -> int:
    """Frames dynamo compiled for these statistics in this process (not the user's compiled code)."""
    return _own_frames


def own_graphs() -> int:
    """Graphs dynamo made for these statistics in this process (``counters["stats"]["unique_graphs"]``)."""
    return _own_graphs


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
    global _state, _compiled, _own_frames, _own_graphs
    try:
        from torch._dynamo.utils import counters

        compiled = _compiled.get(relative)
        if compiled is None:
            if not _compiled:
                logging.getLogger("op_tools").info("op_tools: compiling the comparison statistics into one pass "
                                                   "(once per process, about 10 s)")
            compile_ = getattr(torch.compile, "__wrapped_by_op_tools__", torch.compile)  # not compiled_regions' watch
            compiled = _compiled[relative] = compile_(_relative_statistics if relative else _plain_statistics,
                                                      dynamic=True)
        before, graphs_before = counters["frames"]["total"], counters["stats"]["unique_graphs"]
        try:
            # The stance is process-wide: for the length of this call, compiled code on another thread runs compiled.
            with _default_stance(), torch._C.DisableTorchFunction(), torch.no_grad(), \
                    _autocast_fixed():
                values = compiled(_unviewed(d), _unviewed(r), scalars[0], scalars[1], scalars[2]).tolist()
        finally:
            _own_frames += counters["frames"]["total"] - before
            _own_graphs += counters["stats"]["unique_graphs"] - graphs_before
    except Exception as error:  # noqa: BLE001 - no compiler, no inductor, an unsupported dtype: stay eager
        _fail(f"torch.compile failed ({type(error).__name__}: {error})")
        return None
    if _state == "idle" and _own_frames == 0:  # dynamo disabled (TORCHDYNAMO_DISABLE=1): it ran whole tensors eagerly
        _fail("torch.compile compiled nothing (dynamo disabled?)")
        return values
    _state = "ready"
    return values


# Where the autocast state is, per device type: dynamo guards a compiled frame on it (enabled and dtype, for every
# device type that has autocast), and a verdict judged inside a user's autocast region, then outside, recompiled the
# statistics each time: past dynamo's recompile limit (8) they ran uncompiled, whole tensors at once, for the rest of
# the process (a real-size Llama under bf16 autocast: a third of OpAutoCompare's step).
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "ipu", "mtia", "maia")
_fixed_dtypes: dict[str, torch.dtype] = {}  # device type -> the autocast dtype the statistics run with


@contextlib.contextmanager
def _autocast_fixed():
    """Autocast off on every device type, with one dtype each, for the statistics' call: the same guards every call
    (the statistics run on float64 and the device's own dtype: autocast has nothing to cast in them)."""
    changed = []
    for device in _autocast_device_types():
        try:
            enabled, dtype = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
        except (RuntimeError, TypeError, AttributeError):  # a device type this torch has no autocast for
            continue
        fixed = _fixed_dtypes.setdefault(device, dtype)
        if enabled or dtype != fixed:
            changed.append((device, enabled, dtype))
            torch.set_autocast_enabled(device, False)
            torch.set_autocast_dtype(device, fixed)
    try:
        yield
    finally:
        for device, enabled, dtype in reversed(changed):
            torch.set_autocast_dtype(device, dtype)
            torch.set_autocast_enabled(device, enabled)


def _default_stance():
    """The compiler's default stance for the statistics' call; torch before 2.6 has no stance (nor forces eager)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("default") if set_stance is not None else contextlib.nullcontext()


def _autocast_device_types() -> tuple[str, ...]:
    backend = torch._C._get_privateuse1_backend_name()  # "privateuseone" until a backend renames it (sim, npu)
    return _AUTOCAST_DEVICES + (backend,)


def _unviewed(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a tensor of its own over the same memory: dynamo guards a view on its base's sizes and strides, and
    every other base (a (2, 256, 512) output, a (512, 1376) weight) would compile the statistics again."""
    if t._base is None:
        return t
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.size(),
                                                               t.stride())


def _fail(why: str) -> None:
    global _state
    _state = "failed"
    logging.getLogger("op_tools").info("op_tools: comparison statistics stay eager: %s", why)
