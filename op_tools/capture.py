"""OpCapture: save the real inputs, outputs and gradients of handled calls, or a summary of them.

Layout (the original ditorch's)::

    <OP_TOOLS_RESULTS_DIR>/op_capture_results[/rank<N>]/<op name>/<pid>/<forward_id>/<timestamp>/
        input.pth  output.pth  grad_inputs.pth  grad_outputs.pth

Each file is ``{"name", "args", "kwargs", "identifier"}`` with tensors copied to the CPU. A tensor
already written unchanged (the same tensor object at the same version: a weight used by many ops,
an activation saved as one op's output and the next op's input) is written once; later files hold a
reference ``{"op_tools_ref": <file relative to this one>, "path": [...]}`` that ``load_op_args``
resolves, so every file still loads on its own.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
import time

import torch

from . import reporting
from .arguments import iter_items
from .config import CAPTURE_DEDUP, CAPTURE_MODE
from .engine import OpCall, OpTool, feature

REF_KEY = "op_tools_ref"
MEMORY_FORMAT_KEY = "op_tools_memory_format"
_KEY_ATTR = "_op_tools_capture_key"


@dataclasses.dataclass(frozen=True)
class CaptureConfig:
    mode: str
    dedup: bool

    @classmethod
    def from_env(cls) -> CaptureConfig:
        return cls(CAPTURE_MODE.read(), CAPTURE_DEDUP.read())


class TensorStore:
    """Writes capture files, storing a tensor seen again unchanged only once.

    A stored tensor is marked with a private attribute holding a key into this store (no weak
    reference: those would make ``Module.to()`` fail to swap parameters); a match also needs the
    same object id, version and data pointer, so a copy or a reused address is never mistaken for it.
    """

    MAX_ENTRIES = 200_000

    def __init__(self, dedup: bool) -> None:
        self.dedup = dedup
        self.bytes_written = 0
        self.files_written = 0
        self._seen: dict[int, tuple] = {}  # key -> (id, version, data_ptr, file, path in file)
        self._keys = itertools.count(1)
        self._lock = threading.Lock()

    def save(self, path: str, payload: dict) -> None:
        fresh: list[tuple[torch.Tensor, list]] = []
        with torch.no_grad():
            encoded = self._encode(payload, [], path, fresh, {})
        size = reporting.save_torch(path, encoded)
        with self._lock:
            self.bytes_written += size
            self.files_written += 1
            if self.dedup:
                for tensor, where in fresh:
                    self._remember(tensor, path, where)

    def _encode(self, obj, where: list, path: str, fresh: list, copies: dict):
        if isinstance(obj, torch.Tensor):
            ref = self._lookup(obj, path)
            if ref is not None:
                return ref
            copy = copies.get(id(obj))
            if copy is None:
                copy = copies[id(obj)] = obj.detach().to("cpu")
                fresh.append((obj, list(where)))
            return copy
        if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
            items = [self._encode(v, [*where, i], path, fresh, copies) for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else tuple(items)
        if isinstance(obj, dict):
            return {k: self._encode(v, [*where, k], path, fresh, copies) for k, v in obj.items()}
        if isinstance(obj, torch.memory_format):  # not picklable: kept by name, restored by load_op_args
            return {MEMORY_FORMAT_KEY: str(obj).removeprefix("torch.")}
        if isinstance(obj, (torch.dtype, torch.device, torch.layout)):
            return obj
        if obj is None or isinstance(obj, (bool, int, float, complex, str, torch.Size)):
            return obj
        return repr(obj)  # anything else is kept as text so that weights_only loading works

    def _identity(self, tensor: torch.Tensor):
        version = _version(tensor)
        if version is None:
            return None
        try:
            data_ptr = tensor.data_ptr()
        except RuntimeError:
            return None
        return id(tensor), version, data_ptr

    def _lookup(self, tensor: torch.Tensor, path: str):
        if not self.dedup:
            return None
        entry = self._seen.get(getattr(tensor, _KEY_ATTR, None) or 0)
        if entry is None or entry[:3] != self._identity(tensor):
            return None
        return {REF_KEY: os.path.relpath(entry[3], os.path.dirname(path)), "path": entry[4]}

    def _remember(self, tensor: torch.Tensor, path: str, where: list) -> None:
        identity = self._identity(tensor)
        if identity is None:
            return
        key = next(self._keys)
        try:
            setattr(tensor, _KEY_ATTR, key)
        except (AttributeError, TypeError):
            return
        self._seen[key] = (*identity, path, where)
        if len(self._seen) > self.MAX_ENTRIES:  # forget the oldest: they are only stored again
            del self._seen[next(iter(self._seen))]


def _version(tensor: torch.Tensor):
    try:
        return tensor._version
    except RuntimeError:  # inference tensors have no version counter
        return None


def load_op_args(path: str) -> dict:
    """Load one capture file (``weights_only=True``), resolving references to tensors stored in other files.

    >>> data = load_op_args("op_tools_results/op_capture_results/torch.add/123/5/2025-01-01-00-00-00/input.pth")
    >>> torch.add(*data["args"], **data["kwargs"])
    """
    cache: dict[str, dict] = {}

    def load(file: str) -> dict:
        file = os.path.normpath(file)
        if file not in cache:
            cache[file] = torch.load(file, weights_only=True, map_location="cpu")
        return cache[file]

    def resolve(obj, file: str):
        if isinstance(obj, dict):
            if REF_KEY in obj:
                target = os.path.join(os.path.dirname(file), obj[REF_KEY])
                value = load(target)
                for key in obj["path"]:
                    value = value[key]
                return value
            if MEMORY_FORMAT_KEY in obj:
                return getattr(torch, obj[MEMORY_FORMAT_KEY])
            return {k: resolve(v, file) for k, v in obj.items()}
        if isinstance(obj, list):
            return [resolve(v, file) for v in obj]
        if isinstance(obj, tuple):
            return tuple(resolve(v, file) for v in obj)
        return obj

    return resolve(load(path), path)


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
    """Save handled calls' arguments (``OP_CAPTURE_MODE=full``) or a table of what ran (``summary``).

    >>> with op_tools.OpCapture():
    ...     loss = model(x).sum(); loss.backward()
    >>> op_tools.load_op_args(".../torch.nn.functional.linear/<pid>/<id>/<time>/input.pth")["args"]
    """

    hook_name = "OpCaptureHook"
    env_prefix = "OP_CAPTURE"
    results_folder = "op_capture_results"

    def configure(self) -> None:
        self.settings = CaptureConfig.from_env()
        self.store = TensorStore(self.settings.dedup)
        self.summary: dict[tuple[str, str], dict] = {}

    def wants_backward(self) -> bool:
        return self.settings.mode == "full"

    def before(self, call: OpCall) -> None:
        if self.settings.mode == "summary":
            self._record(call)
            return
        stamp = time.strftime("%Y-%m-%d-%H-%M-%S", time.localtime())
        directory = reporting.results_path(self.common, self.results_folder, call.name, self.pid_folder,
                                           str(call.forward_id), stamp)
        call.state["dir"] = directory
        self.store.save(os.path.join(directory, "input.pth"),
                        {"name": call.name, "args": call.args, "kwargs": call.kwargs, "identifier": "input"})

    def after(self, call: OpCall) -> None:
        if self.settings.mode == "summary":
            return
        directory = call.state["dir"]
        self.store.save(os.path.join(directory, "output.pth"),
                        {"name": call.name, "args": reporting.as_tuple(call.result), "kwargs": {},
                         "identifier": "output"})
        if self.common.verbose:
            rows = reporting.call_rows(call.name, call.args, call.kwargs, call.result)
            reporting.console(reporting.header(call.name, call.forward_id, call.location) + "\n"
                              + reporting.table(rows, reporting.ARG_COLUMNS).get_string()
                              + f"\nsaved {directory}")

    def after_backward(self, call: OpCall, grad_inputs: tuple, grad_outputs: tuple) -> None:
        directory = call.state["dir"]
        for kind, grads in (("grad_inputs", grad_inputs), ("grad_outputs", grad_outputs)):
            self.store.save(os.path.join(directory, f"{kind}.pth"),
                            {"name": call.name, "args": grads, "kwargs": {}, "identifier": kind})
        if self.common.verbose:
            rows = reporting.value_rows(f"{call.name} grad_inputs", grad_inputs)
            rows += reporting.value_rows(f"{call.name} grad_outputs", grad_outputs)
            reporting.console(reporting.header(call.name, call.forward_id, call.location, "backward") + "\n"
                              + reporting.table(rows, reporting.ARG_COLUMNS).get_string())

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
                }
            entry["count"] += 1

    def finish(self) -> None:
        if self.settings.mode != "summary" or not self.summary:
            return
        rows = sorted(self.summary.values(), key=lambda r: (r["op"], -r["count"]))
        stem = reporting.results_path(self.common, self.results_folder, f"summary_{self.stem}")
        table_rows = [{k: r[k] for k in ("op", "count", "shapes", "dtypes", "strides", "location")} for r in rows]
        reporting.write_csv(stem + ".csv", table_rows)
        lines, current = [], None
        for row in rows:
            if row["op"] != current:
                current = row["op"]
                lines.append(f"Operator: {current}")
            lines.append(f"cnt: {row['count']}, {row['signature']}")
        reporting.write_text(stem + ".txt", "\n".join(lines) + "\n")
        if self.common.verbose:
            reporting.console(reporting.table(table_rows).get_string() + f"\nsaved {stem}.csv and {stem}.txt")
