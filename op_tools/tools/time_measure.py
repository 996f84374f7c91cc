"""OpTimeMeasure: how long each handled call takes, forward and backward, on any device.

Each call is timed as the device's profiler times it: a timing event is recorded on the op's stream before and
after the call (``torch.cuda.Event``, ``torch.npu.Event``, ``torch.sim.Event``, ...; ``numerics/device_timing.py``),
and nothing waits for the device per call: the spans are read in batches, oldest first, when
``MAX_PENDING`` of them are waiting, and at ``stop()``. Backward is timed the same way around the autograd node of
the call's outputs (events recorded in the engine's backward hooks, on the stream current on autograd's thread).
Where the device has no timing events, or with ``OP_TIME_MEASURE_SYNC=1``, each call is timed between two
synchronisations of its device instead (the host clock: all the work queued meanwhile, finished). When
``torch.profiler`` is running, each handled call is also a named range (``record_function``) in its trace.

At ``stop()``, under ``<OP_TOOLS_RESULTS_DIR>/op_time_measure_result[/rank<N>]/`` (the per-call CSV as the run goes
with ``OP_TOOLS_MAX_CACHE_SIZE``, see ``Measurements``)::

    op_elasped_info_pid<pid>_<time>.csv      one row per call (the original's columns, "elasped" kept)
    op_elasped_summary_pid<pid>_<time>.csv   one row per op name, sorted by total time
    op_elasped_modules_pid<pid>_<time>.csv   one row per module path (model.layers.3.mlp), with its submodules' time
    op_elasped_trace_pid<pid>_<time>.json    Chrome trace events: open in https://ui.perfetto.dev

Timing never changes what a run computes: events and synchronisations only observe.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time

import torch
from torch._C import _len_torch_function_stack as _modes_below
from torch.autograd.profiler import record_function

from ..config.variables import MAX_CACHE_SIZE, TIME_MEASURE_SYNC
from ..core import module_path
from ..core.engine import OpCall, OpTool, feature, tool_work
from ..numerics.device_timing import EventClock, HostClock, clock_for, timing_methods
from ..output import reporting, result_files

RESULTS_FOLDER = "op_time_measure_result"
CALL_COLUMNS = ("name", "forward_id", "forward_elasped", "backward_elasped", "unit", "input", "output",
                "grad_inputs", "grad_outputs", "module", *result_files.RECORD_COLUMNS)
MODULE_COLUMNS = ("module", "calls", "total_ms", "share", "self_ms", "forward_ms", "backward_ms")
MODULE_ROWS_SHOWN = 8  # on the console, the costliest first; the CSV has them all
SUMMARY_COLUMNS = ("name", "calls", "total_ms", "share", "forward_total_ms", "forward_mean_ms", "forward_max_ms",
                   "backward_calls", "backward_total_ms", "backward_mean_ms", "backward_max_ms")
# Per-call rows kept for the CSV and the trace (about 0.5 KB each); past this only the per-op summary grows.
MAX_CALL_RECORDS = 1_000_000
CONSOLE_SUMMARY_COLUMNS = ("name", "calls", "total_ms", "share", "forward_mean_ms", "backward_mean_ms")
SUMMARY_SHOWN = 20  # ops of the summary table on the console, the longest first; the file holds them all
# Spans waiting to be read. Past this many, the oldest RESOLVE_BATCH are read at once: recorded hundreds of calls
# earlier, their events have almost always completed, so reading them seldom waits for the device.
MAX_PENDING = 1024
RESOLVE_BATCH = 512

_profiler_enabled = torch._C._autograd._profiler_enabled
_HOST = HostClock()


def _start_on_current_stream(clock) -> tuple:
    stream = clock.stream()
    return stream, clock.mark(stream)


class _CallRecord:
    __slots__ = ("name", "forward_id", "start_ns", "forward_ns", "backward_ns", "thread", "input", "output",
                 "grad_inputs", "grad_outputs", "module", "step", "time", "awaits_backward", "written")

    def __init__(self, name: str, forward_id: int, thread: int, module: str = "", step: int = 0,
                 started: float = 0.0) -> None:
        self.name = name
        self.step = step  # the call's (OpCall.step, OpCall.time): the CSV's step and time columns
        self.time = started
        self.module = module  # the module that ran the call (module_path.py); its backward is counted there too
        self.forward_id = forward_id
        self.start_ns = 0
        self.forward_ns: int = None  # type: ignore[assignment]  # None until its span is read; records hold read ones
        self.backward_ns: int | None = None
        self.thread = thread
        self.input = self.output = self.grad_inputs = self.grad_outputs = ""
        self.awaits_backward = False  # an output has a grad_fn: its backward may come
        self.written = False  # its row is in the CSV already (OP_TOOLS_MAX_CACHE_SIZE)


class _Span:
    """A call's forward or backward span: its clock's two marks until read, then ``(start_ns, duration_ns)``."""

    __slots__ = ("record", "backward", "clock", "start", "end", "thread", "result")

    def __init__(self, record: _CallRecord, backward: bool, clock, start, end, thread: int) -> None:
        self.record = record
        self.backward = backward
        self.clock = clock
        self.start = start
        self.end = end
        self.thread = thread
        self.result: tuple[int, int] | None = None

    def read(self) -> tuple[int, int]:
        """``(start_ns, duration_ns)``; with timing events, waits for the end event if it has not completed."""
        if self.result is None:
            self.result = self.clock.span(self.start, self.end)
            self.start = self.end = None
        return self.result


class _OpTotals:
    __slots__ = ("calls", "forward_ns", "forward_max", "backward_calls", "backward_ns", "backward_max")

    def __init__(self) -> None:
        self.calls = self.forward_ns = self.forward_max = 0
        self.backward_calls = self.backward_ns = self.backward_max = 0


class Measurements:
    """What one ``start()``…``stop()`` measured: per-call records, backward spans and per-op totals.

    Spans arrive unread (``add``) and are read in arrival order, ``RESOLVE_BATCH`` at a time once more than
    ``MAX_PENDING`` wait, and all of them at ``resolve_all()`` (``stop()``): records and totals are complete then.

    With ``limit`` (``OP_TOOLS_MAX_CACHE_SIZE``, the original's), spans are read once more than ``limit`` wait, and
    whenever more than ``limit`` calls' rows are held, ``flush`` is handed the rows ready (``take_rows``) to append to
    the per-call CSV, so that a run that dies (a kernel's crash, a kill) leaves the calls timed so far. A call's row is
    ready once its backward was timed, or when none can come (no output with a ``grad_fn``), or once a later step's
    calls are timed (its step's backward has run). A backward timed after its call's row was written is a row of its
    own, its forward columns empty, as the original wrote it.
    """

    def __init__(self, limit: int | None = None, flush=None) -> None:
        self.limit, self.flush = limit, flush
        self.unwritten: list[_CallRecord] = []  # with ``limit``: calls timed whose rows are not in the CSV yet
        self.late: list[tuple[_CallRecord, int]] = []  # backward spans of calls written already: (record, ns)
        self.latest_step = 0
        self.origin_ns = time.perf_counter_ns()
        self.records: list[_CallRecord] = []
        self.backward_spans: list[tuple[_CallRecord, int, int, int]] = []  # record, start, duration, thread
        self.totals: dict[str, _OpTotals] = {}
        self.module_totals: dict[str, _OpTotals] = {}  # by the module path that ran the calls (self time)
        self.pending: collections.deque[_Span] = collections.deque()
        self.dropped = 0
        self.unread = 0  # spans whose clock failed to read them
        self.first_unread = ""  # its error
        self.closed = False
        self.lock = threading.RLock()  # re-entrant: a SIGTERM flush may interrupt the main thread holding it

    def add(self, span: _Span) -> None:
        with self.lock:
            if self.closed:  # a backward hook that ran past stop(): the files are written already
                return
            self.pending.append(span)
            if self.limit is None:
                if len(self.pending) > MAX_PENDING:
                    self._resolve(RESOLVE_BATCH)
            elif len(self.pending) > min(self.limit, MAX_PENDING):
                self._resolve(len(self.pending))
                if len(self.unwritten) + len(self.late) > self.limit and self.flush is not None:
                    self.flush()

    def take_rows(self, everything: bool = False) -> list[tuple[_CallRecord, int | None]]:
        """With ``limit``: the rows ready to be written (``everything``: all those held), taken out of those held, in
        the order the calls were timed: ``(record, None)`` a call's row, ``(record, ns)`` a backward's of its own."""
        with self.lock:
            ready = [r for r in self.unwritten if everything or r.backward_ns is not None or not r.awaits_backward
                     or r.step < self.latest_step]
            taken = {id(r) for r in ready}
            self.unwritten = [r for r in self.unwritten if id(r) not in taken]
            rows: list[tuple[_CallRecord, int | None]] = [(r, None) for r in ready]
            rows += self.late
            self.late = []
            for r in ready:
                r.written = True
            return rows

    def give_back(self, rows: list[tuple[_CallRecord, int | None]]) -> None:
        """Hold again rows ``take_rows`` gave that could not be written (for ``stop()`` to write)."""
        with self.lock:
            calls = [r for r, late in rows if late is None]
            for r in calls:
                r.written = False
            self.unwritten[:0] = calls
            self.late[:0] = [(r, late) for r, late in rows if late is not None and not r.written]

    def resolve_all(self) -> None:
        with self.lock:
            self._resolve(len(self.pending))

    def _resolve(self, count: int) -> None:
        """Read the ``count`` oldest spans; a span that cannot be read is counted and skipped, and the first such
        error raised once the others are in (the tool reports it)."""
        error = None
        for _ in range(count):
            span = self.pending.popleft()
            try:
                start, duration = span.read()
            except Exception as e:
                self.unread += 1
                error = error or e
                self.first_unread = self.first_unread or f"{span.record.name}: {type(e).__name__}: {e}"
                continue
            record = span.record
            if not span.backward:
                record.start_ns, record.forward_ns = start, duration
                self._add_forward(record)
            elif record.forward_ns is not None:
                self._add_backward(record, start, duration, span.thread)
        if error is not None:
            raise error

    def _add_forward(self, record: _CallRecord) -> None:
        totals = self.totals.get(record.name) or self.totals.setdefault(record.name, _OpTotals())
        by_module = self.module_totals.get(record.module) or self.module_totals.setdefault(record.module, _OpTotals())
        for t in (totals, by_module):
            t.calls += 1
            t.forward_ns += record.forward_ns
            t.forward_max = max(t.forward_max, record.forward_ns)
        if len(self.records) < MAX_CALL_RECORDS:
            self.records.append(record)
        else:
            self.dropped += 1
        if self.limit is not None:
            self.unwritten.append(record)
            self.latest_step = max(self.latest_step, record.step)

    def _add_backward(self, record: _CallRecord, start_ns: int, duration_ns: int, thread: int) -> None:
        for totals in (self.totals[record.name], self.module_totals[record.module]):
            totals.backward_calls += 1
            totals.backward_ns += duration_ns
            totals.backward_max = max(totals.backward_max, duration_ns)
        record.backward_ns = (record.backward_ns or 0) + duration_ns
        if record.written:
            self.late.append((record, duration_ns))
        if len(self.backward_spans) < MAX_CALL_RECORDS:
            self.backward_spans.append((record, start_ns, duration_ns, thread))

    # --- what stop() writes ---

    def summary_rows(self) -> list[dict]:
        """One row per op name, largest total (forward + backward) first; times in ms."""
        grand = sum(t.forward_ns + t.backward_ns for t in self.totals.values()) or 1
        rows: list[dict] = []
        for name, t in self.totals.items():
            total = t.forward_ns + t.backward_ns
            rows.append({
                "name": name, "calls": t.calls, "total_ms": _ms(total), "share": f"{100.0 * total / grand:.1f}%",
                "forward_total_ms": _ms(t.forward_ns), "forward_mean_ms": _ms(t.forward_ns / t.calls),
                "forward_max_ms": _ms(t.forward_max), "backward_calls": t.backward_calls,
                "backward_total_ms": _ms(t.backward_ns),
                "backward_mean_ms": _ms(t.backward_ns / t.backward_calls) if t.backward_calls else "",
                "backward_max_ms": _ms(t.backward_max) if t.backward_calls else "",
            })
        rows.sort(key=lambda r: -(r["total_ms"]))
        return rows

    def module_rows(self) -> list[dict]:
        """One row per module path that ran handled calls or holds one that did: ``total_ms`` with its submodules
        (``model.layers.3`` holds ``model.layers.3.mlp``; the root ``LlamaForCausalLM`` holds ``model`` and
        ``lm_head``, see ``module_path.enclosing``), ``self_ms`` its own calls only (0 for a container such as
        ``model.layers``); largest total first. Calls outside any module are the row ``(no module)``."""
        grand = sum(t.forward_ns + t.backward_ns for t in self.module_totals.values()) or 1
        inclusive: dict[str, list[int]] = {}  # calls, forward ns, backward ns
        for path, t in self.module_totals.items():
            for owner in (path, *module_path.enclosing(path)):
                sums = inclusive.setdefault(owner, [0, 0, 0])
                sums[0] += t.calls
                sums[1] += t.forward_ns
                sums[2] += t.backward_ns
        no_calls = _OpTotals()
        rows: list[dict]
        rows = [{"module": path or "(no module)", "calls": calls, "total_ms": _ms(forward + backward),
                 "share": f"{100.0 * (forward + backward) / grand:.1f}%",
                 "self_ms": _ms(self.module_totals.get(path, no_calls).forward_ns
                                + self.module_totals.get(path, no_calls).backward_ns),
                 "forward_ms": _ms(forward), "backward_ms": _ms(backward)}
                for path, (calls, forward, backward) in inclusive.items()]
        rows.sort(key=lambda r: -r["total_ms"])
        return rows

    def call_rows(self, rank: int | None = None,
                  rows: list[tuple[_CallRecord, int | None]] | None = None) -> list[dict]:
        """The per-call CSV's rows: of every call, or of ``rows`` (``take_rows``)."""
        return [{
            "name": r.name, "forward_id": r.forward_id, "forward_elasped": _ms(r.forward_ns) if late is None else "",
            "backward_elasped": _ms(late) if late is not None else "" if r.backward_ns is None else _ms(r.backward_ns),
            "unit": "ms", "input": r.input if late is None else "", "output": r.output if late is None else "",
            "grad_inputs": r.grad_inputs, "grad_outputs": r.grad_outputs,
            "module": r.module, **result_files.record_fields(rank, r.step, r.time),
        } for r, late in (rows if rows is not None else [(r, None) for r in self.records])]

    def trace(self) -> dict:
        """Chrome trace-event JSON: one complete ("X") event per forward and per backward call, times in µs."""
        pid = os.getpid()
        threads: dict[int, int] = {}

        def tid(thread: int) -> int:
            return threads.setdefault(thread, len(threads) + 1)

        events = []
        for r in self.records:
            events.append({"name": r.name, "cat": "forward", "ph": "X", "pid": pid, "tid": tid(r.thread),
                           "ts": (r.start_ns - self.origin_ns) / 1e3, "dur": r.forward_ns / 1e3,
                           "args": {"forward_id": r.forward_id, "input": r.input}})
        for r, start, duration, thread in self.backward_spans:
            events.append({"name": r.name, "cat": "backward", "ph": "X", "pid": pid, "tid": tid(thread),
                           "ts": (start - self.origin_ns) / 1e3, "dur": duration / 1e3,
                           "args": {"forward_id": r.forward_id, "grad_outputs": r.grad_outputs}})
        main = threading.main_thread().ident
        for thread, number in threads.items():
            label = "python main thread" if thread == main else f"thread {thread} (autograd/device)"
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": number, "args": {"name": label}})
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"name": f"op_tools OpTimeMeasure pid {pid}"}})
        return {"traceEvents": events, "displayTimeUnit": "ms"}


_SHORT_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
                 torch.int64: "i64", torch.int32: "i32", torch.bool: "b8", torch.uint8: "u8", torch.int8: "i8"}


_described: dict[tuple, str] = {}  # (shape, dtype) -> text: a training step repeats a few hundred of them


def describe(obj) -> str:
    """Shapes and dtypes of a call's values, cheap enough for every call: ``(T([2, 16], f32), 1.0)``."""
    if isinstance(obj, torch.Tensor):
        key = (obj.shape, obj.dtype)
        text = _described.get(key)
        if text is None:
            if len(_described) > 65536:  # shapes that keep changing: start over rather than grow
                _described.clear()
            text = _described[key] = f"T({list(obj.shape)}, {_SHORT_DTYPES.get(obj.dtype) or str(obj.dtype)[6:]})"
        return text
    if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        return "(" + ", ".join(describe(v) for v in obj) + ")"
    if isinstance(obj, dict):
        return "{" + ", ".join(f"{k}: {describe(v)}" for k, v in obj.items()) + "}"
    text = repr(obj)
    return text if len(text) <= 40 else text[:37] + "..."


def _named_counts(counts: collections.Counter, shown: int = 3) -> str:
    """``torch.matmul: 3, torch.cat: 1``: the most frequent first, ``shown`` of them, then how many more."""
    named = ", ".join(f"{name}: {n}" for name, n in counts.most_common(shown))
    return named + (f", {len(counts) - shown} more ops" if len(counts) > shown else "")


def _ms(ns: float) -> float:
    return round(ns / 1e6, 6)


@feature("measure_op_time")
class OpTimeMeasure(OpTool):
    """Time every handled call, forward and backward, with timing events on its device's stream.

    Keyword arguments (each overrides its variable): ``ops``, ``disable`` (``OP_TIME_MEASURE_LIST``/``_DISABLE_LIST``:
    lists of op names, patterns or functions), ``sync`` (``OP_TIME_MEASURE_SYNC``), ``max_cache_size``
    (``OP_TOOLS_MAX_CACHE_SIZE``: the per-call CSV appended as the run goes, see ``Measurements``), and
    ``results_dir``, ``verbose``, ``print_stack``, ``strict``, ``print_ranks`` as every tool.

    >>> with op_tools.OpTimeMeasure() as timer:       # OP_TIME_MEASURE_LIST / OP_TIME_MEASURE_DISABLE_LIST
    ...     loss = model(x).sum(); loss.backward()
    >>> timer.measurements.summary_rows()[0]["name"]   # the op that took longest
    'torch.nn.functional.linear'
    """

    hook_name = "OpTimeMeasureHook"
    tracks_modules = True
    env_prefix = "OP_TIME_MEASURE"
    handles_transformed = True  # it times calls: what they hold is not read
    results_folder = RESULTS_FOLDER
    keywords = {"sync": TIME_MEASURE_SYNC, "max_cache_size": MAX_CACHE_SIZE}

    def configure(self) -> None:
        self.measurements = Measurements(MAX_CACHE_SIZE.read(self.sources), self._append_rows)
        self._appended = 0  # bytes appended to the per-call CSV before stop() (OP_TOOLS_MAX_CACHE_SIZE)
        self._append_failed = False
        self.synchronise = TIME_MEASURE_SYNC.read(self.sources)
        self._clocks: dict[torch.device, HostClock | EventClock] = {}
        self.written: dict[str, str] = {}

    def _attempt(self, call: OpCall, step, *args, calls_torch: bool = True, fallback: bool = False):
        """``step(*args)``; where it fails, ``None`` (reported once per op; raised under OP_TOOLS_STRICT=1). In tool
        work if it ``calls_torch`` (a backend's synchronize may: those calls are never user ops)."""
        try:
            if not calls_torch and not _modes_below():  # under a program's torch-function mode, an event's own torch
                # calls (torch.device) are hidden from it as tool work
                return step(*args)
            with tool_work():
                return step(*args)
        except Exception as error:
            if self.common.strict:
                raise
            if fallback:  # the host clock times the call instead: said in the summary's "timed with" line
                self.report_failure(call.name, error)
            else:
                self.tool_failed(call, error)
            return None

    def _clock(self, call: OpCall):
        clock = self._clocks.get(call.device)
        if clock is None:
            # No timing events and no synchronize(): the host clock alone (the time to queue the work), reported.
            clock = self._clocks[call.device] = (self._attempt(call, clock_for, call.device, self.synchronise,
                                                               fallback=True)
                                                 or HostClock())
        return clock

    def _start(self, clock, call: OpCall) -> tuple:
        """``(clock, stream, mark)``: a span started on the stream current for the call's device on this thread;
        where ``clock`` fails (reported), the host clock."""
        started = self._attempt(call, _start_on_current_stream, clock, calls_torch=type(clock) is not EventClock,
                                fallback=True)
        return (_HOST, None, _HOST.mark()) if started is None else (clock, *started)

    def _end(self, clock, call: OpCall, stream):
        """The mark ending a span started on ``stream``, or ``None`` where ``clock`` fails (reported)."""
        return self._attempt(call, clock.mark, stream, calls_torch=type(clock) is not EventClock)

    def run(self, call: OpCall):
        span_range = None
        if _profiler_enabled():  # a named range in torch.profiler's trace
            with tool_work():
                span_range = record_function(call.name)
                span_range.__enter__()
        try:
            clock, stream, start = self._start(self._clock(call), call)
            result = call.runs(*call.args, **call.kwargs)
            end = self._end(clock, call, stream)
        finally:
            if span_range is not None:
                with tool_work():
                    span_range.__exit__(None, None, None)
        if end is not None:
            record = _CallRecord(call.name, call.forward_id, threading.get_ident(), call.module_path, call.step,
                                 call.time)
            call.state["span"] = _Span(record, False, clock, start, end, record.thread)
            call.state["clock"] = clock
            call.state["measurements"] = self.measurements
        return result

    def after(self, call: OpCall) -> None:
        span: _Span | None = call.state.get("span")
        if span is None:
            return
        record = span.record
        record.input = describe(call.args) + (describe(call.kwargs) if call.kwargs else "")
        record.output = describe(call.result)
        if self.measurements.limit is not None:  # its row waits for its backward, if one may come
            record.awaits_backward = any(isinstance(t, torch.Tensor) and t.grad_fn is not None
                                         for t in reporting.as_tuple(call.result))
        if self._logger.isEnabledFor(logging.DEBUG):  # the table needs this call's time now: a wait per call
            timing = {"name": call.name, "forward_id": call.forward_id, "forward_elasped": _ms(span.read()[1]),
                      "unit": "ms"}
            rows = reporting.call_rows(call.name, call.args, call.kwargs, call.result)
            self._logger.debug(reporting.header(call.name, call.forward_id, call.location) + "\n"
                           + reporting.call_table(call.name, rows) + "\n"
                           + reporting.table_text([timing]))
        call.state["measurements"].add(span)

    def wants_backward(self) -> bool:
        return True

    def before_backward(self, call: OpCall, grad_outputs: tuple) -> None:
        if "span" not in call.state or call.state["measurements"].closed:
            return
        call.state["backward_start"] = self._start(call.state["clock"], call)  # autograd set the node's stream

    def after_backward(self, call: OpCall, grad_inputs: tuple, grad_outputs: tuple) -> None:
        started = call.state.pop("backward_start", None)
        if started is None or call.state["measurements"].closed:
            return
        clock, stream, start = started
        end = self._end(clock, call, stream)
        if end is None:
            return
        record: _CallRecord = call.state["span"].record
        record.grad_inputs = describe(grad_inputs)
        record.grad_outputs = describe(grad_outputs)
        span = _Span(record, True, clock, start, end, threading.get_ident())
        if self._logger.isEnabledFor(logging.DEBUG):
            rows = reporting.value_rows(f"{call.name} grad_outputs", grad_outputs)
            rows += reporting.value_rows(f"{call.name} grad_inputs", grad_inputs)
            timing = {"name": call.name, "forward_id": call.forward_id, "backward_elasped": _ms(span.read()[1]),
                      "unit": "ms"}
            self._logger.debug(reporting.header(call.name, call.forward_id, call.location, "backward") + "\n"
                           + reporting.call_table(call.name, rows) + "\n"
                           + reporting.table_text([timing]))
        call.state["measurements"].add(span)

    def _calls_path(self) -> str:
        return result_files.results_path(self.common, RESULTS_FOLDER, f"op_elasped_info_{self.stem}.csv")

    def _append_rows(self, everything: bool = False) -> None:
        """Append the per-call rows ready (``everything``: all held) to the CSV; where that fails, they stay held
        for ``stop()``, which writes the whole file (said once)."""
        if self._append_failed:
            return
        measurements = self.measurements
        rows = measurements.take_rows(everything)
        if not rows:
            return
        try:
            self._appended += result_files.append_csv(
                self._calls_path(), [{c: row[c] for c in CALL_COLUMNS}
                                     for row in measurements.call_rows(self.common.rank, rows)], CALL_COLUMNS)
        except OSError as error:
            measurements.give_back(rows)
            self._append_failed = True
            self._logger.warning("OpTimeMeasure: could not append to %s (%s: %s); its rows are written at stop()",
                                 self._calls_path(), type(error).__name__, error)

    def handled_note(self) -> str:
        """The calls whose op raised (the user's error, propagated): handled, never timed, so in no file."""
        return f" ({self._raised_clause()})" if self.raised else ""

    def _raised_clause(self) -> str:
        """'3 raised by the op itself, not timed', the wording of OpAutoCompare's summary, for both our lines."""
        return f"{sum(self.raised.values())} raised by the op itself, not timed"

    def unchecked_parts(self) -> list[str]:
        unread = self.measurements.unread
        if not unread:
            return []
        return [f"{unread} span{'s' if unread != 1 else ''} could not be read (not timed), the first "
                f"{self.measurements.first_unread}"]

    def finish(self) -> None:
        measurements = self.measurements
        if measurements.closed:
            return
        with measurements.lock:
            try:
                measurements.resolve_all()
            except Exception as error:
                self._logger.warning("OpTimeMeasure: %d spans could not be read (%s: %s)", measurements.unread,
                                         type(error).__name__, error)
            measurements.closed = True  # backward run after stop() is not measured: the files are written now
        if not measurements.totals:
            return
        appending = measurements.limit is not None and not self._append_failed
        with measurements.lock:
            if appending:  # the rows held, after those appended as the run went
                self._append_rows(everything=True)
            summary = measurements.summary_rows()
            modules = measurements.module_rows()
            calls = [] if appending else measurements.call_rows(self.common.rank)
            trace = measurements.trace()
        stem = self.stem
        self.written = {
            "calls": self._calls_path(),
            "summary": result_files.results_path(self.common, RESULTS_FOLDER, f"op_elasped_summary_{stem}.csv"),
            "modules": result_files.results_path(self.common, RESULTS_FOLDER, f"op_elasped_modules_{stem}.csv"),
            "trace": result_files.results_path(self.common, RESULTS_FOLDER, f"op_elasped_trace_{stem}.json"),
        }
        tally = self.tally.add
        if appending and not self._append_failed:
            tally(self.written["calls"], self._appended, "per call")
        else:
            tally(self.written["calls"], result_files.write_csv(
                self.written["calls"], [{c: row[c] for c in CALL_COLUMNS}
                                        for row in (calls or measurements.call_rows(self.common.rank))]), "per call")
        tally(self.written["summary"], result_files.write_csv(self.written["summary"], summary), "summary")
        tally(self.written["modules"], result_files.write_csv(self.written["modules"], modules), "time per module")
        # compact: a trace has an event per call, and indenting would triple its size and writing time
        tally(self.written["trace"], result_files.write_atomic(
            self.written["trace"], lambda f: f.write(json.dumps(trace, separators=(",", ":")))),
              "trace (https://ui.perfetto.dev)")
        forward = sum(t.forward_ns for t in measurements.totals.values())
        backward = sum(t.backward_ns for t in measurements.totals.values())
        fit = reporting.fit_line  # its lines wrapped at the console's width; the tables fit it by themselves
        lines = [fit(f"OpTimeMeasure: {sum(t.calls for t in measurements.totals.values())} calls of "
                     f"{len(measurements.totals)} ops, measured {_ms(forward + backward):.3f} ms "
                     f"(forward {_ms(forward):.3f} ms, backward {_ms(backward):.3f} ms)"
                     # the closing line's calls handled are these and those raised: said, so both add up
                     + (f"; {self._raised_clause()} ({_named_counts(self.raised)})" if self.raised else "")),
                 reporting.table_text(summary[:SUMMARY_SHOWN], CONSOLE_SUMMARY_COLUMNS)]
        if len(summary) > SUMMARY_SHOWN:
            lines.append(f"{len(summary) - SUMMARY_SHOWN} more ops in the summary file")
        if len(modules) > 1 or modules[0]["module"] != "(no module)":
            lines.append("time per module (total: with its submodules; self: its own calls)")
            lines.append(reporting.table_text(modules[:MODULE_ROWS_SHOWN], MODULE_COLUMNS, keep="module")
                         + (f"\n... {len(modules) - MODULE_ROWS_SHOWN} more in the CSV"
                            if len(modules) > MODULE_ROWS_SHOWN else ""))
        if measurements.dropped:
            lines.append(fit(f"{measurements.dropped} calls past the first {MAX_CALL_RECORDS} are in the summary "
                             "only"))
        lines.append(fit(f"timed with {timing_methods(self._clocks.values())}"))  # the files: at the closing line
        self._logger.info("\n".join(lines))

