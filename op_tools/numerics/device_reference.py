"""OpAutoCompare's float64 reference on the device (``reference="device"``/``"auto"``), and how it earns trust.

The CPU reference costs a step many times over on a fast device; a device computing float64 runs the same reference
at its own speed. But the device is the hardware under suspicion, so its reference only ever *clears* a call:

- before the op, the call's tensors are copied on the device (``DeviceCopies``): floating ones to float64 (exact:
  every narrower float is a float64), others cloned. The reference runs on them there, and the comparison too; only
  its statistics come back.
- the comparison is the CPU path's own (``comparison.compare_outputs``), with its rounding models computed there too
  (float64 reruns on the copies' magnitudes), given a same-dtype run that raises ``NeedsHostError``: a verdict that
  is not a clean pass (an error above what the floor or the model allows, a nan, a float64 op, whose reference would
  be the device against itself) is made again on the CPU from host copies of the device copies, the CPU reference
  deciding. So a failure is never reported from the device reference alone;
- each op's first call, and every N-th after it, runs both references (``cross_check``): two float64 runs of one op
  differ by float64 rounding only, far below what any verdict distinguishes. An op whose two references differ by
  more (``references_differ``) is untrusted: its float64 kernels on this device are wrong, and the op goes to the
  CPU reference for the rest of the process.

Where a call is not compared on the device (no float64 kernels, a DTensor, a compiled graph, a user's reference
cast, the memory bound) it takes the CPU path, and the summary counts why.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import weakref

import torch

from ..ops.arguments import is_dtensor, iter_tensors
from .comparison import _eps
from .error_statistics import normalised_error, wide
from .reference import map_arguments

_WIDE = {torch.float16: torch.float64, torch.bfloat16: torch.float64, torch.float32: torch.float64,
         torch.float64: torch.float64, torch.complex64: torch.complex128, torch.complex128: torch.complex128}
# Two float64 references of one call may differ by this share of the tested dtype's epsilon (on the normalised error
# the verdicts use) before one is said wrong: far above float64's rounding at any reduction length a model has
# (4096 terms: about 1e-12), far below the several epsilons a verdict's floor allows.
AGREEMENT_SHARE = 1 / 64


class NeedsHostError(Exception):
    """The device verdict asked for what only the CPU gives: the call is judged on the CPU."""


def needs_host(*_args):
    raise NeedsHostError


class NotCopiedError(Exception):
    """A call the device's reference does not take (its reason in ``args[0]``), met while copying its arguments."""


class DeviceCopies:
    """One call's tensors copied on their device before the op runs: floating ones in float64, others cloned.

    ``copy(t)`` is ``map_arguments``' tensor function; ``host(obj)`` maps the copies of an argument structure back to
    host tensors in the call's own dtypes (exactly: the float64 copy holds every value of the narrower one).
    """

    __slots__ = ("dtype_of", "on_host", "nbytes", "__weakref__")

    def __init__(self) -> None:
        self.dtype_of: dict[int, torch.dtype] = {}  # id(copy) -> the call's dtype
        self.on_host: dict[int, torch.Tensor] = {}  # id(copy) -> its host copy, made once
        self.nbytes = 0

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        if is_dtensor(t):  # compared whole, on the CPU (host_copies.snapshot gathers it)
            raise NotCopiedError("a DTensor")
        t = t.detach()
        wide = _WIDE.get(t.dtype)
        out = t.to(dtype=wide, copy=True) if wide is not None else t.clone()
        self.dtype_of[id(out)] = t.dtype
        self.nbytes += out.numel() * out.element_size()
        return out

    def fresh(self, t: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """``copy(t)`` in ``HostCopies.get``'s form: (the copy, whether a cache supplied it: never)."""
        return self.copy(t), False

    def host(self, obj, non_blocking: bool = False):
        """``obj`` (an argument structure of copies) on the host in the call's dtypes; devices moved to the CPU.
        ``non_blocking``: the copies are not waited for (read after a wait for the device, ``wait_for_copies``)."""
        return map_arguments(obj, functools.partial(self.host_tensor, non_blocking=non_blocking))

    def host_tensor(self, t: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        known = self.on_host.get(id(t))
        if known is None:
            dtype = self.dtype_of.get(id(t), t.dtype)
            # narrowed there: fewer bytes to copy
            known = self.on_host[id(t)] = t.detach().to(dtype).to("cpu", non_blocking=non_blocking)
        return known


class MemoryBound:
    """The device memory the float64 copies may hold at once: each call's copies are counted while its state holds
    them (a finalizer gives their bytes back)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.held = 0
        # Finalizers run on whichever thread lets a call's state go (autograd's, after a backward), and may run
        # inside ``hold`` on this one (a collection while it allocates): re-entrant.
        self._lock = threading.RLock()

    def admits(self, nbytes: int) -> bool:
        return self.limit is None or self.held + nbytes <= self.limit

    def hold(self, copies: DeviceCopies) -> None:
        with self._lock:
            self.held += copies.nbytes
        weakref.finalize(copies, self._give_back, copies.nbytes)

    def _give_back(self, nbytes: int) -> None:
        with self._lock:
            self.held -= nbytes


@dataclasses.dataclass
class Trust:
    """Per process: which ops' float64 device kernels disagreed with the CPU, and each op's calls seen (the
    cross-check's schedule)."""

    untrusted: dict[str, str] = dataclasses.field(default_factory=dict)  # op -> what disagreed, by how much
    calls: dict[str, int] = dataclasses.field(default_factory=dict)  # op -> calls that took the device path so far

    def cross_check(self, name: str, every: int) -> bool:
        """Whether this call of ``name`` runs the CPU reference too: its first, then every ``every``-th."""
        seen = self.calls.get(name, 0)
        self.calls[name] = seen + 1
        return seen % every == 0


def references_differ(device_out, cpu_out, tested: torch.dtype, judged: float = 0.0) -> str | None:
    """How the device's float64 reference differs from the CPU's beyond float64 rounding (``AGREEMENT_SHARE`` of
    ``tested``'s epsilon on the normalised error), or None when they agree.

    ``judged``: the smallest error the CPU's verdict measured on the call. A difference within a sixteenth of it
    could not change a verdict either: a scalar whose terms cancel (a sum near 0) has a normalised error far above
    an epsilon in any correct float64 order, and the device's result errs by as much more."""
    allowed = max(AGREEMENT_SHARE * _eps(tested), judged / 16 if math.isfinite(judged) else 0.0)
    for d, c in zip(iter_tensors(device_out), iter_tensors(cpu_out)):
        if d.shape != c.shape:
            return f"shape {tuple(d.shape)} against the CPU's {tuple(c.shape)}"
        if not (d.is_floating_point() or d.is_complex()):
            if not torch.equal(d.detach().cpu(), c.detach()):
                return f"{d.dtype} values differ from the CPU's"
            continue
        dw, cw = wide(d.detach().to("cpu")), wide(c.detach())
        both = torch.isfinite(dw) & torch.isfinite(cw)
        if not bool((both | ((dw == cw) | (torch.isnan(dw) & torch.isnan(cw)))).all()):
            return "nan/inf where the CPU's reference has none"
        error = normalised_error(dw, cw, both)  # the verdicts' measure
        if error > allowed:
            return f"normalised difference {error:.3g} (float64 rounding allows {allowed:.3g})"
    return None


def tested_dtype(dtypes) -> torch.dtype | None:
    """The narrowest floating dtype among ``dtypes`` (a call's inputs'): what the reference must be exact enough to
    judge."""
    narrowest = None
    for dtype in dtypes:
        if dtype.is_floating_point or dtype.is_complex:
            if narrowest is None or _eps(dtype) > _eps(narrowest):
                narrowest = dtype
    return narrowest

