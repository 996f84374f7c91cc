"""OpTimeMeasure: how long each handled call takes, forward and backward, on any device.

Each call is timed between two synchronisations of its device, through the device's own module
(``torch.cuda``, ``torch.npu``, ``torch.sim``, ...: ``getattr(torch, device.type).synchronize``), so
the time is the op's whole work on the device, not the time to queue it. Backward is timed the same
way around the autograd node of the call's outputs (the engine's backward hooks).

At ``stop()``, under ``<OP_TOOLS_RESULTS_DIR>/op_time_measure_result[/rank<N>]/``::

    op_elasped_info_pid<pid>_<time>.csv      one row per call (the original's columns, "elasped" kept)
    op_elasped_summary_pid<pid>_<time>.csv   one row per op name, sorted by total time
    op_elasped_trace_pid<pid>_<time>.json    Chrome trace events: open in https://ui.perfetto.dev

Timing never changes what a run computes: synchronising only waits.
"""

from __future__ import annotations

import json
import os
import threading
import time

import torch

from . import reporting
from .engine import OpCall, OpTool, feature, tool_work

RESULTS_FOLDER = "op_time_measure_result"
CALL_COLUMNS = ("name", "forward_id", "forward_elasped", "backward_elasped", "unit", "input", "output",
                "grad_inputs", "grad_outputs")
SUMMARY_COLUMNS = ("name", "calls", "total_ms", "share", "forward_total_ms", "forward_mean_ms", "forward_max_ms",
                   "backward_calls", "backward_total_ms", "backward_mean_ms", "backward_max_ms")
# Per-call rows kept for the CSV and the trace (about 0.5 KB each); past this only the per-op summary grows.
MAX_CALL_RECORDS = 1_000_000

_synchronizers: dict[str, object] = {}


def device_synchronizer(device: torch.device):
    """``synchronize(device)`` of the device's module (``torch.cuda``, ``torch.<vendor>``, ``torch.sim``), cached.

    >>> device_synchronizer(torch.device("cuda", 0))   # doctest: +SKIP
    <function synchronize at ...>
    """
    sync = _synchronizers.get(device.type)
    if sync is None:
        module = getattr(torch, device.type, None)
        sync = getattr(module, "synchronize", None)
        if not callable(sync):
            raise RuntimeError(f"torch.{device.type} has no synchronize(): {device.type} times would be "
                               "the time to queue work, not to run it")
        _synchronizers[device.type] = sync
    return sync


class _CallRecord:
    __slots__ = ("name", "forward_id", "start_ns", "forward_ns", "backward_ns", "thread", "input", "output",
                 "grad_inputs", "grad_outputs")

    def __init__(self, name: str, forward_id: int, start_ns: int, forward_ns: int, thread: int) -> None:
        self.name = name
        self.forward_id = forward_id
        self.start_ns = start_ns
        self.forward_ns = forward_ns
        self.backward_ns: int | None = None
        self.thread = thread
        self.input = self.output = self.grad_inputs = self.grad_outputs = ""


class _OpTotals:
    __slots__ = ("calls", "forward_ns", "forward_max", "backward_calls", "backward_ns", "backward_max")

    def __init__(self) -> None:
        self.calls = self.forward_ns = self.forward_max = 0
        self.backward_calls = self.backward_ns = self.backward_max = 0


class Measurements:
    """What one ``start()``…``stop()`` measured: per-call records, backward spans and per-op totals."""

    def __init__(self) -> None:
        self.origin_ns = time.perf_counter_ns()
        self.records: list[_CallRecord] = []
        self.backward_spans: list[tuple[_CallRecord, int, int, int]] = []  # record, start, duration, thread
        self.totals: dict[str, _OpTotals] = {}
        self.dropped = 0
        self.closed = False
        self.lock = threading.RLock()  # re-entrant: a SIGTERM flush may interrupt the main thread holding it

    def add_forward(self, record: _CallRecord) -> None:
        with self.lock:
            totals = self.totals.get(record.name)
            if totals is None:
                totals = self.totals[record.name] = _OpTotals()
            totals.calls += 1
            totals.forward_ns += record.forward_ns
            totals.forward_max = max(totals.forward_max, record.forward_ns)
            if len(self.records) < MAX_CALL_RECORDS:
                self.records.append(record)
            else:
                self.dropped += 1

    def add_backward(self, record: _CallRecord, start_ns: int, duration_ns: int, thread: int) -> None:
        with self.lock:
            totals = self.totals[record.name]
            totals.backward_calls += 1
            totals.backward_ns += duration_ns
            totals.backward_max = max(totals.backward_max, duration_ns)
            record.backward_ns = (record.backward_ns or 0) + duration_ns
            if len(self.backward_spans) < MAX_CALL_RECORDS:
                self.backward_spans.append((record, start_ns, duration_ns, thread))

    # --- what stop() writes ---

    def summary_rows(self) -> list[dict]:
        """One row per op name, largest total (forward + backward) first; times in ms."""
        grand = sum(t.forward_ns + t.backward_ns for t in self.totals.values()) or 1
        rows = []
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

    def call_rows(self) -> list[dict]:
        return [{
            "name": r.name, "forward_id": r.forward_id, "forward_elasped": _ms(r.forward_ns),
            "backward_elasped": "" if r.backward_ns is None else _ms(r.backward_ns), "unit": "ms",
            "input": r.input, "output": r.output, "grad_inputs": r.grad_inputs, "grad_outputs": r.grad_outputs,
        } for r in self.records]

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


def describe(obj) -> str:
    """Shapes and dtypes of a call's values, cheap enough for every call: ``(T([2, 16], f32), 1.0)``."""
    if isinstance(obj, torch.Tensor):
        return f"T({list(obj.shape)}, {_SHORT_DTYPES.get(obj.dtype) or str(obj.dtype)[6:]})"
    if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        return "(" + ", ".join(describe(v) for v in obj) + ")"
    if isinstance(obj, dict):
        return "{" + ", ".join(f"{k}: {describe(v)}" for k, v in obj.items()) + "}"
    text = repr(obj)
    return text if len(text) <= 40 else text[:37] + "..."


def _ms(ns: float) -> float:
    return round(ns / 1e6, 6)


@feature("measure_op_time")
class OpTimeMeasure(OpTool):
    """Time every handled call, forward and backward, between synchronisations of its device.

    >>> with op_tools.OpTimeMeasure() as timer:       # OP_TIME_MEASURE_LIST / OP_TIME_MEASURE_DISABLE_LIST
    ...     loss = model(x).sum(); loss.backward()
    >>> timer.measurements.summary_rows()[0]["name"]   # the op that took longest
    'torch.nn.functional.linear'
    """

    hook_name = "OpTimeMeasureHook"
    env_prefix = "OP_TIME_MEASURE"
    results_folder = RESULTS_FOLDER

    def configure(self) -> None:
        self.measurements = Measurements()
        self.written: dict[str, str] = {}

    def _sync(self, device: torch.device) -> None:
        with tool_work():  # a backend's synchronize may call into torch; it is never a user op
            device_synchronizer(device)(device)

    def run(self, call: OpCall):
        measurements = self.measurements
        call.state["measurements"] = measurements
        if not self._guarded(self._sync_call, call):  # no synchronize: time the call unsynchronised
            call.state["unsynchronised"] = True
        start = time.perf_counter_ns()
        result = call.func(*call.args, **call.kwargs)
        if not call.state.get("unsynchronised"):
            self._guarded(self._sync_call, call)
        end = time.perf_counter_ns()
        call.state["record"] = _CallRecord(call.name, call.forward_id, start, end - start, threading.get_ident())
        return result

    def _sync_call(self, call: OpCall) -> None:
        self._sync(call.device)

    def after(self, call: OpCall) -> None:
        record: _CallRecord | None = call.state.get("record")
        if record is None:
            return
        record.input = describe(call.args) + (describe(call.kwargs) if call.kwargs else "")
        record.output = describe(call.result)
        call.state["measurements"].add_forward(record)
        if self.common.verbose:
            rows = reporting.call_rows(call.name, call.args, call.kwargs, call.result)
            timing = {"name": call.name, "forward_id": call.forward_id, "forward_elasped": _ms(record.forward_ns),
                      "unit": "ms"}
            reporting.console(reporting.header(call.name, call.forward_id, call.location) + "\n"
                              + reporting.table(rows, reporting.ARG_COLUMNS).get_string() + "\n"
                              + reporting.table([timing]).get_string())

    def wants_backward(self) -> bool:
        return True

    def before_backward(self, call: OpCall, grad_outputs: tuple) -> None:
        if call.state["measurements"].closed or "record" not in call.state:
            return
        if not call.state.get("unsynchronised"):
            self._sync(call.device)
        call.state["backward_start"] = time.perf_counter_ns()

    def after_backward(self, call: OpCall, grad_inputs: tuple, grad_outputs: tuple) -> None:
        start = call.state.pop("backward_start", None)
        measurements: Measurements = call.state["measurements"]
        if start is None or measurements.closed:
            return
        if not call.state.get("unsynchronised"):
            self._sync(call.device)
        duration = time.perf_counter_ns() - start
        record: _CallRecord = call.state["record"]
        record.grad_inputs = describe(grad_inputs)
        record.grad_outputs = describe(grad_outputs)
        measurements.add_backward(record, start, duration, threading.get_ident())
        if self.common.verbose:
            rows = reporting.value_rows(f"{call.name} grad_outputs", grad_outputs)
            rows += reporting.value_rows(f"{call.name} grad_inputs", grad_inputs)
            timing = {"name": call.name, "forward_id": call.forward_id, "backward_elasped": _ms(duration),
                      "unit": "ms"}
            reporting.console(reporting.header(call.name, call.forward_id, call.location, "backward") + "\n"
                              + reporting.table(rows, reporting.ARG_COLUMNS).get_string() + "\n"
                              + reporting.table([timing]).get_string())

    def finish(self) -> None:
        measurements = self.measurements
        if measurements.closed:
            return
        measurements.closed = True  # backward run after stop() is not measured: the files are written now
        if not measurements.totals:
            return
        with measurements.lock:
            summary = measurements.summary_rows()
            calls = measurements.call_rows()
            trace = measurements.trace()
        stem = self.stem
        self.written = {
            "calls": reporting.results_path(self.common, RESULTS_FOLDER, f"op_elasped_info_{stem}.csv"),
            "summary": reporting.results_path(self.common, RESULTS_FOLDER, f"op_elasped_summary_{stem}.csv"),
            "trace": reporting.results_path(self.common, RESULTS_FOLDER, f"op_elasped_trace_{stem}.json"),
        }
        reporting.write_csv(self.written["calls"], [{c: row[c] for c in CALL_COLUMNS} for row in calls])
        reporting.write_csv(self.written["summary"], summary)
        # compact: a trace has an event per call, and indenting would triple its size and writing time
        reporting.write_atomic(self.written["trace"], lambda f: f.write(json.dumps(trace, separators=(",", ":"))))
        forward = sum(t.forward_ns for t in measurements.totals.values())
        backward = sum(t.backward_ns for t in measurements.totals.values())
        lines = [f"OpTimeMeasure: {sum(t.calls for t in measurements.totals.values())} calls of "
                 f"{len(measurements.totals)} ops, measured {_ms(forward + backward):.3f} ms "
                 f"(forward {_ms(forward):.3f} ms, backward {_ms(backward):.3f} ms)",
                 reporting.table(summary, SUMMARY_COLUMNS).get_string()]
        if measurements.dropped:
            lines.append(f"{measurements.dropped} calls past the first {MAX_CALL_RECORDS} are in the summary only")
        lines.append(f"op elasped info saved to {self.written['calls']}\nsummary saved to {self.written['summary']}"
                     f"\ntrace saved to {self.written['trace']} (open it in https://ui.perfetto.dev or "
                     "chrome://tracing)")
        reporting.console("\n".join(lines))

