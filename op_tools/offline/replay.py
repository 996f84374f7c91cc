"""Offline replay of captured calls: find them on disk, load them as data, rerun them on a device.

A captured call is a folder holding ``input.pth`` (and, when they were captured, ``output.pth``,
``grad_inputs.pth``, ``grad_outputs.pth``), as written by

- OpCapture: ``op_capture_results/<op>/<pid>/<forward_id>/<time>/``;
- OpAutoCompare for a failing call: ``op_capture_results/<op>/<pid>/autocompare/<forward_id>/<time>/device/``
  (its ``cpu/`` sibling holds the CPU side and is not replayed on its own).

Files are loaded with ``torch.load(weights_only=True)`` only: a capture is data, and a file that
asks the unpickler for anything but tensors and plain values is refused without running it. The op
is looked up by its recorded name, and only torch operators are run unless a third-party package
is allowed by name (``allowed_modules``): a name in a file must not be able to call ``os.system``.

>>> entries = find_entries("op_tools_results/op_capture_results")
>>> results = [replay(e, "cuda", ReplayOptions(run_times=10, time=True, acc_check=True)) for e in entries]
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import pickle
import re
import statistics
import time
import zipfile
from typing import Any

import torch

from ..numerics.ambiguous_results import with_choices
from ..numerics.comparison import ToleranceSpec, compare_outputs
from ..numerics.device_math import DeviceMath, emulated
from ..numerics.device_timing import device_synchronizer
from ..numerics.error_statistics import DEVICE_STATISTICS_MIN
from ..numerics.reference import DEFAULT_CAST, attempts_for, device_named, map_arguments
from ..ops.arguments import iter_items, iter_tensors, map_tensors
from ..ops.naming import function_from_name
from ..ops.op_facts import op_facts
from ..ops.random_calls import random_reason
from ..ops.writes import call_writes
from ..output.capture_format import (
    AUTOCAST_KEY,
    LAYOUTS_KEY,
    STORAGE_OFFSETS_KEY,
    WRITTEN_KEY,
    KeptAsText,
    layout_lost,
    load_op_args,
    storage_extent,
    written_arguments,
)

ENTRY_FILES = ("input.pth", "output.pth", "grad_inputs.pth", "grad_outputs.pth")

class ReplayError(Exception):
    """One entry cannot be replayed; the message says why, for the user."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One captured call on disk."""

    directory: str
    label: str          # the directory relative to the folder searched
    kind: str           # "capture" or "autocompare"


@dataclasses.dataclass(frozen=True)
class ReplayOptions:
    run_times: int = 1
    backward: bool = True
    time: bool = False
    acc_check: bool = False
    allowed_modules: tuple[str, ...] = ()


@dataclasses.dataclass
class ReplayResult:
    entry: Entry
    name: str = ""
    # ok, mismatch (acc_check failed), reference error (the CPU reference raised), error, not checked (acc_check
    # asked, and the call ran, but nothing of it could be checked: memory never written, random draws from nan)
    status: str = "ok"
    error: str = ""
    device: str = ""
    shapes: str = ""            # the tensor inputs' shapes and dtypes, in argument order
    dtypes: str = ""
    forward_ms: list[float] = dataclasses.field(default_factory=list)
    backward_ms: list[float] = dataclasses.field(default_factory=list)
    checks: list[dict] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    step: int | str = ""        # the optimizer steps done when the call was captured; '' where the capture has none
    op_raised: bool = False     # an "error" of the op itself on the device, not of the capture

    @property
    def failed(self) -> bool:
        """Whether the replay found something or could not do its part (a call that ran, nothing of it checkable,
        has not failed: its verdict says it was not checked)."""
        return self.status not in ("ok", "not checked")

    def verdict(self) -> str:
        """``"found"`` (a mismatch, or the op raised on the device), ``"unchecked"`` (not replayed: a refused or
        broken capture; the CPU reference raised, so nothing to check against; or nothing of the call could be
        checked) or ``"clean"``."""
        if self.status == "mismatch" or self.op_raised:
            return "found"
        return "unchecked" if self.status != "ok" else "clean"


# --- finding entries ---

def find_entries(root: str) -> list[Entry]:
    """Every captured call under ``root`` (a folder of captures, one call's folder, or one call's ``input.pth``), in
    path order."""
    if os.path.isfile(root) and os.path.basename(root) in ENTRY_FILES:
        root = os.path.dirname(root) or "."
    elif os.path.isfile(root):
        raise ReplayError(f"{root}: not a folder of captures nor a capture file ({', '.join(ENTRY_FILES)})")
    elif not os.path.isdir(root):
        raise ReplayError(f"{root}: no such file or directory")
    entries = []
    for directory, subdirs, files in os.walk(root):
        subdirs.sort(key=_natural_key)
        if not any(f in ENTRY_FILES for f in files):
            continue
        parent, base = os.path.split(directory)
        if base == "cpu" and os.path.isdir(os.path.join(parent, "device")):
            continue  # OpAutoCompare's CPU side of a device/ entry
        parts = os.path.normpath(directory).split(os.sep)
        kind = "autocompare" if base == "device" and "autocompare" in parts else "capture"
        label = os.path.relpath(directory, root)
        entries.append(Entry(directory, "." if label == "." else label, kind))
    return entries


def _natural_key(text: str):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


# --- loading: data only ---

def load_file(path: str) -> dict:
    """``load_op_args(path)`` with every way a file can be bad turned into a ReplayError that says which."""
    if not os.path.exists(path):
        raise ReplayError(f"missing file {path}")
    try:
        return load_op_args(path)
    except pickle.UnpicklingError as e:
        wanted = re.search(r"Unsupported (?:global|operand)[^\n]*", str(e))
        detail = f" ({wanted.group(0).strip()})" if wanted else ""
        if wanted and re.search(r"GLOBAL numpy\.", wanted.group(0)):  # OpCapture's own, before it stored numbers
            origin = ("a numpy value, which OpCapture saved as it was before it stored numpy's scalars as Python's "
                      "numbers: capture the call again")
        else:
            origin = "OpCapture never writes such a file: it was made or changed by something else"
        raise ReplayError(f"refused {path}: not plain tensor data{detail}. torch.load(weights_only=True) rejected "
                          f"it, so nothing in it ran; {origin}") from None
    except FileNotFoundError as e:
        raise ReplayError(f"{path} refers to a tensor stored once in {e.filename}, which is missing (OpCapture "
                          "stores a tensor seen again by reference: move or copy the whole capture folder)") from None
    except (EOFError, zipfile.BadZipFile) as e:
        raise ReplayError(f"corrupt or truncated file {path} ({type(e).__name__}: {e or 'ends early'})") from None
    except RuntimeError as e:
        unknown = _UNKNOWN_DEVICE_TYPE.search(str(e))
        if unknown:  # a whole file, naming a device whose backend this process has not registered
            raise ReplayError(
                f"device type {unknown.group(1)!r}, unknown in this process, named in {path}: load it where that "
                f"backend is registered{_HOW_TO_REGISTER.format(unknown.group(1))}") from None
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ReplayError(f"corrupt or truncated file {path} ({first_line})") from None
    except (OSError, KeyError, IndexError, TypeError, ValueError) as e:
        raise ReplayError(f"cannot read {path} ({type(e).__name__}: {e})") from None


# torch's words for a device string whose type it does not know (``torch.device("sim:0")`` without its backend)
_UNKNOWN_DEVICE_TYPE = re.compile(r"device type at start of device string: ([A-Za-z_][\w]*)")
_HOW_TO_REGISTER = " (its package imported; with ditorch, DITORCH_BACKEND={})"


def _recorded_name(entry: Entry) -> str:
    """The op an entry whose files do not load is of: the name its ``input.pth`` records (read alone, without the
    files it refers to), else the op folder of the capture layout (``<op>/<pid>/<forward_id>/<time>/``); "" where
    neither names one."""
    try:
        name = torch.load(os.path.join(entry.directory, "input.pth"), weights_only=True, map_location="cpu")["name"]
    except Exception:  # noqa: BLE001 - missing, truncated, refused or not a dict: the folder may still say
        name = None
    if isinstance(name, str) and name:
        return name
    parts = os.path.normpath(os.path.abspath(entry.directory)).split(os.sep)
    depth = 6 if entry.kind == "autocompare" else 4  # <op>/<pid>/autocompare/<forward_id>/<time>/device/
    folder = parts[-depth] if len(parts) > depth else ""
    return folder if "." in folder else ""  # an op's name (torch.matmul), not a folder of other things


def _load_optional(path: str) -> dict | None:
    return load_file(path) if os.path.exists(path) else None


# --- resolving names: torch operators only, unless a package is allowed ---

@functools.cache
def _overridable() -> tuple[frozenset, frozenset]:
    """The names ``torch.overrides`` gives its functions, and the functions' ids (alive as long as torch)."""
    from torch.overrides import get_overridable_functions, resolve_name

    names, ids = set(), set()
    for functions in get_overridable_functions().values():
        for f in functions:
            ids.add(id(f))
            name = resolve_name(f)
            if name:
                names.add(name)
    return frozenset(names), frozenset(ids)


def _overridable_names() -> frozenset:
    return _overridable()[0]


# Where torch's own functions that ``torch.overrides`` lists as ignored are operators a tool can meet and a replay may
# run (``F.hardswish``, ``x.new_zeros``, ``x.unflatten``): these namespaces hold no function that reads a file or
# runs code, as ``torch.load`` and ``torch.compile``, ignored too, do.
_IGNORED_OPERATORS = ("torch.Tensor.", "torch.nn.functional.")


@functools.cache
def _ignored_operators() -> frozenset:
    """The ids of the functions ``torch.overrides.get_ignored_functions`` lists in ``_IGNORED_OPERATORS``."""
    from torch.overrides import get_ignored_functions, resolve_name

    return frozenset(id(f) for f in get_ignored_functions()
                     if (resolve_name(f) or "").startswith(_IGNORED_OPERATORS))


_ATEN_NAMESPACES = {"torch": "_VariableFunctions", "torch._C._nn": "_nn", "torch._C._linalg": "_linalg",
                    "torch._C._special": "_special", "torch._C._fft": "_fft"}


def is_torch_operator(name: str) -> bool:
    """An op ``torch.overrides`` knows (what OpCapture intercepts) or an aten binding: never ``torch.save``,
    ``torch.load`` or ``torch.hub.load``, which read files or run code."""
    if name in _overridable_names() or name.startswith("torch.ops."):
        return True
    namespace, _, short = name.rpartition(".")
    binding = _ATEN_NAMESPACES.get(namespace)
    return binding is not None and hasattr(getattr(torch._C, binding), short)


def _known_function(func) -> bool:
    """Whether ``func`` is itself a function ``torch.overrides`` knows or an aten binding, whatever its name."""
    if id(func) in _overridable()[1] or id(func) in _ignored_operators():
        return True
    short = getattr(func, "__name__", None)
    return isinstance(short, str) and any(getattr(getattr(torch._C, binding), short, None) is func
                                          for binding in _ATEN_NAMESPACES.values())


def resolve_op(name: str, allowed_modules: tuple[str, ...] = ()):
    """The function a capture names, if it may run: a torch operator, or in a package the user allowed."""
    if not isinstance(name, str) or not name:
        raise ReplayError(f"the capture names no op ({name!r})")
    top = name.split(".")[0]
    if top not in ("torch", "aten") and top not in allowed_modules:  # refused before importing anything it names
        raise ReplayError(f"refused op name {name!r}: not a torch op; to run a function of package {top!r}, "
                          f"allow it with --allow_module {top}")
    try:  # an aten operator called directly is named as torch names it (aten.slice.Tensor): torch.ops.aten's
        func = function_from_name(f"torch.ops.{name}" if top == "aten" else name)[2]
    except ValueError as e:
        raise ReplayError(f"unknown op {name!r}: {e}") from None
    # by its function too: the tools name torch.relu_ by its alias torch.nn.functional.relu_, an aten binding
    if top == "torch" and not is_torch_operator(name) and not _known_function(func):
        raise ReplayError(f"refused op name {name!r}: not a torch operator (a capture names operators only)")
    return func


# --- running ---

def replay(entry: Entry, device: str | torch.device, options: ReplayOptions) -> ReplayResult:
    """Load ``entry``, rerun its op on ``device`` ``options.run_times`` times (and backward), check it if asked.

    Never raises for a bad entry: the result's ``status`` and ``error`` say what went wrong.
    """
    result = ReplayResult(entry, device=str(device))
    try:
        _replay(entry, torch.device(device), options, result)
        if options.acc_check and result.status == "ok" and not result.checks:  # asked for, and none made
            result.status = "not checked"
    except ReplayError as e:
        result.status, result.error = "error", str(e)
        result.name = result.name or _recorded_name(entry)  # a file that would not load: the op named all the same
    except Exception as e:  # the op itself raised: that is a finding, reported with the op's own words
        first_line = (str(e).strip().splitlines() or [""])[0]
        unknown = _UNKNOWN_DEVICE_TYPE.search(first_line)
        if unknown:  # a device the call names ("sim"), of a type this process lacks: no kernel ran to be at fault
            result.status, result.error = "error", (
                f"the call names device type {unknown.group(1)!r}, unknown in this process: replay it where that "
                f"backend is registered{_HOW_TO_REGISTER.format(unknown.group(1))}")
            return result
        result.status, result.error = "error", f"{result.name or 'op'} raised {type(e).__name__}: {first_line}"
        result.op_raised = True
    return result


def _replay(entry: Entry, device: torch.device, options: ReplayOptions, result: ReplayResult) -> None:
    data = load_file(os.path.join(entry.directory, "input.pth"))
    result.name = name = data.get("name", "")
    step = data.get("step")  # saved with the call (capture_format.py); captures made before have none
    result.step = step if isinstance(step, int) and not isinstance(step, bool) else ""
    func = resolve_op(name, options.allowed_modules)
    args, kwargs = tuple(data.get("args", ())), dict(data.get("kwargs") or {})
    tensors = [*iter_tensors(args), *iter_tensors(kwargs)]
    result.shapes = " ".join(str(list(t.shape)) for t in tensors)
    result.dtypes = " ".join(str(t.dtype).removeprefix("torch.") for t in tensors)
    if name.endswith(("__getitem__", "__setitem__")) and len(args) > 1:
        args = (args[0], decode_index(args[1]), *args[2:])
    _refuse_text_arguments(name, args, kwargs)
    args, kwargs = _layout_read(name, args, kwargs, data)
    saved_output = _load_optional(os.path.join(entry.directory, "output.pth"))
    saved_grads = _load_optional(os.path.join(entry.directory, "grad_outputs.pth")) if options.backward else None
    # the gradients the capture's backward computed: read (a broken file is an error, as the others) and, with
    # --acc_check, compared with the replay's
    saved_grad_inputs = _load_optional(os.path.join(entry.directory, "grad_inputs.pth")) if options.backward else None
    upstream = tuple(saved_grads["args"]) if saved_grads else ()

    device_args, device_kwargs = _on_device(args, device), _on_device(kwargs, device)
    device_upstream = _on_device(upstream, device)
    if options.acc_check and not _arrived((args, kwargs, upstream), (device_args, device_kwargs, device_upstream),
                                          result):
        return  # every check would blame the op for what the copy did
    sync = _synchronizer(device)
    inplace = not call_writes(name).never  # every run writes copies of the captured values, never them
    autocast = _autocast(data.get(AUTOCAST_KEY), device, result)
    backward = options.backward
    first = None
    # With timing asked for, one untimed run first: the first call pays one-time costs (lazy init,
    # allocator growth, kernel selection) that would skew the mean of a few runs.
    warmup = 1 if options.time else 0
    runs, run = warmup + max(options.run_times, 1), 0
    while run < runs:
        call_args, call_kwargs, leaves = _prepare(device_args, device_kwargs, backward, inplace)
        sync()
        start = time.perf_counter_ns()
        try:
            with autocast():
                output = func(*call_args, **call_kwargs)
        except RuntimeError as e:
            if not (backward and _no_derivative(e)):
                raise
            backward = False  # an op without a gradient formula (GradScaler's _amp_update_scale_): forward only
            result.notes.append("no backward: the op has no derivative")
            continue  # the same run again, forward only
        sync()
        if run >= warmup:
            result.forward_ms.append((time.perf_counter_ns() - start) / 1e6)
        grads = None
        if backward:
            roots = [t for t in iter_tensors(output) if t.grad_fn is not None]
            if roots:
                upstream_grads = _upstream(output, roots, device_upstream, result)
                sync()
                start = time.perf_counter_ns()
                try:
                    torch.autograd.backward(roots, upstream_grads)
                except RuntimeError as e:  # some backends refuse such an op only in backward (a node that raises)
                    if not _no_derivative(e):
                        raise
                    backward = False
                    result.notes.append("no backward: the op has no derivative")
                    if run >= warmup:
                        result.forward_ms.pop()
                    continue  # the same run again, forward only
                sync()
                if run >= warmup:
                    result.backward_ms.append((time.perf_counter_ns() - start) / 1e6)
                grads = [leaf.grad for leaf in leaves]
        if first is None:
            first = (output, grads, written_arguments(name, call_args, call_kwargs, output))
        run += 1
    if backward and not result.backward_ms:
        result.notes.append("no backward: no output depends on an input that required grad when captured")
    if options.acc_check:
        reason = random_reason(name, args, kwargs)
        if reason is not None:
            # first: the detail column shows the notes in order, and this one says what the checks are worth
            result.notes.insert(0, "random draws: accuracy not checked (a rerun draws other numbers)")
            if first is not None:  # every run makes it (runs >= 1)
                _check_finite(args, kwargs, upstream, first, result)
            return
        if op_facts(name).uninitialised:  # what any run holds there is whatever the memory held
            result.notes.insert(0, "memory never written (torch.empty's): accuracy not checked")
            return
        with autocast():
            math = DeviceMath.of(device, name)  # the replay device's declared math for this op, under its autocast
        _check(func, args, kwargs, upstream, inplace, first, saved_output, options, result, math, saved_grad_inputs)
        if result.status == "ok" and any(not c["ok"] for c in result.checks):
            result.status = "mismatch"


def _on_device(obj, device: torch.device):
    """The captured arguments for the run on ``device``: tensors moved there, and a device the call named other than
    the CPU (``x.to("npu:0")``, ``ones_like(x, device=...)``) as ``device``: a capture made on another device, or
    machine, runs where the replay runs."""
    if isinstance(obj, torch.Tensor):
        return _moved(obj, device) if layout_lost(obj) else obj.to(device)
    if isinstance(obj, torch.device):
        return obj if obj.type == "cpu" else device
    if isinstance(obj, str):  # "npu:0"; any other text ("mean") names no device
        named = device_named(obj)
        return str(device) if named is not None and named.type != "cpu" else obj
    if isinstance(obj, dict):
        return {k: _on_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        items = [_on_device(v, device) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def _captured_output(saved: tuple, actual: tuple) -> tuple:
    """The output an ``output.pth`` holds, as ``actual`` is laid out: OpCapture saves a tuple of outputs as its
    ``args``, the original ditorch saved every output as the one element of ``args`` (``((values, indices),)`` for a
    ``sort``)."""
    nested = len(saved) == 1 and isinstance(saved[0], (list, tuple))
    if nested and not (len(actual) == 1 and isinstance(actual[0], (list, tuple))):
        return tuple(saved[0])
    return saved


def _no_derivative(error: RuntimeError) -> bool:
    """PyTorch's error for an op without a gradient formula (``derivative for aten::X is not implemented``)."""
    return "derivative for" in str(error) and "not implemented" in str(error)


_SLICE_TEXT = re.compile(r"slice\((-?\d+|None), (-?\d+|None), (-?\d+|None)\)")


def decode_index(index):
    """An indexing argument as OpCapture stores it (slices and ``...`` as their repr, since ``weights_only`` loading
    allows neither) back to Python objects; only those exact forms are decoded, nothing is evaluated."""
    if isinstance(index, (list, tuple)) and not isinstance(index, torch.Size):
        items = [decode_index(v) for v in index]
        return items if isinstance(index, list) else tuple(items)
    if index == "Ellipsis":
        return Ellipsis
    if isinstance(index, str):
        match = _SLICE_TEXT.fullmatch(index)
        if match:
            return slice(*(None if g == "None" else int(g) for g in match.groups()))
    return index


# the repr of an object no call takes back (``<torch._C.Generator object at 0x7f...>``), as captures kept one as a
# plain str before they marked it (KeptAsText)
_OBJECT_TEXT = re.compile(r"<[\w.]+ object at 0x[0-9a-fA-F]+>")


def _refuse_text_arguments(name: str, args: tuple, kwargs: dict) -> None:
    """A ReplayError naming the first argument the capture could keep only as its text: the call cannot be made
    again, which is the format's limit, not the device's (before, the text went to the op, and its TypeError read as
    the device's)."""
    indexing = name.endswith(("__getitem__", "__setitem__"))
    for side, values in (("args", args), ("kwargs", kwargs)):
        for where, value in iter_items(values):
            if isinstance(value, KeptAsText):
                kind = f" (a {value.type_name})" if value.type_name else ""
                raise ReplayError(f"not replayable: argument {side}{where} of {name} was captured as its text only, "
                                  f"{value.text!r}{kind}: the capture format keeps tensors and plain values")
            # a str left in an index (old captures' ``slice(None, tensor(3), None)``) is text no index takes
            if isinstance(value, str) and (_OBJECT_TEXT.fullmatch(value) or
                                           (indexing and side == "args" and where.startswith("[1]"))):
                raise ReplayError(f"not replayable: argument {side}{where} of {name} was captured as its text only, "
                                  f"{value!r}, by an older version of OpCapture: capture the call again")


def _synchronizer(device: torch.device):
    if device.type == "cpu":
        return lambda: None
    sync = device_synchronizer(device)
    return lambda: sync(device)


def _prepare(args, kwargs, with_grad: bool, inplace: bool):
    """Fresh inputs for one run: the tensors that required grad when captured become leaves (for backward); an op
    that writes an argument gets copies, so that every run sees the captured values and a leaf is never written."""
    leaves: list[torch.Tensor] = []

    def fresh(t: torch.Tensor) -> torch.Tensor:
        if with_grad and t.requires_grad and (t.is_floating_point() or t.is_complex()):
            leaf = _copy(t.detach()).requires_grad_(True)
            leaves.append(leaf)
            return leaf.clone() if inplace else leaf  # a leaf written in place: its copy is dense (autograd's)
        if t.requires_grad:  # forward only: no graph (an op without a derivative formula would refuse to run)
            t = t.detach()
        return _copy(t) if inplace else t

    return map_tensors(args, fresh), map_tensors(kwargs, fresh), leaves


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` lying in its storage as ``t`` does (``clone`` makes ``x[:, ::2]`` or an expanded tensor
    dense)."""
    return _moved(t, t.device) if layout_lost(t) else t.clone()


def _moved(t: torch.Tensor, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A copy of ``t`` on ``device`` in ``dtype``, its storage from its start to ``t``'s last element copied, and
    ``t``'s sizes, strides and offset on it: an op reading its memory (``as_strided``) reads what it did at capture."""
    base = t.detach().as_strided((t.storage_offset() + storage_extent(t),), (1,), 0)
    moved = base.to(device=device, dtype=dtype or t.dtype, copy=True).as_strided(t.shape, t.stride(),
                                                                                 t.storage_offset())
    return moved.requires_grad_() if t.requires_grad else moved


def _layout_read(name: str, args: tuple, kwargs: dict, data: dict) -> tuple[tuple, dict]:
    """The arguments of a call of an op reading its input's storage (``as_strided``), its explicit storage offset
    moved to where the capture saved that storage; a ReplayError where the call reads memory the capture did not save,
    or a capture made before layouts were kept (its tensors dense copies): rerun there, it reads other memory, and its
    difference would read as the device's."""
    parts = name.split(".")
    short = parts[-2] if parts[0] == "aten" and len(parts) > 2 else parts[-1]  # aten.as_strided.default
    first = op_facts(short).layout_read
    source = args[0] if args else kwargs.get("input", kwargs.get("self"))
    if first is None or not isinstance(source, torch.Tensor):
        return args, kwargs
    if not data.get(LAYOUTS_KEY):
        raise ReplayError(f"not replayable: the input's layout was not captured: {name} reads its input's storage, "
                          "which captures made before OpCapture kept layouts saved as a dense copy (its strides and "
                          "storage offset lost): capture the call again")
    names = ("size", "stride", "storage_offset")
    values = [args[first + i] if len(args) > first + i else kwargs.get(key) for i, key in enumerate(names)]
    size, stride, offset = values
    if size is None or stride is None:  # a call torch refuses as it is: the op says so
        return args, kwargs
    captured = data.get(STORAGE_OFFSETS_KEY, {}).get(("args", 0) if args else ("kwargs", "input"), 0)
    available = source.untyped_storage().nbytes() // source.element_size() - source.storage_offset()
    start = captured if offset is None else int(offset)
    extent = 1 + sum((int(n) - 1) * int(s) for n, s in zip(size, stride)) if all(int(n) for n in size) else 0
    if extent and (start < captured or start + extent > captured + available):
        raise ReplayError(f"not replayable: the input's layout was not captured: {name} reads storage elements "
                          f"{start} to {start + extent - 1}, the capture saved {captured} to {captured + available - 1}"
                          " (the span its input covers)")
    if offset is None or int(offset) == captured == source.storage_offset():
        return args, kwargs
    moved = int(offset) - captured + source.storage_offset()  # where that element lies in the storage loaded
    if len(args) > first + 2:
        return (*args[:first + 2], moved, *args[first + 3:]), kwargs
    return args, {**kwargs, "storage_offset": moved}


def _upstream(output, roots: list, captured: tuple, result: ReplayResult) -> list:
    """The captured upstream gradients where they fit the outputs; ones otherwise (noted)."""
    grads = [g for g in captured if g is None or isinstance(g, torch.Tensor)]
    outputs = list(iter_tensors(output))
    if len(grads) == len(outputs) != len(roots):  # one per output, None for those without a gradient (sort's indices)
        at = {id(t): g for t, g in zip(outputs, grads)}
        grads = [at.get(id(r)) for r in roots]
    if len(grads) == len(roots) and all(g is None or g.shape == r.shape for g, r in zip(grads, roots)):
        return [torch.zeros_like(r) if g is None else g.to(r.dtype) for g, r in zip(grads, roots)]
    if not result.notes or "ones" not in result.notes[-1]:
        result.notes.append("backward with ones as upstream gradients" + (" (captured ones do not fit)"
                                                                           if captured else ""))
    return [torch.ones_like(r) for r in roots]


# --- accuracy: OpAutoCompare's verdict ---

def _autocast(state: dict | None, device: torch.device, result: ReplayResult):
    """A context re-entering the autocast a call was captured under (on the replay device), or none."""
    if not state:
        return contextlib.nullcontext
    dtype = getattr(torch, str(state.get("dtype", "")), None)
    if not isinstance(dtype, torch.dtype):
        result.notes.append(f"captured under autocast with an unknown dtype {state.get('dtype')!r}: replayed without")
        return contextlib.nullcontext
    result.notes.append(f"replayed under autocast {state['dtype']}")
    return functools.partial(torch.autocast, device.type, dtype=dtype)


def _arrived(captured, moved, result: ReplayResult) -> bool:
    """Whether the captured tensors reached the device as they were (read back, bit for bit, nan where nan); else
    the check ``"inputs on the device"`` fails, naming the first that changed: a faulty copy to the device would
    make every op it feeds (a view's, a sort's) look wrong."""
    pairs = list(zip(iter_tensors(captured), iter_tensors(moved)))
    for index, (before, after) in enumerate(pairs):
        try:
            back = after.detach().to("cpu")
            same = back.shape == before.shape and back.dtype == before.dtype and _same_values(before.detach(), back)
        except (RuntimeError, NotImplementedError) as error:  # no read-back or comparison for it (a meta tensor,
            # complex32): not the op's failure, which the entry would otherwise report
            result.notes.append(f"tensor {index} of the inputs not read back from the device "
                                f"({type(error).__name__}: {str(error).splitlines()[0][:120]})")
            continue
        if not same:
            result.checks.append({"check": "inputs on the device", "ok": False,
                                  "detail": f"tensor {index} of the call's inputs reads back changed from the device: "
                                            "the copy to the device is at fault, not the op (the op is not run)"})
            result.status = "mismatch"
            return False
    return True


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.layout != torch.strided:  # sparse: compared through their dense values
        a, b = a.to_dense(), b.to_dense()
    if a.is_quantized:
        a, b = a.dequantize(), b.dequantize()
    if a.is_floating_point() or a.is_complex():
        nan = torch.isnan(a)
        return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan])
    return torch.equal(a, b)


def _check_finite(args, kwargs, upstream, first, result: ReplayResult) -> None:
    """A random op's checks: from finite floating inputs, finite floating outputs, and from finite upstream gradients
    too, finite input gradients (its values, drawn again, are not compared; a kernel writing nan or inf is found all
    the same, forward or backward)."""
    output, grads, _ = first
    if not _all_finite([*iter_tensors(args), *iter_tensors(kwargs)]):  # nan in, nan out: no kernel's nan told apart
        result.notes.append("finiteness not checked: the captured inputs hold nan or inf")
        return
    _finite_check("output", list(iter_tensors(output)), "finite inputs", result)
    if grads is None:
        return  # no backward ran (forward only, or no output depends on an input that required grad)
    if not _all_finite(list(iter_tensors(upstream))):
        result.notes.append("grad not checked: the captured upstream gradients hold nan or inf")
        return
    _finite_check("grad", [g for g in grads if g is not None], "finite inputs and upstream gradients", result)


def _all_finite(tensors: list) -> bool:
    return all(bool(torch.isfinite(t.detach().cpu()).all()) for t in tensors if t.is_floating_point() or t.is_complex())


def _finite_check(what: str, tensors: list, source: str, result: ReplayResult) -> None:
    """The check ``"<what> finite"`` of the floating ``tensors`` (none: no check), a mismatch where one holds nan or
    inf."""
    floating = [t for t in tensors if t.is_floating_point() or t.is_complex()]
    if not floating:
        return
    bad = [i for i, t in enumerate(floating) if not bool(torch.isfinite(t.detach().cpu()).all())]
    result.checks.append({"check": f"{what} finite", "ok": not bad,
                          "detail": f"{what}[{bad[0]}] holds nan or inf from {source}" if bad else
                          f"every {what} finite"})
    if bad:
        result.status = "mismatch"


def _check(func, args, kwargs, upstream, inplace, first, saved_output, options, result,
           math: DeviceMath | None = None, saved_grad_inputs: dict | None = None) -> None:
    output, grads, written = first
    with_grad = grads is not None
    tolerance = ToleranceSpec.from_env()  # the user's AUTOCOMPARE_ERROR_TOLERANCE* variables, as OpAutoCompare

    def same_dtype():  # the CPU in the device's dtypes, computing as the device declared (as OpAutoCompare)
        with emulated(math or DeviceMath()):
            return _cpu_run(func, result.name, args, kwargs, upstream, inplace, with_grad, {}, output)

    reference, error = None, None
    for cast, note in attempts_for(DEFAULT_CAST):  # float64; float32 or the device's dtype where the CPU lacks it
        try:
            reference = _cpu_run(func, result.name, args, kwargs, upstream, inplace, with_grad, cast, output)
        except Exception as e:  # noqa: BLE001 - the next cast, or the error reported below
            error = e
            continue
        if note:
            result.notes.append(note)
        break
    if reference is None:  # no verdict: the op ran on the device, the CPU could not say what it should give
        result.status = "reference error"
        result.error = (f"the CPU reference raised {type(error).__name__}: "
                        f"{(str(error).strip().splitlines() or [''])[0]}")
        return
    same_cache: list = []

    def same():
        if not same_cache:
            same_cache.append(same_dtype())
        return same_cache[0]

    # every side moved alike: an op that makes device tensors (x.to(device)) has its reference there too
    output, grads, reference = _compared(output), _compared(grads), _compared(reference)
    result.checks.append(_verdict("output vs cpu float64", compare_outputs(
        output, reference[0], lambda: _compared(same()[0]), tolerance, op_name=result.name, prefix="output")))
    if with_grad:
        result.checks.append(_verdict("grad vs cpu float64", compare_outputs(
            grads, reference[1], lambda: _compared(same()[1]), tolerance, op_name=result.name, prefix="grad")))
    written, reference_written = _compared(written), _compared(reference[2])
    if written or reference_written:  # what the op wrote beyond its result (x[0] = 5 returns None) is checked too
        result.checks.append(_verdict("written vs cpu float64", _written_comparisons(
            written, reference_written, lambda: _compared(same()[2]), tolerance, result.name)))
    if saved_output is not None:
        actual = tuple(output) if isinstance(output, (list, tuple)) else (output,)
        saved = _compared(_captured_output(tuple(saved_output.get("args", ())), actual))
        result.checks.append(_verdict("output vs captured output", compare_outputs(
            actual, saved, None, tolerance, op_name=result.name, prefix="output")))
        if written:
            _check_written_as_captured(written, saved_output.get(WRITTEN_KEY), tolerance, result)
    else:  # the capture never wrote it (the call raised where captured), or it was lost since
        result.notes.append("no output.pth: not compared with the captured output")
    if with_grad and saved_grad_inputs is not None:
        captured = tuple(saved_grad_inputs.get("args", ()))
        if op_facts(result.name).ambiguous:  # the gradients follow the capture's choice of ties or signs
            result.notes.append("grad_inputs.pth not compared: the op's result has several right answers, and its "
                                "gradients follow the one each run chose")
        elif len(captured) == len(grads):  # the inputs that required grad, in argument order, each once
            result.checks.append(_verdict("grad vs captured grad", compare_outputs(
                tuple(grads), _compared(captured), None, tolerance, op_name=result.name, prefix="grad")))
        else:
            result.notes.append(f"grad_inputs.pth not compared: it holds {len(captured)} gradients, the replay "
                                f"computed {len(grads)} (an input passed twice)")


def _check_written_as_captured(written: dict, saved, tolerance, result: ReplayResult) -> None:
    """The check of what the replay wrote against what the capture saved the call wrote, or a note saying why none."""
    if not isinstance(saved, dict):  # an output.pth of before the written arguments were saved: its result only
        result.notes.append("written arguments not compared with the captured ones: captured by an older version")
    elif set(saved) != set(written):
        result.notes.append(f"written arguments not compared with the captured ones: the capture holds "
                            f"{', '.join(saved) or 'none'}, the replay wrote {', '.join(written)}")
    else:
        result.checks.append(_verdict("written vs captured", _written_comparisons(
            written, _compared(saved), None, tolerance, result.name)))


def _written_comparisons(written: dict, reference: dict, same_dtype, tolerance, op_name: str) -> list:
    """``compare_outputs`` of the tensors a call wrote (``{"args[0]": tensor}``, ``written_arguments``), in the
    device run's order, each named ``written args[0]``."""
    paths = list(written)
    comparisons = compare_outputs(
        tuple(written.values()), tuple(reference.get(p) for p in paths),
        None if same_dtype is None else lambda: tuple(same_dtype().get(p) for p in paths),
        tolerance, op_name=op_name, prefix="written")
    if len(comparisons) == len(paths):  # else one failure saying the structures differ, named as it is
        for comparison, path in zip(comparisons, paths):
            comparison.name = f"written {path}"
    return comparisons


def _compared(value):
    """What the device's results are compared as, by OpAutoCompare's rule: a tensor below ``DEVICE_STATISTICS_MIN``
    elements copied to the host once (its statistics there), a larger one on its device."""
    return map_tensors(value, lambda t: t.detach().cpu() if t.device.type != "cpu" and
                       t.numel() < DEVICE_STATISTICS_MIN else t)


def _cpu_run(func, name: str, args, kwargs, upstream, inplace, with_grad, cast: dict, chosen=None):
    """The op ``name`` on the CPU, its inputs' dtypes through ``cast``: (output, input grads, what it wrote beyond its
    output, ``written_arguments``). ``chosen``: the device's output, whose choices among several right answers (a
    tie's index, an eigenvector's sign) the CPU's takes where they are valid, before its backward."""
    # as OpAutoCompare's reference: the devices the call named moved to the CPU (``ones_like(x, device="npu")``'s
    # reference ran on the device, faults and all) and its dtype arguments cast as its tensors are
    convert = functools.partial(map_arguments, tensor_fn=lambda t: _to_cpu(t, cast), cast=cast)
    call_args, call_kwargs, leaves = _prepare(convert(args), convert(kwargs), with_grad, inplace)
    output = func(*call_args, **call_kwargs)
    if chosen is not None:
        output = with_choices(name, chosen, call_args, call_kwargs, output)
    written = written_arguments(name, call_args, call_kwargs, output)
    if not with_grad:
        return output, None, written
    # an input handed back (``x.to(torch.bfloat16)`` cast to ``x.to(torch.float64)`` of a float64 copy) takes the
    # upstream gradient as it is, through a view
    output = map_tensors(output, lambda t: t.view_as(t) if t.requires_grad and t.grad_fn is None else t)
    roots = [t for t in iter_tensors(output) if t.grad_fn is not None]
    if roots:
        torch.autograd.backward(roots, _upstream(output, roots, convert(tuple(upstream)),
                                                 ReplayResult(Entry("", "", ""))))
    return output, [leaf.grad for leaf in leaves], written


def _to_cpu(t: torch.Tensor, cast: dict) -> torch.Tensor:
    """``t`` on the CPU, its dtype through ``cast``, a new tensor requiring grad where ``t`` did."""
    dtype = cast.get(t.dtype, t.dtype)
    cpu = _moved(t, "cpu", dtype).detach() if layout_lost(t) else t.detach().to(device="cpu", dtype=dtype)
    return cpu.requires_grad_() if t.requires_grad else cpu


def _verdict(check: str, comparisons: list) -> dict:
    failed = [c for c in comparisons if not c.passed]
    worst = max((c.max_relative_diff for c in comparisons if c.max_relative_diff == c.max_relative_diff),
                default=0.0)
    if failed:
        detail = "; ".join(f"{c.name}: {c.error_info or 'differs'}" for c in failed[:3])
        return {"check": check, "ok": False, "detail": detail}
    return {"check": check, "ok": True, "detail": f"max relative diff {worst:.3g}"}


def summary_row(r: ReplayResult) -> dict[str, Any]:
    """One entry of the summary: what ran (op, inputs, device), the verdict, and its times (ms) over the runs."""
    failed_check = next((c for c in r.checks if not c["ok"]), None)
    checks = "; ".join(f"{c['check']}: {'pass' if c['ok'] else 'FAIL'}" for c in r.checks)
    return {"entry": r.entry.label, "name": r.name, "shapes": r.shapes, "dtypes": r.dtypes, "device": r.device,
            "status": r.status, "runs": len(r.forward_ms), **_time_columns("forward", r.forward_ms),
            **_time_columns("backward", r.backward_ms), "checks": checks,
            "detail": r.error or (f"{failed_check['check']}: {failed_check['detail']}" if failed_check else "")
            or "; ".join(r.notes), "step": r.step}


def _time_columns(phase: str, values: list[float]) -> dict[str, Any]:
    if not values:
        return {f"{phase}_mean_ms": "", f"{phase}_median_ms": "", f"{phase}_min_ms": ""}
    return {f"{phase}_mean_ms": round(statistics.fmean(values), 6),
            f"{phase}_median_ms": round(statistics.median(values), 6), f"{phase}_min_ms": round(min(values), 6)}
