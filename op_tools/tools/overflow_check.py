"""OpOverflowCheck: inf/nan and statistics of every handled call's tensors, forward and backward.

It names the first op, in execution order, whose outputs hold inf/nan while its inputs are finite
(``tool.first_overflow``); with ``OP_OVERFLOW_CHECK_RAISE=1`` it raises ``OverflowDetectedError`` there (for
an op found in backward: as ``backward()`` returns, since raising inside autograd's device threads is unsafe). A
backward reads what its forward saved: a NaN its forward's tensors held, or an inf its outputs held, is not born
in it. Where no call made the inf/nan a call read (the program's data), ``tool.first_seen`` names that call, and
the closing line says so instead of a clean verdict. Sparse tensors are checked in their values, complex ones
as reals. An overflow of the gradients GradScaler scaled (``core/loss_scaling.py``) waits for the iteration's
``update()``: in an iteration GradScaler skipped with a scale above 1 it is a loss-scale overflow, counted
(``loss_scale_overflows``) and no finding; otherwise the finding, as any.

Where the work runs: per handled call, one fused reduction on the device (the largest magnitude of every floating
input and output, ``torch._foreach_norm(..., inf)``: inf or nan exactly where a tensor holds one; in host memory,
the CPU's and sim's, ``aminmax`` per tensor, the CPU's fast reduction), kept there and read back in batches of 64
calls without blocking (``numerics/device_readback.py``). What an op writes is flagged before it runs; in host
memory, a large tensor flagged by an earlier call and unchanged since takes over that flag (``Flagged``) instead of
being read again. No host synchronisation in a step, one when the tool stops (or when ``first_overflow`` is read
while checks are in flight). The calls are judged in execution order as their batch arrives, so the first overflow
is the same call as when each call was read at once; nothing is queued once it is found. Its statistics (min, max,
mean, std, norm) are then computed from the call's tensors, kept meanwhile as aliases (``KeptTensors``, at most
``KEPT_BYTES`` of them): a tensor written in place since, or let go of, is shown with its flag only, and said so.
``OP_OVERFLOW_CHECK_RAISE=1`` (raise at the op) and the per-call tables (``OP_TOOLS_VERBOSE=1``) read each call as
it runs: one transfer per call, the statistics computed on the device.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time
import weakref

import torch

from ..config.variables import OVERFLOW_CHECK_RAISE
from ..core import loss_scaling, module_path
from ..core.engine import OpCall, OpTool, OpToolsAbortError, feature, register_backward_hooks, tool_work
from ..numerics.current_values import CurrentValues, locate_values
from ..numerics.device_readback import DeviceReadback, KeepBudget, KeptTensors
from ..numerics.tensor_stats import foreach_norms
from ..ops.arguments import local_part, sparse_values, tensor_items
from ..ops.collectives import collective_call, signature_of
from ..ops.custom_functions import checkpointed_module, custom_node, function_name
from ..ops.op_facts import op_facts
from ..ops.writes import call_writes, overwritten
from ..output import reporting, result_files

STAT_COLUMNS = ("name", "inf_or_nan", "min", "max", "mean", "std", "norm")
_STATISTICS = ("min", "max", "mean", "std", "norm")
_INF = float("inf")
READBACK_BATCH = 64  # calls whose flags travel to the host together: one copy, no synchronisation
# Bytes of tensors the calls in flight may keep alive for their statistics (beyond it the oldest let go): the step's
# own tensors mostly, which are alive anyway; the bound holds for the temporaries a step would have freed.
KEPT_BYTES = 256 * 2**20
NOT_KEPT = "not kept"
OVERWRITTEN = "overwritten"  # the statistics of an input the call wrote: its values are gone, its flag read before
KNOWN_ENTRIES = 4096  # tensors whose flag a later call may take over instead of reducing them again
FORWARDS_KEPT = 65536  # forward calls whose inputs or outputs held inf/nan, remembered for their backward


class OverflowDetectedError(OpToolsAbortError):
    """The first op producing inf/nan from finite inputs (OP_OVERFLOW_CHECK_RAISE=1)."""


@dataclasses.dataclass(frozen=True)
class Overflow:
    name: str
    forward_id: int
    phase: str  # "forward" or "backward"
    location: str
    module: str = ""  # the module that ran the call (model.layers.3.mlp.down_proj), "" outside any
    step: int = 0  # optimizer steps finished since the tool started, when the call's forward ran
    time: float = 0.0  # wall-clock seconds (time.time()) when the call started (its backward: when that ran)
    received: bool = False  # a collective that received it: this rank sent finite values, another rank did not
    came_in: bool = False  # no call made it: this call read it first (``OpOverflowCheck.first_seen``)

    def record(self, rank: int | None) -> dict:
        """What ``overflow_<session>.json`` holds: the first overflow of this rank, and where and when; or, where no
        call made one, the first call that read an inf/nan (``came_in``)."""
        return {"format": "op_tools overflow", "version": 1, "rank": rank, "step": self.step,
                "time": round(self.time, 6), "op": self.name, "module": self.module, "phase": self.phase,
                "forward_id": self.forward_id, "location": self.location, "received": self.received,
                "came_in": self.came_in}

    def __str__(self) -> str:
        where = f" in {self.module}" if self.module else ""
        what = ("first inf/nan received from another rank (this rank sent finite values)" if self.received else
                "first inf/nan read, made by no call checked" if self.came_in else "first inf/nan from finite inputs")
        return f"{what}: {self.name}{where} ({self.phase}) forward_id: {self.forward_id}\n{self.location}"


# --- on the device: a few reductions per tensor, one transfer per device ---

def _checked(t: torch.Tensor) -> bool:
    """Whether ``t`` can hold inf/nan and is checked: a non-empty, dense, real floating tensor."""
    return t.is_floating_point() and t.layout == torch.strided and t.numel() > 0


SPARSE_SUFFIX = " (sparse values)"
COMPLEX_SUFFIX = " (as real)"


def held(value, views: dict | None = None):
    """What of a call's value can hold inf/nan, as a dense real tensor on this host: a DTensor's local part; a sparse
    tensor's values (its implicit zeros are finite; an embedding's sparse gradient, an op on sparse tensors); a
    complex tensor's real view (a rotary embedding's complex product, an FFT); any other value as it is. ``views``:
    the views taken of each tensor so far in the call, the same view for the same tensor before and after the op
    (the flags taken before an in-place op are found by its id)."""
    t = local_part(value)
    if not isinstance(t, torch.Tensor) or (t.layout is torch.strided and not t.is_complex()):
        return t
    view = views.get(id(t)) if views is not None else None
    if view is None:
        view = t if t.layout is torch.strided else sparse_values(t)
        if view is None:  # mkldnn and others: left out (_checked)
            return t
        if view.is_complex():  # the same memory read as pairs of reals (a conjugate view's base: the same values)
            with torch.no_grad():
                view = torch.view_as_real(view.conj() if view.is_conj() else view)
        if views is not None:
            views[id(t)] = view
    return view


def _suffix(original, t) -> str:
    if t is original or not isinstance(original, torch.Tensor):
        return ""
    return SPARSE_SUFFIX if original.layout is not torch.strided else COMPLEX_SUFFIX if original.is_complex() else ""


_host_memory: dict[str, bool] = {}  # device type -> whether its tensors live in host memory (the CPU, sim)


def _largest_magnitudes(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``max |t|`` of each tensor, on its device: inf or nan exactly where ``t`` holds one (no overflow possible).
    One fused kernel where the backend has ``_foreach_norm``, one reduction per tensor otherwise (max propagates
    nan)."""
    return foreach_norms(tensors, _INF, one=_abs_max)


def _abs_max(t: torch.Tensor) -> torch.Tensor:
    return t.abs().max()


LARGE = 2**16  # elements: in host memory, a tensor this large is reduced by aminmax, smaller ones by one fused call


def _in_host_memory(t: torch.Tensor) -> bool:
    device_type = t.device.type
    host = _host_memory.get(device_type)
    if host is None:
        host = _host_memory[device_type] = t.untyped_storage().device.type == "cpu"
    return host


class Flagged:
    """The checks that flagged tensors still unchanged (``numerics/current_values``): a later call's tensor found
    here takes that check's flag instead of being reduced again. One op's output is the next one's input, so in host
    memory, where each reduction reads the whole tensor once more (sim, the CPU), this halves the tool's reading.
    Only for large tensors in host memory: on a device all of a call's tensors are reduced in one fused launch, and
    a lookup would cost the host more than it saves the device. Used only where every call is seen (a mode): the
    writes of calls not seen would go unnoticed."""

    def __init__(self) -> None:
        self._values = CurrentValues(KNOWN_ENTRIES, 0)

    def find(self, t: torch.Tensor) -> tuple[tuple, tuple[_PendingCheck, int] | None] | None:
        """``(where, (check, index))`` for a tensor that may be tracked: the check that flagged it as it is now, or
        None in its place; None for a tensor that is not tracked."""
        if t.numel() < LARGE or not _in_host_memory(t):
            return None
        where = locate_values(t)
        return None if where is None else (where, self._values.find(where))

    def put(self, where, check: _PendingCheck, index: int) -> None:
        self._values.put(where, (check, index))

    def forget(self, tensors) -> None:
        self._values.forget(tensors)

    def clear(self) -> None:
        self._values.clear()


def _min_max(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t``'s minimum and maximum, 0-d: ``aminmax`` (one reduction) where its last dimension is contiguous, else
    ``amin`` and ``amax``, which the CPU reduces in any layout where its ``aminmax`` crawls (a transposed 8192x512
    float32 weight: 4.6 ms against 0.21 ms; an attention's transposed keys: 140 us against 19 us)."""
    if t.dim() == 0 or t.stride(-1) == 1 or t.size(-1) == 1:
        return torch.aminmax(t)
    return t.amin(), t.amax()


def _witnesses(tensors: list[torch.Tensor], signed: list[bool] | None = None) -> tuple[list[torch.Tensor], list[int]]:
    """0-d tensors on the tensors' device, and how many of them belong to each tensor in turn, among which one is inf
    or nan exactly where the tensor holds one: its largest magnitude (one fused ``_foreach_norm`` for all on a
    device), or, for a large tensor in host memory (sim's) and every tensor on the CPU, its minimum and maximum
    (``aminmax``: vectorised and threaded there, 4x to 13x faster than the ``vector_norm(inf)`` the CPU runs per
    tensor inside ``_foreach_norm``; on the CPU an op costs about a microsecond, where each of sim's costs tens).
    ``signed``: for each tensor, whether its witnesses must tell its infs' signs (its minimum and maximum, then,
    wherever it lies): the results of a call whose float argument is an inf of one sign (op fact ``places_scalars``)."""
    if not _in_host_memory(tensors[0]):  # a device's own memory: one fused reduction for all
        if signed is None:
            return _largest_magnitudes(tensors), [1] * len(tensors)
        paired = list(signed)
    else:
        on_cpu = tensors[0].device.type == "cpu"
        paired = [on_cpu or t.numel() >= LARGE or signed is not None and signed[k] for k, t in enumerate(tensors)]
    small = [t for t, pair in zip(tensors, paired) if not pair]
    norms = iter(_largest_magnitudes(small) if small else [])
    witnesses: list[torch.Tensor] = []
    counts = []
    for t, pair in zip(tensors, paired):
        if pair:
            witnesses.extend(_min_max(t))  # both propagate nan
            counts.append(2)
        else:
            witnesses.append(next(norms))
            counts.append(1)
    return witnesses, counts


# What a tensor (or a scalar argument) holds, in order of what it says about an inf/nan: nan outranks inf, since a nan
# is born from infs (inf - inf, 0 * inf) and an inf is not born from a nan.
FINITE, INF, NAN = 0, 1, 2


def _kind(value: float) -> int:
    return FINITE if math.isfinite(value) else NAN if value != value else INF


def _kinds_of(values: list[float], counts: list[int]) -> list[int]:
    kinds, start = [], 0
    for count in counts:  # mostly 1 each: no generator per tensor
        kind = _kind(values[start])
        if count == 2:
            kind = max(kind, _kind(values[start + 1]))
        kinds.append(kind)
        start += count
    return kinds


# The signs of the infs a tensor holds, as far as its witnesses tell (one largest magnitude tells no sign: both)
POS_INF, NEG_INF = 1, 2
BOTH_INF = POS_INF | NEG_INF


def _signs_of(values: list[float], counts: list[int]) -> list[int]:
    signs, start = [], 0
    for count in counts:
        if count == 2:  # minimum, maximum
            signs.append((NEG_INF if values[start] == -_INF else 0) | (POS_INF if values[start + 1] == _INF else 0))
        else:
            signs.append(BOTH_INF if values[start] == _INF else 0)
        start += count
    return signs


def nonfinite_values(tensors: list[torch.Tensor], signed: list[bool] | None = None) -> tuple[list[int], list[int]]:
    """For each tensor, ``FINITE``, ``INF`` or ``NAN`` (it holds a nan), and the signs of its infs (``POS_INF``,
    ``NEG_INF``; exact where ``signed`` asks, ``BOTH_INF`` for an inf of a sign not told), from its ``_witnesses``,
    computed on its device and read back in one transfer per device (the host synchronisation)."""
    kinds, signs = [FINITE] * len(tensors), [0] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        if _checked(t):
            by_device.setdefault(t.device, []).append(i)
    with torch.no_grad():  # no graph, hence no detach
        for indices in by_device.values():
            witnesses, counts = _witnesses([tensors[i] for i in indices],
                                           [signed[i] for i in indices] if signed is not None else None)
            values = torch.stack(witnesses).cpu().tolist()
            for i, kind, sign in zip(indices, _kinds_of(values, counts), _signs_of(values, counts)):
                kinds[i], signs[i] = kind, sign
    return kinds, signs


def nonfinite_kinds(tensors: list[torch.Tensor]) -> list[int]:
    """For each tensor, ``FINITE``, ``INF`` or ``NAN`` (``nonfinite_values``)."""
    return nonfinite_values(tensors)[0]


def nonfinite_flags(tensors: list[torch.Tensor]) -> list[bool]:
    """For each tensor, whether it holds inf or nan (``nonfinite_kinds``)."""
    return [kind != FINITE for kind in nonfinite_kinds(tensors)]


NAN_VALUE = 4  # beside POS_INF and NEG_INF: what a call's float arguments can put in its results


def _scalar_bits(value: float) -> int:
    return NAN_VALUE if value != value else POS_INF if value > 0 else NEG_INF


def scalar_values(name: str, args: tuple, kwargs: dict, order: tuple[int, str] | None = None) -> int:
    """What the call's Python float arguments can put in its results (``masked_fill(mask, float("-inf"))``,
    ``clamp(min=-inf)``), as bits: ``NAN_VALUE`` for a nan, the inf's sign for an inf an op places as it is (op fact
    ``places_scalars``), both signs for one an arithmetic op combines; an inf/nan of those kinds is not born at the
    call. Not a norm's ``order`` (``op_facts``' ``order``: position, keyword), which puts no value in its result.
    Top-level arguments only: a per-call cost."""
    bits = 0
    for value in args:
        if type(value) is float and not math.isfinite(value):
            bits |= _scalar_bits(value)
    for value in kwargs.values():
        if type(value) is float and not math.isfinite(value):
            bits |= _scalar_bits(value)
    if not bits:
        return bits
    if order is not None:
        return scalar_values(name, tuple(v for i, v in enumerate(args) if i != order[0]),
                             {k: v for k, v in kwargs.items() if k != order[1]})
    if bits & BOTH_INF and not op_facts(name).places_scalars:
        bits |= BOTH_INF
    return bits


def _scalars_kind(bits: int) -> int:
    return NAN if bits & NAN_VALUE else INF if bits else FINITE


def _one_sign(bits: int) -> bool:
    """Whether ``scalar_values`` bits explain infs of one sign only: the results' witnesses must then tell theirs."""
    return bits & BOTH_INF in (POS_INF, NEG_INF)


def born_here(source_kinds, result_kinds, scalars: int = FINITE) -> bool:
    """Whether a call's results hold an inf/nan its inputs did not bring: a nan where no input held one (a nan from
    infs is born here), or an inf where every input, scalar arguments included, was finite."""
    result = max(result_kinds, default=FINITE)
    source = max(max(source_kinds, default=FINITE), scalars)
    return result == NAN and source != NAN or result == INF and source == FINITE


def _statistics(t: torch.Tensor) -> torch.Tensor:
    """``[all finite, min, max, mean, std, norm]`` of ``t`` as one device tensor (float32, or float64 for float64)."""
    wide = t  # called under no_grad
    if not wide.is_floating_point() or wide.element_size() < 4:
        wide = wide.float()
    return torch.stack([torch.isfinite(wide).all().to(wide.dtype), wide.min(), wide.max(), wide.mean(),
                        wide.std(correction=0), wide.norm()])


def statistics_rows(named: list[tuple[str, torch.Tensor]]) -> list[dict]:
    """``STAT_COLUMNS`` rows for ``(name, tensor)`` pairs, computed on the device and read back in one transfer per
    device. Empty, complex and non-dense tensors get only ``inf_or_nan: False``."""
    rows = [{"name": name, "inf_or_nan": False} for name, _ in named]
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    with torch.no_grad():
        for i, (_, t) in enumerate(named):
            if t.numel() and not t.is_complex() and t.layout == torch.strided:
                by_device.setdefault(t.device, []).append((i, _statistics(t)))
        for items in by_device.values():
            values = torch.stack([v for _, v in items]).cpu().tolist()  # mixed float32/float64: promoted
            for (i, _), (finite, *stats) in zip(items, values):
                rows[i]["inf_or_nan"] = not finite
                rows[i].update(zip(_STATISTICS, stats))
    return rows


def tensor_stats(name: str, t: torch.Tensor) -> dict:
    """inf/nan flag and min, max, mean, std, norm of ``t`` (computed in float32 or wider)."""
    return statistics_rows([(name, t)])[0]


def named_tensors(prefix: str, values, views: dict | None = None) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of what the values hold (``held``): a DTensor is checked in the part this rank holds (an
    inf/nan anywhere in it is in some rank's part), a sparse tensor in its values, a complex one as reals (named so)."""
    named = []
    for path, v in tensor_items(tuple(values)):
        t = held(v, views)
        # a plain tensor is held as it is: no suffix to look for
        named.append((prefix + path if t is v else prefix + path + _suffix(local_part(v), t), t))
    return named


class _PendingCheck:
    """A call whose flags are on their way from the device: what judging it, and showing it, needs."""

    __slots__ = ("facts", "site", "names", "kept", "split", "results_first", "flags", "remaining", "table",
                 "scalars", "scalar_values", "signs", "taken", "written")

    def __init__(self, call: OpCall, phase: str, named: list, split: int, results_first: bool,
                 kept: KeptTensors | None = None, scalars: int = 0) -> None:
        # What the report says of the call, taken now: its source line while its frames are on the stack (formatted
        # only for a call that overflows), name, id, module, step and time; not the call, whose arguments and result
        # would stay alive until the batch is read.
        # a backward's time is when it ran: the run report orders each rank's anomalies by it
        self.facts = (call.name, call.forward_id, phase, call.module_path, call.step,
                      time.time() if phase == "backward" else call.time)
        self.site = call.keep_location()
        self.split, self.results_first = split, results_first
        # Tuples and bytes where the check's state allows: a check lives until its batch is read, long enough for
        # the garbage collector to promote what it holds (a list is tracked, a bytearray and a tuple of strings not).
        self.names = tuple(name for name, _ in named)
        self.kept = kept  # the tensors, for the statistics of the call that overflows
        self.flags = bytearray(len(named))  # each tensor's kind (FINITE, INF, NAN)
        self.scalars = _scalars_kind(scalars)  # the worst of the call's float arguments
        self.scalar_values = scalars  # what they can put in its results (``scalar_values``)
        # the signs of the infs each tensor holds (POS_INF, NEG_INF), where a float argument's inf explains those of
        # its own sign only (masked_fill(mask, -inf)): its results' witnesses then tell them; None elsewhere
        self.signs = bytearray(len(named)) if _one_sign(scalars) else None
        self.remaining = 0  # device groups not yet read back
        self.table: list[dict] | None = None  # the statistics, where computed with the flags
        # (index, earlier check, its index, whether the tensor still holds what it held at the call): a tensor whose
        # flag is an earlier check's, of it unchanged since (``Flagged``); taken over once that check's flags have
        # arrived, which in call order they have
        self.taken: list[tuple[int, _PendingCheck, int, bool]] | tuple = ()
        # the indices of the inputs the call wrote (an in-place op's): flagged before it, their values gone after it
        self.written: list[int] | tuple = ()

    def take(self, index: int, earlier: _PendingCheck, its_index: int, unchanged: bool) -> None:
        """Tensor ``index``'s flag is ``earlier``'s flag of its tensor ``its_index`` (see ``taken``)."""
        if not self.taken:
            self.taken = []
        assert isinstance(self.taken, list)
        self.taken.append((index, earlier, its_index, unchanged))

    @property
    def overflow(self) -> Overflow:
        name, forward_id, phase, module, step, started = self.facts
        return Overflow(name, forward_id, phase, self.site.text(), module, step, started)

    def source_indices(self) -> range:
        return range(self.split, len(self.names)) if self.results_first else range(self.split)

    def signed(self, indices: list[int]) -> list[bool] | None:
        """For each of ``indices``, whether its witnesses must tell its infs' signs (a result, where ``signs``)."""
        if self.signs is None:
            return None
        sources = self.source_indices()
        return [i not in sources for i in indices]

    def arrived(self, indices, values: list[float], counts) -> None:
        """The witnesses of tensors ``indices`` were read: their kinds, and their infs' signs where asked."""
        for i, kind in zip(indices, _kinds_of(values, counts)):
            self.flags[i] = kind
        if self.signs is not None:
            for i, sign in zip(indices, _signs_of(values, counts)):
                self.signs[i] = sign

    def explaining_scalars(self) -> int:
        """``scalars`` where the call's float arguments can have made every inf/nan its results hold (a -inf fill
        value the -inf of a masked_fill, not its +inf nor a nan), ``FINITE`` where they cannot: they explain nothing."""
        if self.scalars == FINITE:
            return FINITE
        made, sources = 0, self.source_indices()
        for i in range(len(self.names)):
            if i in sources:
                continue
            kind = self.flags[i]
            if kind == NAN:
                made |= NAN_VALUE
            elif kind == INF:  # a sign not told (a flag taken over): either
                made |= (self.signs[i] or BOTH_INF) if self.signs is not None else BOTH_INF
        return FINITE if made & ~self.scalar_values else self.scalars

    def take_over(self) -> None:
        for i, earlier, j, _ in self.taken:
            self.flags[i] = earlier.flags[j]

    def sources_and_results(self) -> tuple[bytearray, bytearray]:
        first, second = self.flags[:self.split], self.flags[self.split:]
        return (second, first) if self.results_first else (first, second)

    def rows(self) -> list[dict]:
        """The statistics table of the call, from its tensors as they are now: a tensor let go of or written in
        place since the call shows its flag (read at the call) and no statistics."""
        if self.table is not None:
            return self.table
        tensors = [self.kept.get(i) if self.kept is not None and i not in self.written else None
                   for i in range(len(self.names))]
        computed = iter(statistics_rows([(name, t) for name, t in zip(self.names, tensors) if t is not None]))
        return [next(computed) if t is not None else
                {"name": name, "inf_or_nan": flag != FINITE,
                 **dict.fromkeys(_STATISTICS, OVERWRITTEN if i in self.written else NOT_KEPT)}
                for i, (name, t, flag) in enumerate(zip(self.names, tensors, self.flags))]


class _Written:
    """The tensors a call writes, how the flag of each as it was before the op comes (``_flags_before``), and the
    values taken of its sparse tensors (``held``)."""

    __slots__ = ("tensors", "flags", "views")

    def __init__(self, tensors: list[torch.Tensor], flags: dict[int, tuple], views: dict) -> None:
        self.tensors, self.flags, self.views = tensors, flags, views


SCALED, UNSCALED, UPDATED = "scaled", "unscaled", "updated"


class _ScalerEvent:
    """A GradScaler call (``core/loss_scaling.py``), queued with the checks so that it is judged in the program's
    order: ``scaled`` (``scale(loss)``: a scaled backward follows), ``unscaled`` (``unscale_``: the gradients are
    read unscaled from here) or ``updated`` (``update()``: the iteration is over; ``values`` the scale it ran with,
    the scale after, then its ``found_inf`` flags, a device tensor until read back with the flags)."""

    __slots__ = ("what", "scaler", "values", "remaining", "kept")

    def __init__(self, what: str, scaler: int, values: torch.Tensor | None = None) -> None:
        self.what, self.scaler = what, scaler
        self.values: torch.Tensor | list[float] | None = values
        self.remaining = 0
        self.kept = None  # nothing kept: the checks' deque releases a check's kept tensors after its verdict


class _Held:
    """What an iteration whose loss GradScaler scaled made, kept until its ``update()`` says whether GradScaler
    skipped it: ``scaled``, the first overflow born in its backward or after its gradients were unscaled (the scaled
    gradients'); ``seen``, the first inf/nan read there that no call checked made (an overflow in a call not
    checked), with its kind; ``later``, the first overflow born after one of those, elsewhere (a forward of the next
    micro-batch), which is a finding whatever GradScaler says; ``later_seen``, the first inf/nan read there that no
    call checked made (data with a nan), with its kind, which is ``first_seen`` whatever GradScaler says. Each check
    with the tensors it kept (``KeptTensors``), for the statistics if it is reported."""

    __slots__ = ("scaled", "seen", "seen_kind", "later", "later_seen", "later_seen_kind", "order")

    def __init__(self) -> None:
        self.scaled: tuple[_PendingCheck, KeptTensors | None] | None = None
        self.seen: tuple[_PendingCheck, KeptTensors | None] | None = None
        self.seen_kind = FINITE
        self.later: tuple[_PendingCheck, KeptTensors | None] | None = None
        self.later_seen: tuple[_PendingCheck, KeptTensors | None] | None = None
        self.later_seen_kind = FINITE
        self.order: list[str] = []  # the findings held ("scaled", "later"), in execution order

    def checks(self) -> list[tuple[_PendingCheck, KeptTensors | None]]:
        return [held for held in (self.scaled, self.seen, self.later, self.later_seen) if held is not None]


def _unread_targets(name: str, spec, args: tuple, kwargs: dict, views: dict) -> set[int]:
    """The ids of the tensors a call writes without reading them (its ``out=`` tensors, the first argument of an op
    that ``overwrites`` it, the arguments it declares ``overwritten``), as ``held`` gives them."""
    unread = set()
    if op_facts(name).overwrites and args and isinstance(args[0], torch.Tensor):
        unread.add(id(held(args[0], views)))
    for t in overwritten(name, args, kwargs):  # fused SGD's momentum buffers at its first step
        unread.add(id(held(t, views)))
    for keyword in spec.keywords:  # a schema's keyword-only written arguments: out=, values=, indices=
        value = kwargs.get(keyword)
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor):
                unread.add(id(held(t, views)))
    return unread


def _read_flag(flag: tuple) -> int:
    """The kind a ``_flags_before`` entry stands for, read now (one transfer for a witness on a device)."""
    if flag[0] == "kind":
        return flag[1]
    if flag[0] == "taken":  # the earlier check has been judged: the calls in flight were read first
        return flag[1].flags[flag[2]]
    return _kinds_of(torch.stack(flag[1]).cpu().tolist(), [flag[2]])[0]


@feature("overflow_check")
class OpOverflowCheck(OpTool):
    """Check every handled call's inputs, outputs and gradients for inf/nan.

    Keyword arguments (each overrides its variable): ``ops``, ``disable`` (``OP_OVERFLOW_CHECK_LIST``/
    ``_DISABLE_LIST``: lists of op names, patterns or functions), ``raise_on_overflow`` (``OP_OVERFLOW_CHECK_RAISE``),
    and ``results_dir``, ``verbose``, ``print_stack``, ``strict``, ``print_ranks`` as every tool.

    >>> with op_tools.OpOverflowCheck() as check:
    ...     loss = model(x).sum(); loss.backward()
    >>> print(check.first_overflow)     # None, or the op, forward_id, phase and source line
    """

    hook_name = "OpOverflowCheckHook"
    results_folder = "op_overflow_check_result"
    env_prefix = "OP_OVERFLOW_CHECK"
    reports_unchecked = True  # the run report reads its findings
    keywords = {"raise_on_overflow": OVERFLOW_CHECK_RAISE}
    tracks_modules = True
    tracks_writes = True  # a write by a call not handled makes the flags taken over from that tensor stale

    def configure(self) -> None:
        self.raise_on_overflow = OVERFLOW_CHECK_RAISE.read(self.sources)
        self._first_overflow: Overflow | None = None
        self._pending: Overflow | None = None
        self._readback = DeviceReadback(READBACK_BATCH)
        # in execution order, with GradScaler's calls among them
        self._checks: collections.deque[_PendingCheck | _ScalerEvent] = collections.deque()
        self._checks_lock = threading.Lock()
        self._kept = KeepBudget(KEPT_BYTES)
        self._flagged = Flagged()
        # the nodes of custom autograd.Functions seen (``_follow_functions``), and the Functions checked, by name
        self._functions: weakref.WeakSet = weakref.WeakSet()
        self.functions_checked: collections.Counter = collections.Counter()
        self.stale_flags = 0  # flags taken over, found out of date when the call they made look born was re-read
        # calls whose result no op made, by why (memory never written, the program's own data): nothing to check,
        # counted as OpAutoCompare's ``skipped`` are
        self.skipped: collections.Counter = collections.Counter()
        # forward_id -> what a forward call's tensors held, oldest first: NAN where its inputs or outputs held a nan,
        # INF where its outputs held an inf. Its backward reads them too (the saved tensors): a nan, or an inf, in
        # its gradients is then not born there (an inf in the data squared, then its gradient). Not an inf its
        # inputs held only: a call that reads -inf by design (softmax after an attention mask) has a finite
        # backward (softmax's reads its output), where an overflow is the backward's own.
        self._forward_kinds: dict[int, int] = {}
        # The first call, in execution order, that read an inf or nan no call checked had made (and which of them):
        # where it came in (the program's data, a call not handled, a write no call showed). Not where a call's float
        # argument was such a value before (a mask's -inf, a sentinel nan: torch.full(..., nan)), which its readers
        # then read by design.
        self._first_seen: tuple[Overflow, int] | None = None
        self._scalars_seen = FINITE
        # GradScaler (core/loss_scaling.py), as the checks are judged: the scalers whose scale() was judged since
        # their update() (a backward now is a scaled one), whether the gradients were unscaled since, what the
        # iteration made that waits for its update() (``_Held``), and the updates judged for it so far: (scale, scale
        # after) where GradScaler skipped the iteration with a scale above 1, None otherwise.
        self._scaled: set[int] = set()
        self._unscaled = False
        self._held: _Held | None = None
        self._updates: list[tuple[float, float] | None] = []
        # the iterations GradScaler skipped whose scaled gradients overflowed: no finding (``loss_scale_overflows``)
        self.loss_scale_overflows: list[dict] = []
        self._iteration = 0  # GradScaler iterations ended (its updates judged): a skipped one is no optimizer step
        self._applied_listener = False  # listening to GradScaler for apply_feature (never started)

    def start(self) -> OpOverflowCheck:
        first = not self._activations
        super().start()
        # GradScaler's iterations: its overflows by design are no finding. Once per tool, whatever the threads it is
        # started on: a listener registered twice was told each GradScaler call twice (iterations counted twice)
        if first:
            loss_scaling.listen(self)
        return self

    def stop(self) -> None:
        if len(self._activations) == 1:  # the last one
            loss_scaling.unlisten(self)
        super().stop()

    def accepts(self, name: str) -> bool:
        # A view that computes nothing, forward or backward, makes no inf/nan (``op_facts``' ``alias_only``): not
        # handled at all, as a metadata query is not, where it would cost the engine's and the check's host work for
        # nothing (an eighth of a Llama's calls). An inf/nan it passes on is judged at the call that reads it; one that
        # ``view(dtype)`` makes by reading other bits is said there as read first, made by no call checked. Handled
        # where asked for by name (OP_OVERFLOW_CHECK_LIST, apply_feature's ops) and where every call's table is
        # printed.
        return not op_facts(name).alias_only or self.filter.allow is not None or self._applied_listener or \
            self._logger.isEnabledFor(logging.DEBUG)

    def ensure_configured(self) -> None:
        applied = self.common is None and not self._activations
        super().ensure_configured()
        if applied:  # apply_feature's, never started: it hears GradScaler until it finishes (remove_feature, exit)
            self._applied_listener = True
            loss_scaling.listen(self)

    @property
    def first_overflow(self) -> Overflow | None:
        """The first op, in execution order, whose outputs hold inf/nan while its inputs are finite (None: none so
        far). Reading it while checks are in flight waits for them (one synchronisation). An overflow of the gradients
        GradScaler scaled is not there until the iteration's ``update()`` showed it was no loss-scale overflow."""
        if self._first_overflow is None and self._checks:
            with tool_work():  # read from the program's own code: the tool's torch calls are not the program's
                self._judge(wait=True)
        return self._first_overflow

    def note_writes(self, tensors: list) -> None:
        self._flagged.forget([held(t) for t in tensors])  # a DTensor's local tensor, a sparse tensor's values

    def before(self, call: OpCall) -> None:
        verbose = self._logger.isEnabledFor(logging.DEBUG)
        if self._first_overflow is not None and not verbose:
            return
        if signature_of(call.name) is not None:
            # A collective writes what it received over what it sent: what was sent is measured now (on the device).
            bound = collective_call(call.name, call.func, call.args, call.kwargs)
            if bound is not None and not bound.coalesced:  # a coalesced one runs later: read by its readers
                sent = [t for t in map(held, bound.sent) if _checked(t)]
                call.state = {"collective": bound, "sent": _largest_magnitudes(sent) if sent else []}
            return
        spec = call_writes(call.name)
        if not spec.never:  # what an in-place op overwrites is its input as it was: flagged before the op
            views: dict = {}
            written = [t for t in (held(t, views) for t in spec.written(call.args, call.kwargs)) if _checked(t)]
            if written:
                unread = _unread_targets(call.name, spec, call.args, call.kwargs, views)
                flags = self._flags_before([t for t in written if id(t) not in unread],
                                           self.raise_on_overflow or verbose)
                # an out= tensor, copy_'s or fill_'s target: what it held is no input (an empty's garbage)
                flags.update((i, ("kind", FINITE)) for i in unread)
                call.state = _Written(written, flags, views)

    def _flags_before(self, written: list[torch.Tensor], at_once: bool) -> dict[int, tuple]:
        """``id(tensor) -> how its flag comes``: ``("kind", kind)`` read now (``at_once``, or on the CPU), ``("taken",
        check, index)`` from an earlier check of it unchanged, or ``("witness", witnesses, count)`` on the device."""
        if not written:
            return {}
        with torch.no_grad():
            if at_once:
                return {id(t): ("kind", kind) for t, kind in zip(written, nonfinite_kinds(written))}
            flags: dict[int, tuple] = {}
            by_device: dict[torch.device, list[torch.Tensor]] = {}
            for t in written:
                found = self._flagged.find(t) if self.sees_every_call else None
                if found is not None and found[1] is not None:
                    flags[id(t)] = ("taken", *found[1])
                else:
                    by_device.setdefault(t.device, []).append(t)
            for device, tensors in by_device.items():
                witnesses, counts = _witnesses(tensors)
                if device.type == "cpu":  # host values: read now, all in one
                    for t, kind in zip(tensors, _kinds_of(torch.stack(witnesses).tolist(), counts)):
                        flags[id(t)] = ("kind", kind)
                    continue
                start = 0
                for t, count in zip(tensors, counts):
                    flags[id(t)] = ("witness", witnesses[start:start + count], count)
                    start += count
            return flags

    def after(self, call: OpCall) -> None:
        written = call.state if type(call.state) is _Written else None
        if written is not None:  # the call, kept by its backward hooks, must not keep what it wrote alive (a cycle
            call.state = {}  # through another tool's autograd.Function node, which no collection breaks)
        verbose = self._logger.isEnabledFor(logging.DEBUG)
        if self._first_overflow is not None and not verbose:  # nothing more to find or to print
            return
        if isinstance(call.state, dict) and "collective" in call.state:
            if call.state["collective"].asynchronous:  # what it receives is there once the program waits for it
                bound = call.state["collective"]
                self.check_when_waited(call, self._check_collective, bound.received, bound)
            else:
                self._check_collective(call)
            return
        facts = op_facts(call.name)
        # Memory never written (an empty's), or the program's own data: whatever it holds, no op made it.
        if facts.uninitialised or facts.from_data:
            self.skipped["uninitialised" if facts.uninitialised else "the program's own data"] += 1
            if written is not None:  # resize_, set_
                self._flagged.forget(written.tensors)
            return
        before = None
        views = None
        if written is not None:
            before, views = written.flags, written.views
            self._flagged.forget(written.tensors)  # flags taken over from them are out of date now
        # A functional collective's result is written by the collective's thread until wait_tensor: it is checked
        # there, where an inf/nan another rank sent shows as born (what was waited for is no input).
        inputs = [] if facts.completes else named_tensors(f"{call.name} input",
                                                          tuple(call.args) + tuple(call.kwargs.values()), views)
        outputs = [] if facts.async_result else named_tensors(f"{call.name} output", reporting.as_tuple(call.result),
                                                              views)
        header = None
        if verbose:
            rows = reporting.call_rows(call.name, call.args, call.kwargs, call.result)
            header = reporting.header(call.name, call.forward_id, call.location) + "\n" + \
                reporting.call_table(call.name, rows)
        self._follow_functions(call, inputs, outputs)
        self._check(call, inputs, outputs, "forward", header,
                    scalars=scalar_values(call.name, call.args, call.kwargs, facts.order), before=before)

    def _follow_functions(self, call: OpCall, inputs: list, outputs: list) -> None:
        """Check the backward of a custom ``torch.autograd.Function`` whose result ``call`` reads, as one call (its
        node's upstream gradients against what its ``backward()`` returned): its ops run on autograd's thread, where
        no tool sees them (a reentrant ``torch.utils.checkpoint``'s recomputation and backward, a user's Function).
        Named ``autograd.Function <name>``, with the module a checkpoint ran, else ``call``'s, and ``call``'s
        forward_id and line. A Function that made ``call``'s own result is followed as ``call``'s (a compiled
        graph's run); one that hands gradients on unchanged (``custom_functions.PASS_THROUGH``) is not."""
        functions = self._functions
        for _, t in outputs:
            # made by the call (numbered from its first node on), not an input it hands back (x.to(x.dtype))
            if t.requires_grad and (node := custom_node(t)) is not None and node._sequence_nr() >= call.first_node:
                functions.add(node)
        for _, t in inputs:
            if not t.requires_grad or (node := custom_node(t)) is None or node in functions:
                continue
            functions.add(node)
            name = function_name(node)
            if name is None:
                continue
            self.functions_checked[name] += 1
            call.keep_location()  # while the user's frames are on the stack
            backward = call.without_values()
            backward.name, backward.state, backward.first_node = f"autograd.Function {name}", {}, -1
            module = checkpointed_module(node)
            backward.module_path = (module_path.path_of(module) if module is not None else None) or call.module_path
            register_backward_hooks(backward, self, [node])

    def _check_collective(self, call: OpCall) -> None:
        """Born here when what arrived holds inf/nan and what this rank sent did not: received from another rank."""
        bound, sent = call.state["collective"], call.state["sent"]
        received = [t for t in map(held, bound.received) if _checked(t)]
        if self._first_overflow is not None or not received:
            return
        if not any(nonfinite_flags(received)):  # read at once: collectives are few per step
            return
        if sent and not all(math.isfinite(v) for v in torch.stack(sent).cpu().tolist()):
            return  # this rank sent it: an earlier call made it
        if self._checks:  # an earlier call still in flight may be the first
            self._judge(wait=True)
            if self._first_overflow is not None:
                return
        phase = "backward" if torch._C._current_graph_task_id() >= 0 else "forward"  # DDP's buckets: in backward
        rows = statistics_rows([(f"{call.name} received", t) for t in received])
        self._found(Overflow(call.name, call.forward_id, phase, call.location, call.module_path, call.step,
                             call.time, received=True), call.name, rows)

    def after_backward(self, call: OpCall, grad_inputs: tuple, grad_outputs: tuple) -> None:
        self._check_gradients(call, grad_inputs, grad_outputs, self._logger.isEnabledFor(logging.DEBUG))

    def inner_node_backward(self, call: OpCall, grad_inputs: tuple, grad_outputs: tuple) -> None:
        # Inside a composite function: an inf/nan born there is the function's.
        self._check_gradients(call, grad_inputs, grad_outputs, False)

    def _check_gradients(self, call: OpCall, grad_inputs: tuple, grad_outputs: tuple, print_table: bool) -> None:
        if self._first_overflow is not None and not print_table:
            return
        # Backward runs from grad_outputs (upstream) to grad_inputs; the table lists grad_inputs first.
        self._check(call, named_tensors(f"{call.name} grad_outputs", grad_outputs),
                    named_tensors(f"{call.name} grad_inputs", grad_inputs), "backward",
                    reporting.header(call.name, call.forward_id, call.location, "backward") if print_table else None,
                    results_first=True)

    def finish(self) -> None:
        """The first overflow, written for the run's other readers (each rank its own file under torchrun), and the
        iterations GradScaler skipped for an overflow of their scaled gradients."""
        if self._applied_listener:
            self._applied_listener = False
            loss_scaling.unlisten(self)
        first = self.first_overflow  # what is still in flight is read first
        held, self._held = self._held, None
        if held is not None and first is None:  # an iteration GradScaler's update() never ended: not known skipped
            self._settle(held, None, at="stop")
        first = self.first_overflow or self.first_seen
        self._flagged.clear()
        if self.loss_scale_overflows:
            path = result_files.results_path(self.common, self.results_folder, f"loss_scale_overflows_{self.stem}.json")
            record = {"format": "op_tools loss-scale overflows", "version": 1, "rank": self.common.rank,
                      "iterations": self.loss_scale_overflows}
            self.tally.add(path, result_files.write_json(path, record), "loss-scale overflows (no finding)")
        if first is None:
            return
        path = result_files.results_path(self.common, self.results_folder, f"overflow_{self.stem}.json")
        self.tally.add(path, result_files.write_json(path, first.record(self.common.rank)),
                       "first overflow" if not first.came_in else "first inf/nan read, made by no call checked")

    @property
    def first_seen(self) -> Overflow | None:
        """Where no call made inf/nan from finite inputs but one came in from outside the calls checked: the first
        call, in execution order, that read it. None otherwise."""
        return self._first_seen[0] if self.first_overflow is None and self._first_seen is not None else None

    def closing_line(self) -> str:
        found = self.found()
        seen = self.first_seen
        if seen is not None and self._first_seen is not None:  # the run held inf/nan that no call checked made
            what = "a nan" if self._first_seen[1] == NAN else "an inf"
            # in a backward, the gradient it read may be autograd's sum of those the calls reading one tensor sent
            # it (a float16 residual stream's): a sum no call makes, which overflows where each part is finite
            summed = "autograd's sum of the gradients several calls sent one tensor, " if seen.phase == "backward" \
                else ""
            found = (f"no call checked made inf/nan from finite inputs; {seen.name}"
                     f"{f' in {seen.module}' if seen.module else ''} ({seen.phase}) forward_id: {seen.forward_id} "
                     f"read {what} first, from outside the calls checked ({summed}the program's data, a call not "
                     "handled, or a write no call showed)")
        elif not found:  # a clean verdict only when every handled call was checked
            found = "no inf/nan from finite inputs" if not self.not_checked() else \
                "no inf/nan from finite inputs among the calls checked"
        if self.loss_scale_overflows:
            found += f"; {self._loss_scale_text()}"
        if self.functions_checked:  # checked as units: what runs inside them no tool sees
            count = sum(self.functions_checked.values())
            found += (f"; the backward of {count} custom autograd.Function{'s' if count != 1 else ''} checked whole "
                      f"({', '.join(self.functions_checked)}: the ops inside unseen)")
        if self.stale_flags:
            found += (f"; {self.stale_flags} flags taken over from an earlier call found out of date (a write no call "
                      "showed) and read again")
        return f"{super().closing_line()}; {found}"

    def _loss_scale_text(self) -> str:
        """The closing line's account of the loss-scale overflows: how many, and the first iterations' scales."""
        count = len(self.loss_scale_overflows)
        shown = "; ".join(f"scale {o['scale']:g} -> {o['new_scale']:g} in iteration {o['iteration']}: {o['op']} "
                          f"({o['phase']})" for o in self.loss_scale_overflows[:2])
        return (f"{count} loss-scale overflow{'s' if count != 1 else ''}, no finding (iterations GradScaler skipped, "
                f"their scaled gradients overflowing: {shown}{'; ...' if count > 2 else ''})")

    def _closing_level(self) -> int:
        return logging.WARNING if self.first_seen is not None else super()._closing_level()

    def found(self) -> str:
        """The first overflow; or, where no call made one, the first call that read an inf/nan: not a clean run."""
        first = self.first_overflow or self.first_seen
        return str(first).split("\n")[0] if first else ""

    def backward_done(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            raise OverflowDetectedError(str(pending))

    def _check(self, call: OpCall, sources: list, results: list, phase: str, table_header: str | None,
               results_first: bool = False, scalars: int = 0, before: dict | None = None) -> None:
        """Flag ``sources`` and ``results`` (``(name, tensor)`` pairs): all statistics, read in one transfer, when
        ``table_header`` asks for the table; at once when an overflow must raise at its op; otherwise queued on
        the device and judged when its batch arrives (``_queue``). ``before``: the flags of the sources the op
        wrote, taken before it ran (``_flags_before``); ``scalars``: what its float arguments can put in its results
        (``scalar_values``)."""
        ordered = results + sources if results_first else sources + results
        split = len(results) if results_first else len(sources)
        signs: list[int] = []
        # an inf argument of one sign: the results' witnesses tell their infs' signs
        signed = [(i < split) == results_first for i in range(len(ordered))] if _one_sign(scalars) else None
        if table_header is not None:
            rows = statistics_rows(ordered)
            if before:  # an input the call wrote: its flag as it was before (read then), its values gone
                for i in range(split):
                    flag = before.get(id(ordered[i][1]))
                    if flag is not None:
                        rows[i] = {"name": rows[i]["name"], "inf_or_nan": _read_flag(flag) != FINITE,
                                   **dict.fromkeys(_STATISTICS, OVERWRITTEN)}
            self._logger.debug(table_header + "\n" + reporting.call_table(call.name, rows, STAT_COLUMNS))
            flags, signs = nonfinite_values([t for _, t in ordered], signed) \
                if any(row["inf_or_nan"] for row in rows) else ([FINITE] * len(rows), [])
        elif not any(_checked(t) for _, t in results):  # no floating result: nothing can overflow here
            return
        elif not self.raise_on_overflow:
            tensors = [t for _, t in ordered]
            self._queue(_PendingCheck(call, phase, ordered, split, results_first, self._kept.keep(tensors), scalars),
                        tensors, before)
            return
        else:  # raised at the op: its tensors kept for the statistics of the one that overflows
            flags, signs = nonfinite_values([t for _, t in ordered], signed)
            rows = None
        if self._checks:  # judged in execution order: the calls in flight first
            self._judge(wait=True)
        if self._first_overflow is not None:
            return
        check = _PendingCheck(call, phase, ordered, split, results_first,
                              self._kept.keep([t for _, t in ordered]) if rows is None else None, scalars)
        check.flags, check.table = bytearray(flags), rows
        if check.signs is not None and signs:
            check.signs[:] = bytes(signs)
        if before:
            for i in check.source_indices():
                flag = before.get(id(ordered[i][1]))
                if flag is not None:
                    check.flags[i] = _read_flag(flag)
                    check.written = [*check.written, i]
        try:
            self._verdict(check)
        finally:
            if check.kept is not None:  # held for GradScaler's verdict, it is its own (check.kept None)
                self._kept.release(check.kept)

    # --- checks in flight: flags computed on the device, judged in call order as their batch arrives ---

    def _queue(self, check: _PendingCheck, tensors: list[torch.Tensor], before: dict | None = None) -> None:
        """One fused reduction per device for the call's tensors not flagged already (``before`` the op, or by an
        earlier check: ``Flagged``), queued for the host; CPU tensors flagged now."""
        flagged = self._flagged if self.sees_every_call else None
        sources = check.source_indices()
        scanned: dict[torch.device, list[int]] = {}
        from_before: dict[torch.device, list[tuple[int, list[torch.Tensor], int]]] = {}
        remembered: list[tuple[tuple, int]] = []  # (where, index) of the tensors this check flags, once queued
        with self._checks_lock:
            self._checks.append(check)
            for i, t in enumerate(tensors):
                if not _checked(t):
                    continue
                flag = before.get(id(t)) if before and i in sources else None
                if flag is not None:
                    check.written = [*check.written, i]
                    if flag[0] == "witness":
                        from_before.setdefault(t.device, []).append((i, flag[1], flag[2]))
                    elif flag[0] == "taken":  # of the tensor before the op wrote it
                        check.take(i, flag[1], flag[2], False)
                    else:
                        check.flags[i] = flag[1]
                    continue
                found = flagged.find(t) if flagged is not None else None
                if found is not None and flagged is not None:
                    if found[1] is not None:  # the same tensor, unchanged since an earlier check took it
                        check.take(i, *found[1], True)
                        continue
                    remembered.append((found[0], i))
                scanned.setdefault(t.device, []).append(i)
            with torch.no_grad():
                for device in scanned.keys() | from_before.keys():
                    indices = scanned.get(device, [])
                    witnesses, counts = _witnesses([tensors[i] for i in indices], check.signed(indices)) \
                        if indices else ([], [])
                    for i, mine, count in from_before.get(device, ()):
                        indices.append(i)
                        witnesses.extend(mine)
                        counts.append(count)
                    if device.type == "cpu":  # host memory: nothing to wait for
                        check.arrived(indices, torch.stack(witnesses).tolist(), counts)
                    else:
                        check.remaining += 1
                        # tuples of numbers: the collector stops tracking them, where lists held until the batch is
                        # read would be promoted into its oldest generation
                        self._readback.put(witnesses, (check, tuple(indices), tuple(counts)))  # joined when sent
            if flagged is not None:
                for where, i in remembered:
                    flagged.put(where, check, i)
        self._judge(wait=False)

    def _judge(self, wait: bool) -> None:
        """Take in the flags that arrived (all of them, waiting, with ``wait``) and judge the calls complete, in
        order, up to the first one still in flight."""
        with self._checks_lock:
            for (check, indices, counts), values in (self._readback.drain() if wait else self._readback.ready()):
                if indices is None:  # a GradScaler update's scales and found_inf flags (_ScalerEvent)
                    check.values = values
                else:
                    check.arrived(indices, values, counts)
                check.remaining -= 1
            complete = []
            while self._checks and self._checks[0].remaining == 0:
                complete.append(self._checks.popleft())
        for check in complete:
            if self._first_overflow is None:
                if isinstance(check, _ScalerEvent):
                    self._scaler_verdict(check)
                else:
                    self._verdict(check)
            if check.kept is not None:
                self._kept.release(check.kept)

    def _verdict(self, check: _PendingCheck) -> None:
        check.take_over()
        source_kinds, result_kinds = check.sources_and_results()
        forward_id, phase = check.facts[1], check.facts[2]
        read = max(source_kinds, default=FINITE)
        # a backward reads its forward's tensors too (the saved ones): what they held is brought in
        saved = self._forward_kinds.get(forward_id, FINITE) if phase == "backward" else FINITE
        read = max(read, saved)
        if phase != "backward":
            result = max(result_kinds, default=FINITE)
            kind = NAN if NAN in (read, result) else result
            if kind != FINITE:
                if len(self._forward_kinds) >= FORWARDS_KEPT:
                    del self._forward_kinds[next(iter(self._forward_kinds))]  # the oldest: its backward long done
                self._forward_kinds[forward_id] = kind
        self._scalars_seen = max(self._scalars_seen, check.scalars)
        scalars = check.explaining_scalars()
        if born_here([read], result_kinds, scalars) and not (check.taken and self._stale(check, saved)):
            if self._scaled or self._held is not None:  # GradScaler's iteration: its update() may acquit it
                self._hold(check, phase, nan_from_finite=NAN in result_kinds and max(read, scalars) == FINITE)
            else:
                overflow = check.overflow
                self._found(overflow, overflow.name, check.rows())
        elif read > self._scalars_seen and self._first_seen is None:
            if self._scaled or self._held is not None:
                self._hold(check, phase, seen=read)
            else:
                self._first_seen = (dataclasses.replace(check.overflow, came_in=True), read)

    def _stale(self, check: _PendingCheck, saved: int) -> bool:
        """Whether the call, which looks born, is not: a flag it took over from an earlier check was out of date (a
        write no call showed, such as a collective run from C++). Its tensors are read again where what they hold
        now is what they held at the call but for such a write: kept, and their earlier check still the one on
        record for them. A tensor let go of, written since by a call seen (a foreach optimizer's update, which no
        version counter shows), or written by the call itself (what it held before is gone) keeps the flag taken
        over. ``saved``: what the call's saved tensors held, for a backward call (its forward's flags)."""
        kept = check.kept
        again: list[tuple[int, torch.Tensor]] = []
        for i, earlier, j, now in check.taken:
            t = kept.get(i) if now and kept is not None else None
            found = self._flagged.find(t) if t is not None else None
            if t is not None and found is not None and found[1] is not None and found[1][0] is earlier and \
                    found[1][1] == j:
                again.append((i, t))
        changed = 0
        for (i, _), kind in zip(again, nonfinite_kinds([t for _, t in again]) if again else []):
            if kind != check.flags[i]:
                check.flags[i] = kind
                changed += 1
        self.stale_flags += changed
        sources, results = check.sources_and_results()
        return changed > 0 and not born_here([saved, *sources], results, check.explaining_scalars())

    # --- GradScaler's iterations: what their scaled gradients made waits for their update() ---

    def loss_scaled(self, scaler) -> None:
        self._scaler_event(_ScalerEvent(SCALED, id(scaler)))

    def gradients_unscaled(self, scaler) -> None:
        self._scaler_event(_ScalerEvent(UNSCALED, id(scaler)))

    def scale_updated(self, scaler, values: torch.Tensor | None) -> None:
        self._scaler_event(_ScalerEvent(UPDATED, id(scaler), values))

    def _scaler_event(self, event: _ScalerEvent) -> None:
        """Judge ``event`` in the program's order: queued behind the checks in flight (its values read back with
        theirs), or at once where no check is in flight and each call is read as it runs (raise mode, the tables);
        then its values are read (one transfer) only where the iteration made something held."""
        if threading.get_ident() not in self._threads and not self._applied_listener or \
                self._first_overflow is not None:
            return  # a scaler on a thread this tool does not check (apply_feature's checks every thread); or done
        try:
            with tool_work():
                at_once = self.raise_on_overflow or self._logger.isEnabledFor(logging.DEBUG)
                with self._checks_lock:
                    queued = bool(self._checks) or not at_once
                    if queued:
                        self._checks.append(event)
                        if isinstance(event.values, torch.Tensor):
                            event.remaining = 1
                            self._readback.put(event.values, (event, None, None))
                if queued:
                    self._judge(wait=at_once and self._held is not None)
                    return
                if self._held is not None and isinstance(event.values, torch.Tensor):
                    event.values = event.values.tolist()
                self._scaler_verdict(event)
        except OpToolsAbortError:
            raise
        except Exception as error:  # the iteration is then not known skipped: what it made is reported
            if self.common is not None and self.common.strict:
                raise
            self.report_failure("GradScaler", error)

    def _scaler_verdict(self, event: _ScalerEvent) -> None:
        if event.what == SCALED:
            self._scaled.add(event.scaler)
            return
        if event.what == UNSCALED:
            self._unscaled = True
            return
        self._scaled.discard(event.scaler)
        values = event.values
        skipped = None
        # the scale the iteration ran with above 1 (scaling by 1 or less makes no overflow the unscaled backward would
        # not have), and a found_inf flag set: GradScaler skipped the optimizer step
        if isinstance(values, list) and len(values) > 2 and values[0] > 1 and any(v != 0 for v in values[2:]):
            skipped = (values[0], values[1])
        self._updates.append(skipped)
        if self._scaled:  # another scaler scaled a loss of this iteration and has not updated yet
            return
        updates, self._updates, self._unscaled = self._updates, [], False
        self._iteration += 1
        held, self._held = self._held, None
        if held is not None:
            self._settle(held, updates if all(updates) else None, at="update")

    def _hold(self, check: _PendingCheck, phase: str, seen: int = FINITE, nan_from_finite: bool = False) -> None:
        """In an iteration whose loss GradScaler scaled: an overflow born in its backward (or, with ``seen``, an
        inf/nan first read there or after its gradients were unscaled) waits for its update(); one born elsewhere
        after it is a finding that waits too (the earlier one may be the first); other reads of its inf/nan are its
        own. A nan from finite inputs is no overflow (a scale makes finite values larger: an inf first, a nan only
        from infs): a finding wherever it is."""
        # Born after the gradients were unscaled (a user's metric between unscale_ and update), an overflow is no
        # scale's: GradScaler computed its flags before it, on gradients it then made small; only what the scaled
        # backward made, and its inf/nan read later (clip_grad_norm_ on inf gradients), waits for the update()
        scaled_part = bool(self._scaled) and not nan_from_finite and \
            (phase == "backward" or self._unscaled and seen != FINITE)
        held = self._held
        if held is None:
            if not scaled_part:  # a forward: no scale makes its overflow
                if seen == FINITE:
                    self._found(check.overflow, check.overflow.name, check.rows())
                else:
                    self._first_seen = (dataclasses.replace(check.overflow, came_in=True), seen)
                return
            held = self._held = _Held()
        kept, check.kept = check.kept, None  # released when the iteration is settled (the deque's release skips it)
        if scaled_part and seen != FINITE:
            if held.seen is None and held.scaled is None:
                held.seen, held.seen_kind = (check, kept), seen
                return
        elif scaled_part:
            if held.scaled is None:
                held.scaled = (check, kept)
                held.order.append("scaled")
                return
        elif seen == FINITE and held.later is None:
            held.later = (check, kept)
            held.order.append("later")
            return
        elif seen != FINITE and held.later_seen is None and self._first_seen is None:
            # data bringing its own inf/nan (the next micro-batch's): no scale made it, whatever GradScaler says
            held.later_seen, held.later_seen_kind = (check, kept), seen
            return
        if kept is not None:
            self._kept.release(kept)

    def _settle(self, held: _Held, skipped: list | None, at: str) -> None:
        """The iteration's update() is judged (or the tool stops): ``skipped``, the (scale, scale after) of each
        update where GradScaler skipped the iteration with a scale above 1, else None. Skipped: what its scaled
        gradients made is counted as a loss-scale overflow, no finding; else it is judged as any call."""
        first: tuple[_PendingCheck, KeptTensors | None] | None = None
        if skipped is not None:
            made = held.scaled or held.seen
            assert made is not None
            overflow = made[0].overflow
            scale, new_scale = skipped[0]
            self.loss_scale_overflows.append(
                {"iteration": self._iteration - 1, "step": overflow.step, "time": round(overflow.time, 6),
                 "op": overflow.name, "module": overflow.module, "phase": overflow.phase,
                 "forward_id": overflow.forward_id, "read": held.scaled is None, "scale": scale,
                 "new_scale": new_scale})
            self._logger.info(reporting.fit_line(
                f"OpOverflowCheck: loss-scale overflow, no finding: {overflow.name} ({overflow.phase}) in GradScaler's "
                f"iteration {self._iteration - 1} (step {overflow.step}), which it skipped (scale {scale:g} -> "
                f"{new_scale:g})"))
            first = held.later
        elif held.order:
            first = held.scaled if held.order[0] == "scaled" else held.later
        elif held.seen is not None and self._first_seen is None:
            self._first_seen = (dataclasses.replace(held.seen[0].overflow, came_in=True), held.seen_kind)
        if held.later_seen is not None and self._first_seen is None:  # after the excused or unread scaled part's
            self._first_seen = (dataclasses.replace(held.later_seen[0].overflow, came_in=True), held.later_seen_kind)
        for check, kept in held.checks():
            if check is not (first[0] if first is not None else None) and kept is not None:
                self._kept.release(kept)
        if first is not None:
            check, kept = first
            check.kept = kept
            rows = check.rows()
            if kept is not None:
                self._kept.release(kept)
            self._found(check.overflow, check.overflow.name, rows, at=at)

    def _found(self, overflow: Overflow, name: str, rows: list[dict], at: str = "op") -> None:
        """The first overflow: said with its call's statistics, nothing more queued, raised if asked: at its op (for
        an op in backward: as backward() returns); held for GradScaler's verdict, at its update() (``at``); not
        when the tool stops."""
        self._first_overflow = overflow
        held, self._held = self._held, None
        if held is not None:
            for _, kept in held.checks():
                if kept is not None:
                    self._kept.release(kept)
        with self._checks_lock:
            self._readback.discard()
            for check in self._checks:
                if check.kept is not None:
                    self._kept.release(check.kept)
            self._checks.clear()
        note = ""
        if any(row.get("min") == NOT_KEPT for row in rows):
            # the settings that read each call as it runs, where none is in use
            setting = "" if self.raise_on_overflow or self._logger.isEnabledFor(logging.DEBUG) else \
                "; OP_OVERFLOW_CHECK_RAISE=1 or OP_TOOLS_VERBOSE=1 reads each call as it runs"
            note = "\n" + reporting.fit_line(
                "(statistics not kept: tensors written in place, or let go of to bound memory, before this call's "
                f"check was read{setting})")
        if any(row.get("min") == OVERWRITTEN for row in rows):
            note += "\n" + reporting.fit_line(
                "(overwritten: an input this call wrote in place; its inf_or_nan was read before the call, what it "
                "wrote is its output)")
        finding, location = str(overflow).split("\n", 1)  # the finding wraps at the width; the location is code
        self._logger.warning(f"\n{reporting.fit_line('OpOverflowCheck: ' + finding)}\n{location}\n"
                             + reporting.call_table(name, rows, STAT_COLUMNS) + note)
        if self.raise_on_overflow and at != "stop":
            if overflow.phase == "backward" and at == "op":  # raised when backward() returns, on the caller's thread
                self._pending = overflow
            else:
                raise OverflowDetectedError(str(overflow))
