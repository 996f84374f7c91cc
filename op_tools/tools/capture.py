"""OpCapture: save the real inputs, outputs and gradients of handled calls, or a summary of them.

Layout (the original ditorch's)::

    <OP_TOOLS_RESULTS_DIR>/op_capture_results[/rank<N>]/<op name>/<pid>/<forward_id>/<timestamp>/
        input.pth  output.pth  grad_inputs.pth  grad_outputs.pth

The files are in the capture file format (capture_format.py), which the offline replay reads.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch

from ..config.variables import CAPTURE_DEDUP, CAPTURE_MAX_BYTES, CAPTURE_MODE, CAPTURE_STATS_MAX_TENSORS, Sources
from ..core.engine import OpCall, OpTool, feature
from ..core.steps import STEPS
from ..ops.arguments import iter_items
from ..output import reporting, result_files
from ..output.capture_format import (  # noqa: F401 - re-exported: the format was defined here before its own module
    AUTOCAST_KEY,
    MEMORY_FORMAT_KEY,
    REF_KEY,
    TensorStore,
    autocast_state,
    content_key,
    load_op_args,
)
from ..output.run_recording import RunRecorder

SUMMARY_SHOWN = 20  # rows of the summary table on the console; the files hold them all
SUMMARY_COLUMNS = ("op", "count", "shapes", "dtypes", "strides", "location")  # + RECORD_COLUMNS in the CSV


@dataclasses.dataclass(frozen=True)
class CaptureConfig:
    mode: str
    dedup: bool
    stats_max_tensors: int
    max_bytes: int | None = None  # full mode stops saving calls once it wrote this much

    @classmethod
    def from_env(cls, sources: Sources | None = None) -> CaptureConfig:
        return cls(CAPTURE_MODE.read(sources), CAPTURE_DEDUP.read(sources), CAPTURE_STATS_MAX_TENSORS.read(sources),
                   CAPTURE_MAX_BYTES.read(sources))


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
    ``dedup`` (``OP_CAPTURE_DEDUP``), ``max_bytes`` (``OP_CAPTURE_MAX_BYTES``: an int or ``"500M"``),
    ``stats_max_tensors`` (``OP_CAPTURE_STATS_MAX_TENSORS``), and ``results_dir``, ``verbose``, ``print_stack``,
    ``strict`` as every tool.

    >>> with op_tools.OpCapture(ops=["torch.nn.functional.linear"], max_bytes="1G"):
    ...     loss = model(x).sum(); loss.backward()
    >>> op_tools.load_op_args(".../torch.nn.functional.linear/<pid>/<id>/<time>/input.pth")["args"]
    """

    hook_name = "OpCaptureHook"
    env_prefix = "OP_CAPTURE"
    results_folder = "op_capture_results"
    keywords = {"mode": CAPTURE_MODE, "dedup": CAPTURE_DEDUP, "max_bytes": CAPTURE_MAX_BYTES,
                "stats_max_tensors": CAPTURE_STATS_MAX_TENSORS}
    tracks_modules = True

    def configure(self) -> None:
        self.settings = CaptureConfig.from_env(self.sources)
        self.store = TensorStore(self.settings.dedup, self.tally)
        self.summary: dict[tuple[str, str], dict] = {}
        self.calls_not_saved = 0  # full mode, past max_bytes

        self.recorder: RunRecorder | None = None
        if self.settings.mode == "stats":
            self.handles_cpu_calls = True  # a CPU run is one side of a comparison
            path = result_files.results_path(self.common, self.results_folder, f"run_{self.stem}.jsonl")
            self.recorder = RunRecorder(path, self.settings.stats_max_tensors, self.common.rank, STEPS)

    def _over_limit(self, call: OpCall) -> bool:
        """Whether saving ``call``'s inputs would pass ``max_bytes``; the first time, one warning saying so."""
        limit = self.settings.max_bytes
        if limit is None:
            return False
        if not self.calls_not_saved:
            planned = sum(t.nbytes for t in _tensors_of(call.args, call.kwargs))
            if self.store.bytes_written + planned <= limit:
                return False
            reporting.logger.warning(
                "OpCapture: the limit of %s (max_bytes / %s) is reached: %s saved in %d files under %s; "
                "later calls are not saved", _size(limit), CAPTURE_MAX_BYTES.name, _size(self.store.bytes_written),
                self.store.files_written, result_files.results_path(self.common, self.results_folder))
        self.calls_not_saved += 1
        return True

    def before(self, call: OpCall) -> None:
        if self.recorder is not None:
            self.recorder.before(call)
            return
        if self.settings.mode == "summary":
            self._record(call)
            return
        if self._over_limit(call):
            return
        stamp = time.strftime("%Y-%m-%d-%H-%M-%S", time.localtime())
        directory = result_files.results_path(self.common, self.results_folder, call.name, self.pid_folder,
                                           str(call.forward_id), stamp)
        call.state["dir"] = directory
        payload = {"name": call.name, "args": call.args, "kwargs": call.kwargs, "identifier": "input",
                   **result_files.record_fields(self.common.rank, call.step, call.time)}
        autocast = autocast_state(call.device)
        if autocast is not None:
            payload[AUTOCAST_KEY] = autocast
        self.store.save(os.path.join(directory, "input.pth"), payload)
        if torch.is_grad_enabled():  # its backward is saved once the call's whole backward ran
            call.grad_inputs = _inputs_requiring_grad(call.args, call.kwargs)

    def after(self, call: OpCall) -> None:
        if self.recorder is not None:
            self.recorder.after(call)
            return
        directory = call.state.get("dir")
        if directory is None:  # summary mode, or past max_bytes
            return
        self.store.save(os.path.join(directory, "output.pth"),
                        {"name": call.name, "args": reporting.as_tuple(call.result), "kwargs": {},
                         "identifier": "output"})
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
                    "signature": signature,
                    **result_files.record_fields(self.common.rank, call.step, call.time),  # its first call's
                }
            entry["count"] += 1

    def finish(self) -> None:
        if self.recorder is not None:
            self.recorder.close()
            self.tally.add(self.recorder.file.path, self.recorder.file.bytes_written)
            self._logger.info("run recording %s: %d records (compare two with python -m op_tools.compare_runs)",
                              self.recorder.file.path, self.recorder.records)
            return
        if self.settings.mode != "summary" or not self.summary:
            return
        rows = sorted(self.summary.values(), key=lambda r: (r["op"], -r["count"]))
        stem = result_files.results_path(self.common, self.results_folder, f"summary_{self.stem}")
        table_rows = [{k: r[k] for k in (*SUMMARY_COLUMNS, *result_files.RECORD_COLUMNS)} for r in rows]
        self.tally.add(stem + ".csv", result_files.write_csv(stem + ".csv", table_rows))
        lines, current = [], None
        for row in rows:
            if row["op"] != current:
                current = row["op"]
                lines.append(f"Operator: {current}")
            lines.append(f"cnt: {row['count']}, {row['signature']}")
        self.tally.add(stem + ".txt", result_files.write_text(stem + ".txt", "\n".join(lines) + "\n"))
        more = len(table_rows) - SUMMARY_SHOWN
        self._logger.info(reporting.table_text(table_rows[:SUMMARY_SHOWN], SUMMARY_COLUMNS)
                      + (f"\n{more} more rows in the files" if more > 0 else "") + f"\nsaved {stem}.csv and {stem}.txt")
