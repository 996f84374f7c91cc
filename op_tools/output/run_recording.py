"""A light recording of a run (``OP_CAPTURE_MODE=stats``): per handled call, forward and backward, what ran where
and statistics of its tensors. ``python -m op_tools.compare_runs`` reads two of them.

A recording is a JSON-lines file ``<OP_TOOLS_RESULTS_DIR>/op_capture_results[/rank<N>]/run_<session>.jsonl``
(``.partial`` until the tool stops). Its first line is the header::

    {"format": "op_tools run recording", "version": 2, "tensor_fields": [...], "torch": "2.13.0", "rank": null,
     "pid": 4242, "time": 1718000000.123456, "ops": null, "disable": []}

then one line per call, in the order the calls ended::

    {"seq": 7, "phase": "forward", "step": 0, "time": 1718000000.234567, "module": "model.layers.1.mlp.act_fn",
     "index": 0, "op": "torch.nn.functional.silu", "device": "sim:0", "autocast": null,
     "inputs": [["[0]", "float32", [2, 16, 128], min, max, mean, norm, nan, inf, fingerprint]], "outputs": [...]}
    {"seq": 90, "phase": "backward", "step": 0, "time": ..., "module": ..., "index": 0, "op": ..., "forward_seq": 7,
     "device": "sim:0", "grad_outputs": [...], "grad_inputs": [...], "complete": true}

- ``step``: how many ``optimizer.step()`` calls (any ``torch.optim`` optimizer) had finished when the call's
  forward ran, counted from the tool's start: a training loop's iteration. A backward record has its forward's step.
  Counted once for every tool (``core/steps.py``): the same number as the other tools' ``step`` columns.
- ``time``: wall-clock seconds since the epoch (``time.time()``, to the microsecond) when the call started (a
  backward record: when its backward finished); the header's when the recording started. The rank is the header's
  ``rank`` (torchrun's ``RANK``; ``null`` outside torchrun). The header's ``ops`` and ``disable``: the patterns of
  ``OP_CAPTURE_LIST`` (``null``: every op) and ``OP_CAPTURE_DISABLE_LIST`` the recording used (absent in a
  recording made before they were written: unknown).
- ``module``/``index``: the module running the call (``module_path.py``) and the call's rank among the calls of
  that module path in this step, from 0. A backward record has its forward's.
- ``phase``: ``forward``, ``backward`` (the gradients of the call's outputs and of its inputs that require grad,
  once its whole backward ran; or, with ``"in_backward": true`` and no ``forward_seq``, a call that backward makes
  of its own, its ``inputs`` and ``outputs``: DDP's gradient all-reduce, a hook's ops), ``optimizer`` (a call inside
  ``optimizer.step()``), or ``recompute`` (a checkpoint's recomputation of a forward call in backward,
  ``ops/checkpoint_recomputation.py``; kept apart so that it never counts as a second forward).
- ``device``: the real device of the call's first tensor (``DITORCH_SHOW_DEVICE_AS_CUDA`` does not change it).
- a tensor: ``[where, dtype, shape, *tensor_stats.STAT_FIELDS]``, ``where`` its place in the arguments
  (``[0]``, ``[weight]``); an empty tensor has no statistics. At most ``OP_CAPTURE_STATS_MAX_TENSORS`` per side;
  ``"omitted": {"inputs": n}`` counts the others.
- ``unrecorded`` (format version 2): the statistics of the call could not be computed (a sparse tensor, a kernel
  the device lacks), the error instead of its tensors: compare_runs counts the call as not compared. OpCapture
  counts it as not checked.

The last line ``{"end": {"records": n, "bytes": b}}`` marks a complete file; ``"ended_by": "SIGTERM"`` (or ``"an
exception (RuntimeError: ...)"``) in it says that the run did not end normally: the file is whole, the run is not
(compare_runs takes it for an incomplete recording). No ``ended_by`` (and every recording before it): ended normally.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import re
import threading
import time
from collections.abc import Sequence
from json.encoder import encode_basestring_ascii
from typing import Any

import torch

from ..numerics.current_values import CurrentValues, locate_values
from ..numerics.device_readback import DeviceReadback, KeepBudget, KeptTensors
from ..numerics.tensor_stats import (
    STAT_FIELDS,
    STATS_WIDTH,
    calls_stats,
    finished_values,
    nonfinite_counts,
    split_stats,
)
from ..ops.arguments import local_part, real_device, storage_address, strided, tensor_items
from ..ops.checkpoint_recomputation import in_recomputation
from ..ops.collectives import collective_call, signature_of
from ..ops.op_facts import op_facts
from ..ops.torch_versions import autocast_dtype
from ..ops.writes import call_writes, overwritten
from . import reporting, result_files

FORMAT = "op_tools run recording"
FORMAT_VERSION = 2  # 2: "unrecorded" records (a reader of version 1 would take them for equal)
TENSOR_FIELDS = ("where", "dtype", "shape", *STAT_FIELDS)


def _tensors(items, limit: int) -> tuple[list[tuple[str, torch.Tensor]], int]:
    """The first ``limit`` of ``(where, tensor)`` items, and how many more there were; a DTensor is
    recorded as the part this rank holds (its shape is the part's)."""
    found = [(where, local_part(v)) for where, v in items]
    return found[:limit], max(0, len(found) - limit)


def _described(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".splitlines()[0]
    return text if len(text) <= 200 else text[:197] + "..."


def _time(seconds: float) -> float:
    return round(seconds, 6)  # microseconds: what a clock read means


_ROUNDED = "%.8g " * len(STAT_FIELDS)


def _rounded(values) -> list[float]:
    """The values to float32 precision, 9 characters, not 18: ``float(f"{v:.8g}")`` each, formatted in one call and
    parsed in one ``map`` (a record's values are its host work's largest part on a fast device)."""
    return list(map(float, (_ROUNDED % tuple(values)).split()))


# A record's statistics written straight into its line: ``format(v, ".8")`` per value gives, in one C call for a
# whole side, the text JSON gives ``float(f"{v:.8g}")`` (what ``_rounded`` makes), where parsing each value back and
# JSON's shortest repr of it were most of a record's host work. The two texts differ for values JSON writes as
# ``Infinity``/``NaN``, for values from 1e7 to 1e16 (``.8`` writes an exponent where JSON writes ``123456780.0``), and
# for subnormals (whose shortest repr may be shorter than 8 digits): a side whose text holds one of these, or names
# that look like one, is written through JSON as before (``_FALLBACK``). The bytes are the same either way.
_VALUE = "{:.8}"
_FALLBACK = re.compile(r"inf|nan|e\+(?:0[7-9]|1[0-5])|e-3")
_TEMPLATES: dict[tuple, str] = {}  # a side's described tensors -> the format string of its text
TEMPLATES_KEPT = 4096


def _template(described: tuple) -> str:
    """The format string of a side's entries: its names, dtypes and shapes as JSON writes them (braces doubled), a
    ``{:.8}`` per statistic of its non-empty tensors. Made once per kind of side: a step's calls repeat."""
    template = _TEMPLATES.get(described)
    if template is None:
        entries = []
        for where, dtype, shape, n in described:
            static = f"[{encode_basestring_ascii(where)},{encode_basestring_ascii(dtype)},[{','.join(map(str, shape))}]"
            static = static.replace("{", "{{").replace("}", "}}")
            entries.append(static + ("," + ",".join([_VALUE] * len(STAT_FIELDS)) if n else "") + "]")
        if len(_TEMPLATES) >= TEMPLATES_KEPT:
            _TEMPLATES.clear()
        template = _TEMPLATES[described] = "[" + ",".join(entries) + "]"
    return template


READBACK_BATCH = 64  # calls whose statistics travel to the host together: one copy, no synchronisation
KEPT_BYTES = 256 * 2**20  # tensors kept for their nan/inf counts until read (numerics/device_readback.py)
UNKNOWN_COUNT = -1  # the nan or inf count of a tensor written in place, or let go of, before its statistics arrived
KNOWN_ENTRIES = 4096  # tensors whose statistics a later record may take over instead of measuring them again


class _Slot:
    """Where the statistics of one tensor arrive (``min, max, norm, sum, *fingerprints``); shared by the records of a
    tensor unchanged between their calls (``RunRecorder.known``). The alias kept for the tensor's nan and inf counts
    is the measuring record's (``kept``, at ``index``), and the counts, once read, are kept here for the others."""

    __slots__ = ("values", "kept", "index", "counts")

    def __init__(self) -> None:
        self.values: tuple[float, ...] | None = None
        self.kept: KeptTensors | None = None
        self.index = 0
        self.counts: tuple[int, int] | None = None

    def nonfinite_counts(self) -> tuple[int, int]:
        """The tensor's ``(nan, inf)`` counts, read from the alias the first time (``UNKNOWN_COUNT`` each where the
        tensor was written in place, or let go of, before)."""
        if self.counts is None:
            tensor = self.kept.get(self.index) if self.kept is not None else None
            self.counts = nonfinite_counts(tensor) if tensor is not None else (UNKNOWN_COUNT, UNKNOWN_COUNT)
        return self.counts


_DTYPE_NAMES: dict[torch.dtype, str] = {}  # torch.float32 -> "float32"


class _Side:
    """The tensors of one side of a call; what the record says of each tensor is taken now, the tensors themselves are
    not kept (``kept``: aliases, for nan/inf counts). Their statistics (``groups``, ``tensor_stats.calls_stats``) are
    computed by ``measure``, or with the other side's (``_measured``), which costs fewer launches."""

    __slots__ = ("name", "described", "omitted", "groups", "count", "kept", "device", "slots", "fresh", "places")

    def __init__(self, name: str, tensors: list[tuple[str, torch.Tensor]], omitted: int,
                 known: CurrentValues | None = None, measured_again: frozenset[int] = frozenset()) -> None:
        self.name, self.omitted = name, omitted
        self.device = str(real_device(tensors[0][1])) if tensors else None  # of its first tensor
        # where, dtype, shape, and the number of real values (0: empty, no statistics). Tuples of numbers and
        # strings, here and below, wherever a record's state lives until its statistics arrive: the collector stops
        # tracking them, where each list a record holds would count towards the next full collection of the heap.
        described = []
        kept = []
        for where, t in tensors:
            # a sparse tensor's statistics would need its values by index; a meta tensor (``to_empty``'s input) has
            # none, recorded as an empty one is
            n = 0 if t.is_meta else strided(t, "are not measured").numel()
            dtype = t.dtype
            dtype_name = _DTYPE_NAMES.get(dtype)
            if dtype_name is None:
                dtype_name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
            described.append((where, dtype_name, tuple(t.shape), n * 2 if dtype.is_complex else n))
            if n:
                kept.append(t)
        self.described = tuple(described)
        self.kept: Sequence[torch.Tensor] = kept  # until the call's record is queued
        self.count = len(kept)
        self.groups: list[tuple[list[int], list]] | None = None  # None: not measured on its own
        # Per non-empty tensor where its statistics arrive: an earlier record's slot for a tensor unchanged since
        # (``known``), else a new one, measured here (``fresh``: their indices; ``places``: where to remember them).
        # A tensor in ``measured_again`` (its storage's address) is measured here whatever is known of it.
        slots: list[_Slot] = []
        fresh: list[int] = []
        places: list = []
        for k, t in enumerate(kept):
            place = locate_values(t) if known is not None else None
            slot = known.find(place) if known is not None and place is not None and not (
                measured_again and storage_address(t) in measured_again) else None
            if slot is None:
                slot = _Slot()
                fresh.append(k)
                places.append(place)
            slots.append(slot)
        self.slots: tuple[_Slot, ...] = tuple(slots)
        self.fresh: tuple[int, ...] = tuple(fresh)
        self.places: Sequence = places

    def measure(self) -> None:
        """Its statistics now, on its own: (indices among its non-empty tensors, the statistics) per device."""
        with torch.no_grad():
            fresh = self.fresh
            self.groups = [([fresh[i] for i in indices], values)
                           for indices, values in calls_stats([self.kept[k] for k in fresh], deferred=True)] \
                if fresh else []

    def remember(self, known: CurrentValues | None) -> None:
        """Its measured tensors' slots, for later records of them unchanged (once measuring them has succeeded)."""
        if known is not None:
            for k, place in zip(self.fresh, self.places):
                known.put(place, self.slots[k])
        self.places = ()  # the storages, not kept alive

    def entries(self) -> list[list]:
        """The record's entries, from the statistics read back."""
        slots = iter(self.slots)
        out = []
        for where, dtype, shape, n in self.described:
            entry: list = [where, dtype, shape]
            if n:  # an in-place op's input holding nan/inf is counted after the op wrote it
                slot = next(slots)
                if slot.values is None:  # taken over from a record whose statistics never arrived
                    raise RuntimeError("the statistics of an earlier call's tensor, taken over, were not read back")
                entry += _rounded(finished_values(n, slot.values, slot.nonfinite_counts))
            out.append(entry)
        return out

    def text(self) -> str | None:
        """The record's entries as the JSON text ``entries()`` gives, made without JSON; None where that text may
        differ (``_FALLBACK``): ``entries()`` then."""
        values: list[float] = []
        slots = iter(self.slots)
        for _, _, _, n in self.described:
            if n:
                slot = next(slots)
                if slot.values is None:
                    raise RuntimeError("the statistics of an earlier call's tensor, taken over, were not read back")
                values += finished_values(n, slot.values, slot.nonfinite_counts)
        text = _template(self.described).format(*map(float, values))
        return None if _FALLBACK.search(text) else text


def _passed_on(upstream: Sequence[torch.Tensor], gradients: list[tuple[str, torch.Tensor]]) -> frozenset[int]:
    """The storages (addresses) of the upstream gradients that a backward passes on as gradients of its inputs
    (``index_add``'s to ``self``, ``addcdiv``'s to ``input``) where it also computed another gradient: its kernels
    read the upstream gradient, and one that wrote it as scratch (no version bump shows it) changed the gradient it
    passed on, which would otherwise keep the statistics it had when it arrived, and the divergence show first at the
    next call reading it. A backward that computes nothing (``add``'s, a view's) passes its upstream gradient on as it
    came: nothing measured again."""
    if not upstream or len(gradients) < 2:  # one gradient: passed on or computed, not both
        return frozenset()
    arrived = {storage_address(u) for u in upstream}
    passed = frozenset(a for _, g in gradients if (a := storage_address(g)) in arrived and a is not None)
    return passed if passed and any(storage_address(g) not in passed for _, g in gradients) else frozenset()


def _measured(sides: list[_Side]) -> list[tuple[list[int], list[torch.Tensor]]]:
    """The statistics of a call's sides, indexed over their non-empty tensors in order: those of the sides not yet
    measured computed together, now."""
    groups, together, first = [], [], 0
    for side in sides:
        if side.groups is None:
            together += [(first + k, side.kept[k]) for k in side.fresh]
        else:
            groups += [([first + i for i in indices], values) for indices, values in side.groups]
        first += side.count
    if together:
        with torch.no_grad():
            groups += [([together[i][0] for i in indices], values)
                       for indices, values in calls_stats([t for _, t in together], deferred=True)]
    return groups


class _Pending:
    """A record whose statistics are on their way from the device; ``sides`` None: written as it is."""

    __slots__ = ("record", "sides", "kept", "host", "remaining")

    def __init__(self, record: dict, sides: list[_Side] | None, kept: KeptTensors | None) -> None:
        self.record, self.sides, self.kept = record, sides, kept
        self.host: tuple[_Slot, ...] = tuple(slot for side in sides or () for slot in side.slots)
        self.remaining = 0  # devices whose statistics have not arrived

    def line(self) -> str:
        """``finished()`` as one JSON line's text (without its newline), its sides' entries written straight from
        their values (``_Side.text``)."""
        assert self.sides is not None
        texts = []
        for side in self.sides:
            text = side.text()
            if text is None:
                return result_files.json_line(self.finished())
            texts.append(f',"{side.name}":{text}')
        omitted = {side.name: side.omitted for side in self.sides if side.omitted}
        head = result_files.json_line(self.record)
        return head[:-1] + "".join(texts) + (f',"omitted":{result_files.json_line(omitted)}' if omitted else "") + \
            "}"

    def finished(self) -> dict[str, Any]:
        """The record with its sides' entries."""
        record = self.record
        assert self.sides is not None
        omitted = {}
        for side in self.sides:
            record[side.name] = side.entries()
            if side.omitted:
                omitted[side.name] = side.omitted
        if omitted:
            record["omitted"] = omitted
        return record


class RunRecorder:
    """Writes one run recording; ``before``/``after``/``backward`` are called by OpCapture in stats mode.

    A call's step is the engine's (``call.step``, ``core/steps.py``); ``steps`` is that counter, read for whether
    an optimizer's ``step()`` is running (``in_optimizer``); without one, no call is in the optimizer phase.

    A tensor measured for one record and unchanged since (``numerics/current_values.py``: the same storage, view and
    version counter, and no call seen since wrote to it) is not measured again for a later one: the later record
    takes over its statistics, the same numbers. One op's output is the next op's input, so this spares about half
    the launches. ``sees_every_call()`` says whether the tool sees every call (a mode), without which the writes of
    the calls not seen would go unnoticed; ``note_writes`` is told of the writes of calls not recorded."""

    def __init__(self, path: str, max_tensors: int, rank: int | None, steps: Any = None,
                 sees_every_call=lambda: False, ops: Sequence[str] | None = None, disable: Sequence[str] = ()) -> None:
        self.max_tensors = max_tensors
        self.file = result_files.JsonLinesFile(path)
        # which ops the tool recorded (its LIST, None: every op, and DISABLE_LIST): compare_runs says when two
        # recordings of different selections are compared
        self.file.write({"format": FORMAT, "version": FORMAT_VERSION, "tensor_fields": list(TENSOR_FIELDS),
                         "torch": torch.__version__, "rank": rank, "pid": os.getpid(), "time": _time(time.time()),
                         "ops": None if ops is None else list(ops), "disable": list(disable)})
        self.records = 0
        self._steps = steps
        self._seq = itertools.count()
        self._indices: dict[str, int] = {}  # module path -> calls recorded in step _indices_step
        self._indices_step = 0
        self._lock = threading.Lock()
        self._readback = DeviceReadback(READBACK_BATCH)
        self._pending: collections.deque[_Pending] = collections.deque()  # in the order the calls ended
        self._pending_lock = threading.Lock()
        self._kept = KeepBudget(KEPT_BYTES)
        self.unread = 0  # records whose statistics could not be read back (written marked unrecorded)
        self._known = CurrentValues(KNOWN_ENTRIES, 0)
        self._sees_every_call = sees_every_call

    def note_writes(self, tensors: list) -> None:
        self._known.forget(tensors)

    def flush(self) -> None:
        """Once per step, as an optimizer step returns (OpCapture), so that a killed run loses about one step: start
        the copy of the statistics queued (the step's last calls, a batch not full), write the records whose
        statistics arrived (none waited for: on a device, this step's arrive by the next) and hand the file's lines
        to the system."""
        self._readback.send()
        self._write_arrived(wait=False)
        self.file.flush()

    def before(self, call) -> None:
        """Queue the statistics of the inputs (before an in-place op changes them)."""
        # a call made while backward runs: a checkpoint's recomputation of a forward call, or a call of its own (DDP's
        # gradient all-reduce, a hook's), recorded in the backward phase
        in_backward = torch._C._current_graph_task_id() != -1
        call.state["recompute"] = in_backward and in_recomputation()
        call.state["in_backward"] = in_backward and not call.state["recompute"]
        if torch.is_grad_enabled() and not call.state["recompute"]:
            grads: list[torch.Tensor] = []
            items = tensor_items(tuple(call.args)) + tensor_items(call.kwargs)
            for _, t in items:
                if t.requires_grad and all(t is not u for u in grads):
                    grads.append(t)
            call.grad_inputs = grads
        else:
            items = tensor_items(tuple(call.args)) + tensor_items(call.kwargs)
        if op_facts(call.name).overwritten:  # what the call fills without reading is no input (an empty's memory)
            unread = {id(t) for t in overwritten(call.name, tuple(call.args), call.kwargs)}
            items = [(where, t) for where, t in items if id(t) not in unread]
        try:
            known = self._known if self._sees_every_call() else None
            inputs = _Side("inputs", *_tensors(items, self.max_tensors), known=known)
            spec = call_writes(call.name)
            if not spec.never:  # measured before the op may write them; else with the outputs
                inputs.measure()
                inputs.remember(known)
                call.state["written"] = spec.written(call.args, call.kwargs)
            if signature_of(call.name) is not None:  # what a collective receives is its result (it returns none)
                bound = collective_call(call.name, call.func, call.args, call.kwargs)
                if bound is not None and not bound.coalesced:  # a coalesced one receives later, unseen
                    call.state["received"] = bound.received
            call.state["stats_inputs"] = inputs
        except Exception as e:
            call.state["unrecorded"] = _described(e)  # after() writes the call's record saying so
            raise

    def after(self, call) -> None:
        inputs = call.state.pop("stats_inputs", None)
        error: str | None = call.state.pop("unrecorded", None)  # before() failed, and was counted for it
        outputs: _Side | None = None
        raised: Exception | None = None
        known = self._known if self._sees_every_call() else None
        written = call.state.pop("written", None)
        received = call.state.pop("received", None)
        if written:  # what was measured of them before the op is out of date
            self._known.forget(written)
        try:
            # A functional collective's result is being written by its thread until waited for: not read here.
            if op_facts(call.name).async_result:
                results: tuple = ()
            elif received is not None and call.result is None:  # a collective (an asynchronous one at its wait)
                results = tuple(received)
            elif call.result is None and written and not call_writes(call.name).unknown:
                # a fused optimizer's step returns nothing: what its schema says it wrote is its result (else a fault
                # in it showed first in the next op reading the parameters, said to come from outside the recording)
                results = tuple(written)
            else:
                results = reporting.as_tuple(call.result)
            outputs = _Side("outputs", *_tensors(tensor_items(results), self.max_tensors), known=known)
        except Exception as e:
            error, raised = error or _described(e), e
        device = (inputs.device if inputs else None) or (outputs.device if outputs else None) or str(call.device)
        recompute = call.state["recompute"]
        step = call.step
        with self._lock:
            seq = next(self._seq)
            if step != self._indices_step:  # a new step: module paths count their calls from 0 again
                self._indices.clear()
                self._indices_step = step
            index = None
            if not recompute:
                index = self._indices.get(call.module_path, 0)
                self._indices[call.module_path] = index + 1
        call.state.update(seq=seq, step=step, index=index, device=device)
        autocast = None
        if call.device is not None and (dtype := autocast_dtype(call.device.type)) is not None:
            autocast = str(dtype).removeprefix("torch.")
        in_optimizer = self._steps is not None and self._steps.in_optimizer
        in_backward = call.state["in_backward"]
        phase = "recompute" if recompute else "backward" if in_backward else "optimizer" if in_optimizer else "forward"
        record = {"seq": seq, "phase": phase, "step": step, "time": _time(call.time),
                  "module": call.module_path, "index": index, "op": call.name, "device": device, "autocast": autocast}
        if in_backward:  # its inputs and outputs, not a call's gradients: no forward_seq (a reader before it counts the
            # record as damaged, never as agreeing)
            record["in_backward"] = True
        self._write_or_mark(record, [inputs, outputs] if inputs and outputs else None, error, raised)

    def backward(self, call, grad_outputs: tuple, grad_inputs: tuple, complete: bool) -> None:
        state = call.state
        sides: list[_Side] | None = None
        error: str | None = None
        raised: Exception | None = None
        known = self._known if self._sees_every_call() else None
        try:
            upstream = _Side("grad_outputs", *_tensors(tensor_items(tuple(grad_outputs)), self.max_tensors),
                             known=known)
            computed, omitted = _tensors(tensor_items(tuple(grad_inputs)), self.max_tensors)
            again = _passed_on(upstream.kept, computed) if known is not None else frozenset()
            sides = [upstream, _Side("grad_inputs", computed, omitted, known=known, measured_again=again)]
        except Exception as e:
            error, raised = _described(e), e
        with self._lock:
            seq = next(self._seq)
        record = {"seq": seq, "phase": "backward", "step": state["step"], "time": _time(time.time()),
                  "module": call.module_path,
                  "index": state["index"], "op": call.name, "forward_seq": state["seq"], "device": state["device"],
                  "complete": complete}
        self._write_or_mark(record, sides, error, raised)

    def _write_or_mark(self, record: dict, sides: list[_Side] | None, error: str | None,
                       raised: Exception | None) -> None:
        """Queue the record with its sides' statistics (written once they arrive, in order), or, where they could not
        be computed, write it with the error in their place (so that a comparison names the call instead of missing
        it); then raise what failed here, for the engine to count the call as not checked."""
        if sides is not None and error is None:
            try:
                self._queue(record, sides)
                return
            except Exception as e:
                error, raised = _described(e), e
        marked = {k: v for k, v in record.items() if k not in _SIDES and k != "omitted"}  # no partial sides
        self._queue({**marked, "unrecorded": error or "its inputs were not recorded"}, None)
        if raised is not None:
            raise raised

    def _queue(self, record: dict, sides: list[_Side] | None) -> None:
        """The record after those queued before it; its statistics (joined per device) sent without waiting."""
        kept = None
        # one put per device for the whole call (batches count calls): its groups' tensors, joined when sent
        by_device: dict[torch.device, tuple[list, list]] = {}
        if sides is not None:
            for indices, parts in _measured(sides):
                groups, tensors = by_device.setdefault(parts[0].device, ([], []))
                groups.append(indices)
                tensors += parts
            # aliases of the tensors measured here only: a taken-over slot's counts are read through its measurer's
            fresh = [(side.slots[k], side.kept[k]) for side in sides for k in side.fresh]
            if fresh:  # none where every tensor's statistics were taken over (about half the records)
                kept = self._kept.keep([t for _, t in fresh])
                for index, (slot, _) in enumerate(fresh):
                    slot.kept, slot.index = kept, index
            for side in sides:
                side.remember(self._known)
                side.kept, side.groups = (), []
        pending = _Pending(record, sides, kept)
        with self._pending_lock:
            for groups, tensors in by_device.values():
                pending.remaining += 1
                self._readback.put(tensors, (pending, groups))
            self._pending.append(pending)
        self._write_arrived(wait=False)

    def _write_arrived(self, wait: bool) -> None:
        """Write the records whose statistics arrived (all, waiting, with ``wait``), in order."""
        with self._pending_lock:
            try:
                for (pending, groups), values in (self._readback.drain() if wait else self._readback.ready()):
                    start = 0
                    for indices in groups:
                        stop = start + len(indices) * STATS_WIDTH
                        for i, piece in zip(indices, split_stats(len(indices), values[start:stop])):
                            pending.host[i].values = tuple(piece)
                        start = stop
                    pending.remaining -= 1
            except Exception as e:  # a transfer failed: the records in flight say so
                self._readback.discard()
                for pending in self._pending:
                    if pending.remaining:
                        self.unread += 1
                        pending.sides, pending.remaining = None, 0
                        pending.record = {**{k: v for k, v in pending.record.items() if k not in _SIDES},
                                          "unrecorded": f"its statistics were not read back: {_described(e)}"}
            ready = []
            while self._pending and self._pending[0].remaining == 0:
                ready.append(self._pending.popleft())
            for pending in ready:
                try:
                    line = pending.line() if pending.sides is not None else result_files.json_line(pending.record)
                except Exception as e:  # the nan/inf counts of a tensor could not be read
                    self.unread += 1
                    line = result_files.json_line(
                        {**{k: v for k, v in pending.record.items() if k not in _SIDES and k != "omitted"},
                         "unrecorded": _described(e)})
                finally:
                    if pending.kept is not None:
                        self._kept.release(pending.kept)
                self._write_line(line)

    def _write_line(self, line: str) -> None:
        self.file.write_line(line)
        with self._lock:
            self.records += 1

    def close(self, ended_by: str = "") -> None:
        """Write the records in flight and the end marker; ``ended_by``: how the run ended where not normally
        (``OpTool.ended_by``: SIGTERM, an exception), said in the marker."""
        self._write_arrived(wait=True)  # the records still in flight
        self._known.clear()
        with self._lock:
            records = self.records
        end: dict[str, Any] = {"records": records, "bytes": self.file.bytes_written}
        if ended_by:
            end["ended_by"] = ended_by
        self.file.write({"end": end})
        self.file.close()


# --- reading ---

class RecordingFormatError(ValueError):
    """A file that is not a run recording, or one of a format version this op_tools cannot read."""


def find_recording(path: str, rank: int | None = None) -> str:
    """``path`` itself when a file; in a folder, the one recording under it, or under its ``rank<N>`` folder when
    ``rank`` is given (torchrun's per-rank files); ``ValueError`` listing what was found when not exactly one."""
    if os.path.isfile(path):
        return path
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such file or folder")
    found = []
    for folder, _, files in os.walk(path):
        if rank is not None and f"rank{rank}" not in os.path.relpath(folder, path).split(os.sep):
            continue
        found += [os.path.join(folder, f) for f in files
                  if f.startswith("run_") and (f.endswith(".jsonl") or f.endswith(".jsonl.partial"))]
    if len(found) != 1:
        listing = "".join(f"\n  {f}" for f in sorted(found)) or " none"
        which = "" if rank is None else f" for rank {rank}"
        in_ranks = rank is None and any(part.startswith("rank") and part[4:].isdigit()
                                        for f in found for part in os.path.relpath(f, path).split(os.sep)[:-1])
        hint = "\n(choose a rank with --rank N, or name a file)" if in_ranks else "\n(name a file)"
        raise ValueError(f"{path}: expected one run recording (run_*.jsonl){which} under it, found{listing}"
                         + (hint if len(found) > 1 else ""))
    return found[0]


def recording_ranks(path: str) -> list[int]:
    """The ranks with a recording under the folder ``path`` (torchrun's ``rank<N>`` folders), in order; [] for a
    file or a folder without rank folders."""
    ranks: set[int] = set()
    if os.path.isdir(path):
        for folder, _, files in os.walk(path):
            parts = os.path.relpath(folder, path).split(os.sep)
            if any(f.startswith("run_") and f.endswith((".jsonl", ".jsonl.partial")) for f in files):
                ranks.update(int(part[4:]) for part in parts if part.startswith("rank") and part[4:].isdigit())
    return sorted(ranks)


PHASES = ("forward", "backward", "optimizer", "recompute")
_RECORD_KEYS = ("seq", "phase", "step", "module", "index", "op")
_SIDES = ("inputs", "outputs", "grad_outputs", "grad_inputs")


def _damage(record) -> str:
    """Why a parsed line is not a call's record ('' when it is one)."""
    if not isinstance(record, dict):
        return f"not a record: {type(record).__name__}"
    missing = [k for k in _RECORD_KEYS if k not in record]
    if missing:
        return f"no {', '.join(missing)}"
    if record["phase"] not in PHASES:
        return f"unknown phase {record['phase']!r}"
    if record["phase"] == "backward" and "forward_seq" not in record and record.get("in_backward") is not True:
        return "a backward record without forward_seq"
    return ""


def _read_numbers(record: dict) -> None:
    """The statistics written as strings (NaN and the infinities, which JSON has no number for:
    ``result_files.json_number``) as floats again, in place; anything else left for ``_tensor_damage`` to name."""
    for side in _SIDES:
        entries = record.get(side)
        for entry in entries if isinstance(entries, list) else ():
            if isinstance(entry, list) and any(isinstance(v, str) for v in entry[3:]):
                try:
                    entry[3:] = [result_files.json_float(v) for v in entry[3:]]
                except ValueError:
                    pass


def _tensor_damage(record: dict) -> str:
    """Why a record's tensors cannot be compared ('' when they can): each ``[where, dtype, shape]`` and either no
    statistics (an empty tensor) or all of them, numbers."""
    for side in _SIDES:
        for entry in record.get(side, ()):
            ok = (isinstance(entry, list) and len(entry) in (3, len(TENSOR_FIELDS)) and isinstance(entry[0], str)
                  and isinstance(entry[1], str) and isinstance(entry[2], list)
                  and all(isinstance(n, int) for n in entry[2])
                  and all(isinstance(v, (int, float)) for v in entry[3:]))
            if not ok:
                return f"a malformed tensor in {side}: {json.dumps(entry)[:80]}"
    return ""


def read_recording(path: str, rank: int | None = None) -> tuple[dict, list[dict]]:
    """``(header, records)`` of a recording (a file, or a folder holding one: ``find_recording``).

    Raises ``RecordingFormatError`` for a file of another format or of a newer format version, naming both versions.
    A damaged line (not JSON, not a call's record) is skipped and counted: ``header["unreadable"]`` (how many) and
    ``header["first_unreadable"]`` (``"line 17: ..."``); the last line of a partial recording, cut short when the
    run died, is not counted (``header["cut"]``). A record whose tensors are malformed is kept (it aligns) with
    ``unrecorded`` saying so, as the recorder marks a call whose statistics it could not compute. A complete file
    whose end marker counts more records than it has lines (lines lost after it was written: a copy cut short)
    says how many in ``header["lost"]``, and one whose run did not end normally how it ended in
    ``header["ended_by"]`` ('' when it did, or the file says nothing: a recording older than the field).
    """
    path = find_recording(path, rank)
    with open(path, encoding="utf-8", errors="replace") as f:  # a damaged byte damages its line only
        first = f.readline()
        try:
            header = json.loads(first)
        except json.JSONDecodeError:
            header = None
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise RecordingFormatError(f"{path}: not a run recording (OP_CAPTURE_MODE=stats writes them); "
                                       f"its first line is {first[:80]!r}")
        version = header.get("version")
        if not isinstance(version, int):  # every op_tools wrote one: a header edited, or written by something else
            raise RecordingFormatError(f"{path}: its header has no format version (\"version\": {version!r}); "
                                       "op_tools writes one in every recording")
        if version > FORMAT_VERSION:
            raise RecordingFormatError(
                f"{path}: recording format version {version!r}, written by a newer op_tools; this op_tools reads "
                f"version {FORMAT_VERSION} and older: compare with the op_tools that wrote it")
        if list(header.get("tensor_fields", ())) != list(TENSOR_FIELDS):
            raise RecordingFormatError(f"{path}: tensor fields {header.get('tensor_fields')} differ from "
                                       f"{list(TENSOR_FIELDS)} (format version {version})")
        records, complete, cut, unreadable, first_unreadable, lost, ended_by = [], False, False, 0, "", 0, ""
        for number, line in enumerate(f, 2):
            try:
                record = json.loads(line)
                damage = _damage(record) if not (isinstance(record, dict) and "end" in record) else ""
            except json.JSONDecodeError as e:
                if not line.endswith("\n"):  # the last line of a run that died while writing it
                    cut = True
                    break
                damage = f"not JSON ({e})"
            if damage:  # a call whose record is lost: counted, so that no verdict takes it for agreeing
                unreadable += 1
                first_unreadable = first_unreadable or f"line {number}: {damage}"
                continue
            if "end" in record:
                complete = True
                declared = record["end"].get("records") if isinstance(record["end"], dict) else None
                if isinstance(declared, int):
                    lost = max(0, declared - (number - 2))  # the lines between the header and this marker
                how = record["end"].get("ended_by") if isinstance(record["end"], dict) else None
                if how:
                    ended_by = str(how)
                break
            _read_numbers(record)
            malformed = _tensor_damage(record)
            if malformed:
                record = {k: v for k, v in record.items() if k not in _SIDES}
                record["unrecorded"] = f"line {number}: {malformed}"
            records.append(record)
    header.update(path=path, complete=complete, cut=cut, unreadable=unreadable, first_unreadable=first_unreadable,
                  lost=lost, ended_by=ended_by)
    return header, records
