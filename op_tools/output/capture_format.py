"""The capture file format: what OpCapture, OpAutoCompare's failing calls and the conformance sweep write, and what
the offline replay reads (no engine here: the offline code loads files without loading the tools).

Each file is ``{"name", "args", "kwargs", "identifier"}`` with tensors copied to the CPU; ``input.pth`` also
holds ``"autocast": {"device_type", "dtype"}`` when the call ran under autocast, for the replay to re-enter, and
the call's ``"module"`` (the path of the module that ran it, ``""`` outside any; OpCapture's files), ``"rank"``,
``"step"`` and ``"time"`` (``result_files.RECORD_COLUMNS``; files written before have none).
``grad_outputs.pth`` holds the gradients of the call's outputs and ``grad_inputs.pth`` those of its inputs that
require grad (in argument order), once the call's whole backward ran.

A tensor whose values were already written (a weight used by many ops, an activation saved as one op's output
and the next op's input) is written once: the store knows tensors by their content (dtype, sizes, strides and a
digest of their bytes, read after the copy to the host), so a tensor changed by any means, a kernel writing
without bumping the version counter included, is never taken for its old value. Later files hold a reference
``{"op_tools_ref": <file relative to this one>, "path": [...]}`` that ``load_op_args`` resolves, so every file
still loads on its own.

A tensor whose layout a dense copy loses (gaps, ``x[:, ::2]``; overlaps, an expanded input; a storage offset,
``x[1:]``) is saved as the span of storage it covers with its sizes, strides and storage offset
(``{"op_tools_strided": <span>, "size", "stride", "storage_offset", "requires_grad"}``) and rebuilt on that span by
``load_op_args``: an op reading its memory (``as_strided``) reads it as the call did. Every file records that it
keeps layouts (``"layouts": 1``); one without the key was written before, and its tensors are dense copies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import os
import sys
import threading
from typing import Any

import torch

from ..ops.arguments import iter_items, iter_tensors
from ..ops.torch_versions import autocast_dtype
from ..ops.writes import call_writes
from . import result_files

REF_KEY = "op_tools_ref"
MEMORY_FORMAT_KEY = "op_tools_memory_format"
DEVICE_KEY = "op_tools_device"  # a torch.device, where this torch's weights_only loading refuses one (before 2.2)
SLICE_KEY = "op_tools_slice"  # a slice, its bounds encoded as any argument (a 0-d tensor bound stays a tensor)
ELLIPSIS_KEY = "op_tools_ellipsis"
TEXT_KEY = "op_tools_text"  # an argument the format keeps only as its repr: loaded as a KeptAsText
AUTOCAST_KEY = "autocast"
WRITTEN_KEY = "written"  # in output.pth: the tensors the call wrote beyond what it returned, by argument path
STRIDED_KEY = "op_tools_strided"  # a tensor saved as the storage span it covers, rebuilt with its layout
LAYOUTS_KEY = "layouts"  # in every file written since tensors keep their layout: 1
STORAGE_OFFSETS_KEY = "op_tools_storage_offsets"  # in what load_op_args returns: {("args", 0): offset at capture}


@dataclasses.dataclass(frozen=True)
class KeptAsText:
    """An argument the capture format could keep only as its text (a ``torch.Generator``, a user's object): nothing
    can call the op with it again, and the replay says so rather than pass its text to the op."""

    text: str
    type_name: str = ""

    def __repr__(self) -> str:
        return f"<{self.type_name or 'argument'} kept as text: {self.text}>"


class TensorStore:
    """Writes capture files, storing a tensor whose content was already written only once (by reference)."""

    MAX_ENTRIES = 200_000

    def __init__(self, dedup: bool, tally: result_files.Tally | None = None) -> None:
        self.dedup = dedup
        self.tally = tally
        self.bytes_written = 0
        self.files_written = 0
        self._seen: dict[tuple, tuple] = {}  # content key -> (file, path in file)
        self._lock = threading.Lock()

    def save(self, path: str, payload: dict) -> None:
        fresh: list[tuple[tuple, list]] = []
        with torch.no_grad():
            encoded = self._encode(payload, [], path, fresh, {})
        if isinstance(encoded, dict):
            encoded[LAYOUTS_KEY] = 1
        size = result_files.save_torch(path, encoded)
        if self.tally is not None:
            self.tally.add(path, size)
        with self._lock:
            self.bytes_written += size
            self.files_written += 1
            if self.dedup:
                for key, where in fresh:
                    self._seen.setdefault(key, (path, where))
                while len(self._seen) > self.MAX_ENTRIES:  # forget the oldest: they are only stored again
                    del self._seen[next(iter(self._seen))]

    def _encode(self, obj, where: list, path: str, fresh: list, copies: dict, span: bool = False):
        if isinstance(obj, torch.Tensor) and not span and not obj.is_meta and layout_lost(obj):
            spans = copies.setdefault("spans", {})  # kept alive: ``copies`` knows tensors by id
            covered = spans.setdefault(id(obj), storage_span(obj))  # the memory it covers, gaps and all
            return {STRIDED_KEY: self._encode(covered, [*where, STRIDED_KEY], path, fresh, copies, span=True),
                    "size": list(obj.shape), "stride": list(obj.stride()),
                    "storage_offset": obj.storage_offset(), "requires_grad": obj.requires_grad}
        if isinstance(obj, torch.Tensor):
            known = copies.get(id(obj))
            if known is None and obj.is_meta:  # no values: saved as it is, and loaded back on meta
                known = copies[id(obj)] = (obj.detach().requires_grad_(obj.requires_grad), None)
            if known is None:
                copy = obj.detach().to("cpu")
                if obj.requires_grad:  # kept, for the replay to know which inputs take gradients
                    copy.requires_grad_()
                known = copies[id(obj)] = (copy, content_key(copy) if self.dedup else None)
            copy, key = known
            if key is not None:
                entry = self._seen.get(key)
                if entry is not None:
                    return {REF_KEY: os.path.relpath(entry[0], os.path.dirname(path)), "path": entry[1]}
                if all(k != key for k, _ in fresh):
                    fresh.append((key, list(where)))
            return copy
        if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
            items = [self._encode(v, [*where, i], path, fresh, copies) for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else tuple(items)
        if isinstance(obj, dict):
            return {k: self._encode(v, [*where, k], path, fresh, copies) for k, v in obj.items()}
        if isinstance(obj, torch.memory_format):  # not picklable: kept by name, restored by load_op_args
            return {MEMORY_FORMAT_KEY: str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device) and not _devices_load():
            return {DEVICE_KEY: str(obj)}
        if isinstance(obj, (torch.dtype, torch.device, torch.layout)):
            return obj
        if obj is None or type(obj) in _PLAIN or isinstance(obj, torch.Size):
            return obj
        if isinstance(obj, slice):  # x[:, :n] with n a 0-d tensor: its bounds kept as values, never as their text
            bounds = (obj.start, obj.stop, obj.step)
            return {SLICE_KEY: [self._encode(v, [*where, SLICE_KEY, i], path, fresh, copies)
                                for i, v in enumerate(bounds)]}
        if obj is Ellipsis:
            return {ELLIPSIS_KEY: True}
        plain = python_value(obj)
        if plain is not None:
            return plain
        # anything else is kept as text so that weights_only loading works, marked so that no one takes it for a str
        return {TEXT_KEY: repr(obj), "type": f"{type(obj).__module__}.{type(obj).__qualname__}"}


_PLAIN: tuple[type, ...] = (bool, int, float, complex, str)


def dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill a block of memory once each, whatever their order (a copy keeps its strides)."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def layout_lost(t: torch.Tensor) -> bool:
    """Whether a copy of ``t`` to another device loses how it lies in its storage: gaps (``x[:, ::2]``), overlaps
    (an expanded tensor), or a storage offset (``x[1:]``), which ``as_strided`` reads from."""
    return (t.layout == torch.strided and t.numel() > 0 and not t.is_quantized
            and (t.storage_offset() != 0 or not dense(t)))


def storage_extent(t: torch.Tensor) -> int:
    """How many elements of storage ``t`` spans from its storage offset on (its strides are never negative)."""
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) if t.numel() else 0


def saved_bytes(t: torch.Tensor) -> int:
    """The bytes ``TensorStore`` writes for ``t``: the span of storage it covers where its layout would be lost (an
    expanded tensor's fewer, a view with gaps' more), else its own."""
    return storage_extent(t) * t.element_size() if layout_lost(t) else t.nbytes


def storage_span(t: torch.Tensor) -> torch.Tensor:
    """The storage ``t`` covers, from its first element to its last, as a 1-d view (no copy): for a dense tensor, its
    own elements; for ``x[:, ::2]``, the gaps between too; for an expanded tensor, the elements once."""
    return t.detach().as_strided((storage_extent(t),), (1,), t.storage_offset())


def with_layout(span: torch.Tensor, size, stride, requires_grad: bool = False) -> torch.Tensor:
    """``span`` (a 1-d tensor) viewed as the tensor it was saved for; a leaf requiring grad where that did."""
    rebuilt = span.detach().as_strided(tuple(size), tuple(stride), span.storage_offset())
    return rebuilt.requires_grad_() if requires_grad else rebuilt


def python_value(obj) -> bool | int | float | complex | str | None:
    """The Python bool, int, float, complex or str that ``obj``, a value of another type, equals exactly (numpy's
    ``float64(2)``, an ``IntEnum``), or None: pickled as it is, its class is a global that ``weights_only`` loading
    refuses."""
    for kind in _PLAIN:  # bool first: True is an int too
        if isinstance(obj, kind):
            return kind(obj)
    numpy = sys.modules.get("numpy")  # no numpy loaded, no numpy value to meet
    if numpy is not None and isinstance(obj, numpy.generic):
        value = obj.item()  # numpy's exact Python equivalent; its own type where none exists (longdouble)
        if type(value) in _PLAIN:
            return value
    return None


def written_arguments(name: str, args, kwargs, result) -> dict[str, torch.Tensor]:
    """The tensors a call of ``name`` wrote beyond those it returned, by their place in its arguments (``args[0]``,
    ``args[1][3]``, ``kwargs[out]``): what its schema or ``op_facts`` say it writes (ops/writes.py), so that
    ``x[0] = 5``, a fused optimizer's step or BatchNorm's running statistics have what they wrote as an output. A
    function whose writes are unknown (a user's) gives none: every argument would be an output."""
    spec = call_writes(name)
    if spec.never or spec.unknown:
        return {}
    written = {id(t) for t in spec.written(tuple(args), kwargs)}
    written.difference_update(id(t) for t in iter_tensors(result))  # add_'s self is its output already
    found: dict[str, torch.Tensor] = {}
    for side, values in (("args", tuple(args)), ("kwargs", kwargs)):
        for where, value in iter_items(values):
            if isinstance(value, torch.Tensor) and id(value) in written:
                written.discard(id(value))  # a tensor passed twice is one output, at its first place
                found[f"{side}{where}"] = value
    return found



@functools.cache
def _devices_load() -> bool:
    """Whether ``torch.load(weights_only=True)`` loads a ``torch.device`` (torch 2.2 on): where it does, a capture
    keeps devices as they are, as it always has."""
    buffer = io.BytesIO()
    torch.save(torch.device("cpu"), buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except Exception:  # noqa: BLE001 - the unpickler's refusal, whatever its type in this torch
        return False
    return True


def content_key(t: torch.Tensor) -> tuple | None:
    """``(dtype, sizes, strides, offset, digest of the bytes)`` of a host tensor: equal keys, equal tensors."""
    if t.layout != torch.strided or t.is_quantized or t.is_conj() or t.is_neg():
        return None
    flat = t.detach().contiguous().reshape(-1)
    try:
        data = memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else b""  # type: ignore[arg-type]  # numpy types ndarray as a buffer on Python >= 3.12 only
    except (RuntimeError, TypeError):
        return None
    digest = hashlib.blake2b(data, digest_size=16).digest()
    return t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.requires_grad, digest


def _original_capture_values():
    """Lets ``weights_only`` loading build the plain values the original ditorch's captures pickled as they were
    (it saved arguments and outputs unconverted): ``torch.return_types`` tuples (``sort``, ``max(dim)``, ``topk``
    outputs), ``slice`` and ``...`` (``Tensor.__getitem__`` indices). Each is a tuple or a constant: still data, never
    code. Torch before 2.5 has no such list, and refuses those files as before."""
    allowed = _original_capture_globals()
    return torch.serialization.safe_globals(allowed) if allowed else contextlib.nullcontext()


@functools.cache
def _original_capture_globals() -> list:
    """What ``_original_capture_values`` allows in this torch: ``...`` only where an entry may name its global
    (``(obj, "module.name")``, a later torch than ``safe_globals`` itself)."""
    if not hasattr(torch.serialization, "safe_globals"):
        return []
    allowed: list = [slice, *torch.return_types.all_return_types]
    ellipsis: Any = (Ellipsis, "builtins.Ellipsis")  # a constant, not the callable torch's hint expects
    buffer = io.BytesIO()
    torch.save(Ellipsis, buffer)
    buffer.seek(0)
    try:
        with torch.serialization.safe_globals([*allowed, ellipsis]):
            torch.load(buffer, weights_only=True)
    except Exception:  # noqa: BLE001 - this torch's refusal of the named form, whatever its type
        return allowed
    return [*allowed, ellipsis]


def load_op_args(path: str) -> dict:
    """Load one capture file (``weights_only=True``), resolving references to tensors stored in other files.

    >>> data = load_op_args("op_tools_results/op_capture_results/torch.add/123/5/2025-01-01-00-00-00/input.pth")
    >>> torch.add(*data["args"], **data["kwargs"])
    """
    cache: dict[str, dict] = {}
    offsets: dict[tuple, int] = {}  # a rebuilt tensor's storage offset at capture, by its place

    def load(file: str) -> dict:
        file = os.path.normpath(file)
        if file not in cache:
            with _original_capture_values():
                cache[file] = torch.load(file, weights_only=True, map_location="cpu")
        return cache[file]

    def resolve(obj, file: str, where: tuple = ()):
        if isinstance(obj, dict):
            if STRIDED_KEY in obj:
                offsets[where] = int(obj.get("storage_offset", 0))
                return with_layout(resolve(obj[STRIDED_KEY], file), obj["size"], obj["stride"],
                                   bool(obj.get("requires_grad")))
            if REF_KEY in obj:
                target = os.path.join(os.path.dirname(file), obj[REF_KEY])
                value = load(target)
                for key in obj["path"]:
                    value = value[key]
                return value
            if MEMORY_FORMAT_KEY in obj:
                return getattr(torch, obj[MEMORY_FORMAT_KEY])
            if DEVICE_KEY in obj:
                return torch.device(obj[DEVICE_KEY])
            if SLICE_KEY in obj:
                return slice(*resolve(obj[SLICE_KEY], file))
            if ELLIPSIS_KEY in obj:
                return Ellipsis
            if TEXT_KEY in obj:
                return KeptAsText(obj[TEXT_KEY], obj.get("type", ""))
            return {k: resolve(v, file, (*where, k)) for k, v in obj.items()}
        if isinstance(obj, list):
            return [resolve(v, file, (*where, i)) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return tuple(resolve(v, file, (*where, i)) for i, v in enumerate(obj))
        return obj

    data = resolve(load(path), path)
    if offsets and isinstance(data, dict):
        data[STORAGE_OFFSETS_KEY] = offsets
    return data


def autocast_state(device: torch.device | None) -> dict | None:
    """``{"device_type": "cuda", "dtype": "float16"}`` when autocast is on for ``device``'s type, else None."""
    dtype = autocast_dtype(device.type) if device is not None else None
    if device is None or dtype is None:
        return None
    return {"device_type": device.type, "dtype": str(dtype).removeprefix("torch.")}
