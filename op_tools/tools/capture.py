"""OpCapture: save the real inputs, outputs and gradients of handled calls, or a summary of them.

Layout (the original ditorch's)::

    <OP_TOOLS_RESULTS_DIR>/op_capture_results[/rank<N>]/<op name>/<pid>/<forward_id>/<timestamp>/
        input.pth  output.pth  grad_inputs.pth  grad_outputs.pth
    <OP_TOOLS_RESULTS_DIR>/op_capture_results[/rank<N>]/index_pid<pid>_<time>_<n>.csv   one row per saved call

The files are in the capture file format (capture_format.py), which the offline replay reads. What is saved can be
bounded: the steps (``OP_CAPTURE_STEPS``), the calls per op (``OP_CAPTURE_MAX_CALLS_PER_OP``), the bytes
(``OP_CAPTURE_MAX_BYTES``); the closing line counts the calls not saved, per reason.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time

import torch

from ..config.step_selection import StepSelection
from ..config.variables import (
    CAPTURE_DEDUP,
    CAPTURE_MAX_BYTES,
    CAPTURE_MAX_CALLS_PER_OP,
    CAPTURE_MODE,
    CAPTURE_STATS_MAX_TENSORS,
    CAPTURE_STEPS,
    Sources,
)
from ..core import collective_waits
from ..core.engine import OpCall, OpTool, feature, tool_work
from ..core.steps import STEPS
from ..ops.arguments import iter_items
from ..output import reporting, result_files
from ..output.capture_format import (  # noqa: F401 - re-exported: the format was defined here before its own module
    AUTOCAST_KEY,
    MEMORY_FORMAT_KEY,
    REF_KEY,
    WRITTEN_KEY,
    TensorStore,
    autocast_state,
    content_key,
    load_op_args,
    saved_bytes,
    written_arguments,
)
from ..output.run_recording import RunRecorder

SUMMARY_SHOWN = 20  # rows of the summary table on the console; the files hold them all
SUMMARY_COLUMNS = ("op", "count", "shapes", "dtypes", "strides", "location")  # + module, RECORD_COLUMNS in the CSV
INDEX_COLUMNS = ("op", "module", "forward_id", "step", "folder", "rank", "time")  # the index of a full capture


@dataclasses.dataclass(frozen=True)
class CaptureConfig:
    mode: str
    dedup: bool
    stats_max_tensors: int
    max_bytes: int | None = None  # full mode stops saving calls once it wrote this much
    steps: StepSelection | None = None  # full and summary modes: the steps whose calls are saved (None: all)
    max_calls_per_op: int | None = None  # full mode: calls saved per op name at most

    @classmethod
    def from_env(cls, sources: Sources | None = None) -> CaptureConfig:
        config = cls(CAPTURE_MODE.read(sources), CAPTURE_DEDUP.read(sources),
                     CAPTURE_STATS_MAX_TENSORS.read(sources), CAPTURE_MAX_BYTES.read(sources),
                     CAPTURE_STEPS.read(sources), CAPTURE_MAX_CALLS_PER_OP.read(sources))
        # a bound that the mode would ignore is an error, not a capture larger than asked for
        if config.mode == "stats" and config.steps is not None:
            raise ValueError(f"{CAPTURE_STEPS.name}={config.steps}: stats mode records every step (compare_runs "
                             f"aligns two recordings step by step); unset it, or use {CAPTURE_MODE.name}=full or "
                             "summary")
        if config.mode != "full" and config.max_calls_per_op is not None:
            raise ValueError(f"{CAPTURE_MAX_CALLS_PER_OP.name}={config.max_calls_per_op}: applies to "
                             f"{CAPTURE_MODE.name}=full only ({config.mode} mode keeps no call's data)")
        return config


def _tensors_of(args, kwargs) -> list:
    from ..ops.arguments import iter_tensors

    return [*iter_tensors(args), *iter_tensors(kwargs)]


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} bytes"


def _inputs_requiring_grad(args, kwargs) -> list:
    from ..ops.arguments import iter_tensors

    out: list[torch.Tensor] = []
    for t in (*iter_tensors(args), *iter_tensors(kwargs)):
        if t.requires_grad and all(t is not u for u in out):
            out.append(t)
    return out


# --- summary mode: PyTorch's operator input log format ---

_SHORT_DTYPES = {
    torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "b8", torch.complex64: "c64", torch.complex128: "c128",
}


def _contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def input_log_repr(obj) -> str:
    """An argument as PyTorch's operator input logs write it: ``T([4, 128], f16)``, with ``stride=`` if strided."""
    if isinstance(obj, torch.Tensor):
        dtype = _SHORT_DTYPES.get(obj.dtype, str(obj.dtype).removeprefix("torch."))
        text = f"T({list(obj.shape)}, {dtype}"
        if obj.dim() and obj.stride() != _contiguous_strides(obj.shape):
            text += f", stride={tuple(obj.stride())}"
        return text + ")"
    if isinstance(obj, list):
        return "[" + ", ".join(input_log_repr(v) for v in obj) + "]"
    if isinstance(obj, tuple) and not isinstance(obj, torch.Size):
        inner = ", ".join(input_log_repr(v) for v in obj)
        return f"({inner},)" if len(obj) == 1 else f"({inner})"
    if isinstance(obj, dict):
        return "{" + ", ".join(f"{k!r}: {input_log_repr(v)}" for k, v in obj.items()) + "}"
    if isinstance(obj, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return str(obj) if not isinstance(obj, torch.device) else repr(str(obj))
    return repr(obj)


@feature("op_capture")
class OpCapture(OpTool):
    """Save handled calls' arguments (``OP_CAPTURE_MODE=full``), a table of what ran (``summary``), or a recording
    of every call's module path and tensor statistics, CPU calls included (``stats``, see run_recording.py).

    Keyword arguments (each overrides its variable; docs/tools/op_capture.md): ``ops``, ``disable``
    (``OP_CAPTURE_LIST``/``_DISABLE_LIST``: lists of op names, patterns or functions), ``mode`` (``OP_CAPTURE_MODE``),
    ``dedup`` (``OP_CAPTURE_DEDUP``), ``max_bytes`` (``OP_CAPTURE_MAX_BYTES``: an int or ``"500M"``), ``steps``
    (``OP_CAPTURE_STEPS``: an int, a list, a range or ``"0,2-3"``), ``max_calls_per_op``
    (``OP_CAPTURE_MAX_CALLS_PER_OP``), ``stats_max_tensors`` (``OP_CAPTURE_STATS_MAX_TENSORS``), and
    ``results_dir``, ``verbose``, ``print_stack``, ``strict`` as every tool.

    >>> with op_tools.OpCapture(ops=["torch.nn.functional.linear"], max_bytes="1G", steps="2-3", max_calls_per_op=4):
    ...     train(steps=5)
    >>> op_tools.load_op_args(".../torch.nn.functional.linear/<pid>/<id>/<time>/input.pth")["args"]
    """

    hook_name = "OpCaptureHook"
    env_prefix = "OP_CAPTURE"
    results_folder = "op_capture_results"
    keywords = {"mode": CAPTURE_MODE, "dedup": CAPTURE_DEDUP, "max_bytes": CAPTURE_MAX_BYTES, "steps": CAPTURE_STEPS,
                "max_calls_per_op": CAPTURE_MAX_CALLS_PER_OP, "stats_max_tensors": CAPTURE_STATS_MAX_TENSORS}
    tracks_modules = True
    tracks_writes = True  # the run recording takes over a tensor's statistics while no call wrote it

    def note_writes(self, tensors: list) -> None:
        if self.recorder is not None:
            self.recorder.note_writes(tensors)

    def configure(self) -> None:
        self.settings = CaptureConfig.from_env(self.sources)
        self.store = TensorStore(self.settings.dedup, self.tally)
        self.summary: dict[tuple[str, str], dict] = {}
        self.calls_not_saved = 0  # full mode, past max_bytes
        self.outside_steps = 0  # calls not saved (full) or not counted (summary): their step is not in steps
        self.saved_per_op: collections.Counter = collections.Counter()  # full mode: calls saved per op name
        self.over_op_cap: collections.Counter = collections.Counter()  # full mode: calls past max_calls_per_op, per op
        self.index: list[dict] = []  # full mode: one row per saved call (INDEX_COLUMNS)
        self.index_error = ""  # why the index could not be written, for the verdict

        self.recorder: RunRecorder | None = None
        if self.settings.mode == "stats":
            self.handles_cpu_calls = True  # a CPU run is one side of a comparison
            path = result_files.results_path(self.common, self.results_folder, f"run_{self.stem}.jsonl")
            allow = self.filter.allow
            self.recorder = RunRecorder(path, self.settings.stats_max_tensors, self.common.rank, STEPS,
                                        lambda: self.sees_every_call,
                                        ops=None if allow is None else [p.pattern for p in allow],
                                        disable=[p.pattern for p in self.filter.deny])
            STEPS.after_step.append(self._flush_recording)  # a killed run keeps its records but the last step's or two

    def _flush_recording(self) -> None:
        """As an optimizer step returns: the recording so far to the system. A failure never stops the user's step
        (the lines are written at stop() all the same); said at DEBUG."""
        recorder = self.recorder
        if recorder is not None:
            try:
                with tool_work():  # its batch's join is no call of the program's
                    recorder.flush()
            except Exception:  # noqa: BLE001 - written at stop(), or said lost then
                reporting.logger.debug("OpCapture: flushing the run recording failed", exc_info=True)

    def _over_limit(self, call: OpCall) -> bool:
        """Whether saving ``call``'s inputs would pass ``max_bytes``; the first time, one warning saying so."""
        limit = self.settings.max_bytes
        if limit is None:
            return False
        if not self.calls_not_saved:
            planned = sum(saved_bytes(t) for t in _tensors_of(call.args, call.kwargs))
            if self.store.bytes_written + planned <= limit:
                return False
            reporting.logger.warning(
                "OpCapture: the limit of %s (max_bytes / %s) is reached: %s saved in %d files under %s; "
                "later calls are not saved", _size(limit), CAPTURE_MAX_BYTES.name, _size(self.store.bytes_written),
                self.store.files_written, result_files.results_path(self.common, self.results_folder))
        self.calls_not_saved += 1
        return True

    def _in_steps(self, call: OpCall) -> bool:
        """Whether ``call``'s step is among those chosen; counts it when not."""
        if self.settings.steps is None or call.step in self.settings.steps:
            return True
        with self._lock:
            self.outside_steps += 1
        return False

    def _saves(self, call: OpCall) -> bool:
        """Whether full mode saves ``call``: in the steps chosen, under the per-op cap and the byte cap, checked in
        that order; a call not saved is counted under the first reason."""
        if not self._in_steps(call):
            return False
        cap = self.settings.max_calls_per_op
        with self._lock:
            if cap is not None and self.saved_per_op[call.name] >= cap:
                self.over_op_cap[call.name] += 1
                return False
            if self._over_limit(call):
                return False
            self.saved_per_op[call.name] += 1
        return True

    def before(self, call: OpCall) -> None:
        if self.recorder is not None:
            self.recorder.before(call)
            return
        if self.settings.mode == "summary":
            if self._in_steps(call):
                self._record(call)
            return
        if not self._saves(call):
            return
        stamp = time.strftime("%Y-%m-%d-%H-%M-%S", time.localtime())
        directory = result_files.results_path(self.common, self.results_folder, call.name, self.pid_folder,
                                           str(call.forward_id), stamp)
        call.state["dir"] = directory
        payload = {"name": call.name, "args": call.args, "kwargs": call.kwargs, "identifier": "input",
                   "module": call.module_path, **result_files.record_fields(self.common.rank, call.step, call.time)}
        autocast = autocast_state(call.device)
        if autocast is not None:
            payload[AUTOCAST_KEY] = autocast
        self.store.save(os.path.join(directory, "input.pth"), payload)
        row = {"op": call.name, "module": call.module_path, "forward_id": call.forward_id, "step": call.step,
               "folder": os.path.relpath(directory, result_files.results_path(self.common, self.results_folder)),
               **result_files.record_fields(self.common.rank, call.step, call.time)}
        with self._lock:
            self.index.append(row)
        if torch.is_grad_enabled():  # its backward is saved once the call's whole backward ran
            call.grad_inputs = _inputs_requiring_grad(call.args, call.kwargs)

    def after(self, call: OpCall) -> None:
        if collective_waits.is_work(call.result):  # an asynchronous collective: what it received is there at its wait
            self.check_when_waited(call, self._after_waited, call.state.get("received"))
            return
        self._after_received(call)

    def _after_waited(self, call: OpCall) -> None:
        call.result = None  # what it wrote is its result, as a synchronous collective's is
        self._after_received(call)

    def _after_received(self, call: OpCall) -> None:
        if self.recorder is not None:
            self.recorder.after(call)
            return
        directory = call.state.get("dir")
        if directory is None:  # summary mode, or past max_bytes
            return
        # What the call wrote beyond what it returned (x[0] = 5 returns None) is its output too: saved, it is
        # compared at replay; the key is always there, so that its absence says "captured by an older version".
        written = written_arguments(call.name, call.args, call.kwargs, call.result)
        self.store.save(os.path.join(directory, "output.pth"),
                        {"name": call.name, "args": reporting.as_tuple(call.result), "kwargs": {},
                         "identifier": "output", WRITTEN_KEY: written})
        if self._logger.isEnabledFor(logging.DEBUG):
            rows = reporting.call_rows(call.name, call.args, call.kwargs, call.result)
            self._logger.debug(reporting.header(call.name, call.forward_id, call.location) + "\n"
                           + reporting.call_table(call.name, rows) + f"\nsaved {directory}")

    def after_call_backward(self, call: OpCall, grad_outputs: tuple, grad_inputs: tuple, complete: bool) -> None:
        if self.recorder is not None:
            self.recorder.backward(call, grad_outputs, grad_inputs, complete)
            return
        directory = call.state.get("dir")
        if directory is None:
            return
        for kind, grads in (("grad_inputs", grad_inputs), ("grad_outputs", grad_outputs)):
            self.store.save(os.path.join(directory, f"{kind}.pth"),
                            {"name": call.name, "args": grads, "kwargs": {}, "identifier": kind})
        if self._logger.isEnabledFor(logging.DEBUG):
            rows = reporting.value_rows(f"{call.name} grad_inputs", grad_inputs)
            rows += reporting.value_rows(f"{call.name} grad_outputs", grad_outputs)
            self._logger.debug(reporting.header(call.name, call.forward_id, call.location, "backward") + "\n"
                           + reporting.call_table(call.name, rows))

    def _write_index(self) -> None:
        """``index_<stem>.csv``: every saved call's op, module, forward_id, step and folder, in call order."""
        path = result_files.results_path(self.common, self.results_folder, f"index_{self.stem}.csv")
        rows = [{k: r[k] for k in INDEX_COLUMNS} for r in sorted(self.index, key=lambda r: r["forward_id"])]
        try:
            self.tally.add(path, result_files.write_csv(path, rows), "index of the calls saved")
        except OSError as e:  # the calls' own files are written: the verdict says the index is not
            self.index_error = f"the index {path} not written ({type(e).__name__}: {e})"

    def unchecked_parts(self) -> list[str]:
        parts = [self.index_error] if self.index_error else []
        unread = self.recorder.unread if self.recorder is not None else 0
        if unread:  # written marked unrecorded: compare_runs counts them as not compared
            parts.append(f"{unread} record{'s' if unread != 1 else ''}' statistics not read back from the device")
        return parts

    # --- summary mode ---

    def _record(self, call: OpCall) -> None:
        signature = f"({input_log_repr(tuple(call.args))}, {input_log_repr(call.kwargs)})"
        with self._lock:
            entry = self.summary.get((call.name, signature))
            if entry is None:
                tensors = [(p, v) for p, v in iter_items(tuple(call.args)) if isinstance(v, torch.Tensor)]
                entry = self.summary[(call.name, signature)] = {
                    "op": call.name, "count": 0,
                    "shapes": " ".join(f"{p}:{list(v.shape)}" for p, v in tensors),
                    "dtypes": " ".join(f"{p}:{str(v.dtype).removeprefix('torch.')}" for p, v in tensors),
                    "strides": " ".join(f"{p}:{tuple(v.stride())}" for p, v in tensors),
                    "location": call.location.splitlines()[0],
                    "module": call.module_path,
                    "signature": signature,
                    **result_files.record_fields(self.common.rank, call.step, call.time),  # its first call's
                }
            entry["count"] += 1

    def finish(self) -> None:
        if self.recorder is not None:
            if self._flush_recording in STEPS.after_step:
                STEPS.after_step.remove(self._flush_recording)
            self.recorder.close(self.ended_by)  # a run cut short says so: its file is whole, the run is not
            self.tally.add(self.recorder.file.path, self.recorder.file.bytes_written,
                           f"run recording, {self.recorder.records} records, for op_tools.compare_runs")
            return
        if self.settings.mode == "full" and self.index:
            self._write_index()
        if self.settings.mode != "summary" or not self.summary:
            return
        rows = sorted(self.summary.values(), key=lambda r: (r["op"], -r["count"]))
        stem = result_files.results_path(self.common, self.results_folder, f"summary_{self.stem}")
        table_rows = [{k: r[k] for k in (*SUMMARY_COLUMNS, "module", *result_files.RECORD_COLUMNS)} for r in rows]
        self.tally.add(stem + ".csv", result_files.write_csv(stem + ".csv", table_rows), "summary")
        lines, current = [], None
        for row in rows:
            if row["op"] != current:
                current = row["op"]
                lines.append(f"Operator: {current}")
            lines.append(f"cnt: {row['count']}, {row['signature']}")
        self.tally.add(stem + ".txt", result_files.write_text(stem + ".txt", "\n".join(lines) + "\n"),
                       "calls per signature")
        more = len(table_rows) - SUMMARY_SHOWN
        self._logger.info(reporting.table_text(table_rows[:SUMMARY_SHOWN], SUMMARY_COLUMNS)
                          + (f"\n{more} more rows in the files" if more > 0 else ""))  # the files: at the closing line

    def not_saved(self) -> str:
        """The calls not saved, per reason: ``not saved: 120 calls outside steps 0,2-3 (OP_CAPTURE_STEPS), ...``;
        '' when every call handled was saved (or counted, in summary mode)."""
        parts = []
        if self.outside_steps:
            verb = "counted" if self.settings.mode == "summary" else "saved"
            parts.append(f"{self.outside_steps} call{'s' if self.outside_steps != 1 else ''} outside steps "
                         f"{self.settings.steps} ({CAPTURE_STEPS.name}) not {verb}")
        capped = sum(self.over_op_cap.values())
        if capped:
            ops = len(self.over_op_cap)
            parts.append(f"{capped} call{'s' if capped != 1 else ''} of {ops} op{'s' if ops != 1 else ''} past "
                         f"{self.settings.max_calls_per_op} per op ({CAPTURE_MAX_CALLS_PER_OP.name}) not saved")
        if self.calls_not_saved:
            parts.append(f"{self.calls_not_saved} call{'s' if self.calls_not_saved != 1 else ''} past "
                         f"{_size(self.settings.max_bytes or 0)} ({CAPTURE_MAX_BYTES.name}) not saved")
        return "; ".join(parts)

    def closing_line(self) -> str:
        dropped = self.not_saved()
        return f"{super().closing_line()}; {dropped}" if dropped else super().closing_line()
