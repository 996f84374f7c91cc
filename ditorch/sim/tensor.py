"""The sim device's tensors and kernels.

A sim tensor is a PrivateUse1 wrapper (``SimTensor``) around a CPU tensor of identical size,
strides and storage offset (``_data``). Every aten op reaches ``run_op``: through
``__torch_dispatch__`` for ops with a sim tensor argument, through a PrivateUse1 fallback for
factories. ``run_op`` swaps each wrapper for its CPU tensor, runs the CPU kernel, and wraps what
comes back, so views alias, in-place ops mutate and numbers equal the CPU's bit for bit.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from typing import Any

import torch
from torch._C import DispatchKey, DispatchKeySet

# The real device, also under DITORCH_SHOW_DEVICE_AS_CUDA (which makes Tensor.device say cuda) and under any mode.
from ..show_as_cuda import real_device
from . import device_counters as _counters
from . import fault_injection as _faults
from .kernels import KERNELS as _KERNELS
from .version_counter import WRITES as _UNVERSIONED_WRITES

_CPU = torch.device("cpu")
_META_KEYS = DispatchKeySet(DispatchKey.Meta)
_set_metadata = torch.ops.aten.set_.source_Storage_storage_offset

# Ops that CUDA lets take CPU tensors next to device ones (copies, indices).
_MIXED_DEVICE_OK = {
    "aten::copy_", "aten::copy", "aten::_copy_from", "aten::_copy_from_and_resize", "aten::_to_copy",
    "aten::index", "aten::index_put_", "aten::index_put", "aten::_index_put_impl_",
    "aten::set_", "aten::is_set_to", "aten::_has_same_storage_numel", "aten::is_same_size",
}

# Arguments CUDA takes on the CPU beside device tensors, where the op reads them on the host: sequence lengths and a
# packed sequence's batch sizes (which PyTorch keeps on the CPU), CTC's lengths.
_CPU_ARGUMENTS = {
    "aten::_pack_padded_sequence": ("lengths",), "aten::_pad_packed_sequence": ("batch_sizes",),
    **{f"aten::{rnn}": ("batch_sizes",) for rnn in ("lstm", "gru", "rnn_tanh", "rnn_relu")},
    "aten::_ctc_loss": ("input_lengths", "target_lengths"),
    "aten::_ctc_loss_backward": ("input_lengths", "target_lengths"),
}

# Results a real device's kernel computes on the host and returns there: a packed sequence's batch sizes.
_CPU_RESULTS = {"aten::_pack_padded_sequence": 1}

# Composite ops run as torch defines them when they reach the device (see _OpInfo.decomposed).
_DECOMPOSED = {"aten::to"}


class DeviceSelection:
    """Which sim device is current, per thread as torch.cuda does it; whether the device was initialised."""

    count = 1
    _local = threading.local()
    # Lazily, as CUDA: by the first tensor, set_device or current_device. PyTorch reads it: DeviceMesh sets the
    # current device from LOCAL_RANK only while the device is not initialised (FSDP2's example relies on it).
    initialized = False

    @classmethod
    def current(cls) -> int:
        return getattr(cls._local, "index", 0)

    @classmethod
    def set_current(cls, index: int) -> None:
        cls._local.index = cls.check(index)
        cls.initialized = True

    @classmethod
    def check(cls, index: int) -> int:
        if not 0 <= index < cls.count:
            raise RuntimeError(
                f"sim: invalid device ordinal {index}: torch.sim.device_count() is {cls.count} "
                "(set DITORCH_SIM_DEVICE_COUNT for more)"
            )
        return index


def _traced(data: torch.Tensor) -> bool:
    """Whether a sim tensor's CPU tensor is a fake or functional one (torch.compile tracing through the wrapper):
    it has no values."""
    return data.__class__ is not torch.Tensor and torch._C._dispatch_keys(data).has(DispatchKey.Python)


def host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def _size_text(nbytes: int) -> str:
    """As CUDA's allocator writes sizes in its out-of-memory message."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes} bytes"


# The host allocator's words when the host itself has no room: the device's memory is the host's.
_HOST_OUT_OF_MEMORY = re.compile(r"DefaultCPUAllocator: can't allocate memory: you tried to allocate (\d+) bytes")


class _Memory:
    """Bytes held by live sim storages per device; a storage counts while any sim tensor uses it. Each device has
    ``total`` bytes (``DITORCH_SIM_TOTAL_MEMORY``, else the host's memory): a storage that would take a device past
    it is refused with ``torch.OutOfMemoryError``, as a GPU's allocator refuses it."""

    TOTAL_VAR = "DITORCH_SIM_TOTAL_MEMORY"

    def __init__(self) -> None:
        self.allocated: dict[int, int] = {}
        self.peak: dict[int, int] = {}
        self.total = host_memory()
        self._refs: dict[int, list] = {}  # storage data_ptr -> [tensor count, nbytes, device]
        self._lock = threading.Lock()

    def track(self, tensor: SimTensor, data: torch.Tensor, index: int) -> None:
        if _traced(data):  # a fake or functional tensor holds no memory
            tensor._storage_key = 0
            return
        DeviceSelection.initialized = True
        storage = data.untyped_storage()
        key = storage.data_ptr()
        if key:
            with self._lock:
                ref = self._refs.get(key)
                if ref is None:
                    nbytes = storage.nbytes()
                    total = self.allocated.get(index, 0) + nbytes
                    if total > self.total:  # refused before it counts: the tensor holds nothing
                        tensor._storage_key = 0
                        raise self.out_of_memory(index, nbytes)
                    self._refs[key] = [1, nbytes, index]
                    self.allocated[index] = total
                    if total > self.peak.get(index, 0):
                        self.peak[index] = total
                else:
                    ref[0] += 1
        tensor._storage_key = key

    def out_of_memory(self, index: int, nbytes: int) -> torch.OutOfMemoryError:
        allocated = self.allocated.get(index, 0)
        return torch.OutOfMemoryError(
            f"sim out of memory. Tried to allocate {_size_text(nbytes)}. sim {index} has a total capacity of "
            f"{_size_text(self.total)} of which {_size_text(max(self.total - allocated, 0))} is free. Of the "
            f"allocated memory {_size_text(allocated)} is allocated by PyTorch. ({self.TOTAL_VAR} sets the sim "
            "device's memory.)")

    def host_out_of_memory(self, error: RuntimeError, index: int) -> torch.OutOfMemoryError | None:
        """The device's out-of-memory error for the host allocator's ``error`` in a kernel writing to sim."""
        found = _HOST_OUT_OF_MEMORY.search(str(error))
        return self.out_of_memory(index, int(found.group(1))) if found else None

    def release(self, key: int) -> None:
        if not key:
            return
        with self._lock:
            ref = self._refs.get(key)
            if ref is None:
                return
            ref[0] -= 1
            if ref[0] == 0:
                del self._refs[key]
                self.allocated[ref[2]] -= ref[1]

    def reset_peak(self, index: int) -> None:
        with self._lock:
            self.peak[index] = self.allocated.get(index, 0)

    def restore_peak(self, index: int, peak: int | None) -> None:
        """Put back a peak read before sim's own allocations (None: none yet)."""
        with self._lock:
            if peak is None:
                self.peak.pop(index, None)
            else:
                self.peak[index] = peak


MEMORY = _Memory()


class _DeviceMemory:
    """``DITORCH_SIM_DEVICE_MEMORY``: whether ``untyped_storage()`` reports device memory, as a GPU tensor's does, so
    that code taking its device-memory branches (statistics computed on the device) runs on sim."""

    ENV_VAR = "DITORCH_SIM_DEVICE_MEMORY"
    on = False


DEVICE_MEMORY = _DeviceMemory()
_DEVICES: list = []  # filled by set_device_count once "sim" is a device name


def never_compiled(function=None, *, recursive: bool = False):
    """Tell torch.compile never to compile ``function``'s frames (through the C extension: importing dynamo costs
    a second), nor, if ``recursive``, the frames it calls. A finalizer runs whenever the garbage collector runs,
    inside compiled code too, where dynamo would try to trace it, fail, and print a traceback per tensor freed,
    leaving its memory counted (issue 35). The device's entry points (``__torch_dispatch__``, the PrivateUse1
    kernels) run in a compiled region's eager code (a graph break's op): they and their kernels are the device's
    work, which dynamo traced as the program's, faking their sim tensors on the way (issue 35 item 1)."""
    if function is None:
        return lambda fn: never_compiled(fn, recursive=recursive)
    eval_frame: Any = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    try:
        action = eval_frame._FrameAction
        strategy = eval_frame._FrameExecStrategy(action.SKIP, action.SKIP if recursive else action.DEFAULT)
        eval_frame.set_code_exec_strategy(function.__code__, strategy)
    except (AttributeError, TypeError):  # another PyTorch: its older entry, where it has one
        skip = getattr(eval_frame, "skip_code", None)
        if callable(skip):
            skip(function.__code__)
    return function


class SimTensor(torch.Tensor):
    """A tensor on the sim device; ``_data`` is the CPU tensor holding its values."""

    # Without this, Tensor.__torch_function__ would re-wrap plain results (of .cpu()) as SimTensor.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # as torch's own subclasses

    _data: torch.Tensor  # the CPU tensor (set by wrap)
    _index: int  # the sim device's index
    _storage_key: int  # its storage's data_ptr in MEMORY

    @classmethod
    @never_compiled(recursive=True)
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return run_op(func, args, kwargs or {})

    @never_compiled
    def __del__(self):
        # Cheaper than a weakref finalizer per tensor; at interpreter exit MEMORY may be gone.
        memory = MEMORY
        if memory is not None:
            memory.release(self.__dict__.get("_storage_key", 0))

    # Being a traceable wrapper subclass makes Module.to() swap tensors in place, as set_data does
    # for a CUDA move: the same Parameter object moves, so tied weights stay tied.
    def __tensor_flatten__(self):
        return ["_data"], self._index

    @staticmethod
    def __tensor_unflatten__(inner, index, outer_size, outer_stride):
        return wrap(inner["_data"], index)

    @property
    def data(self):
        with torch.no_grad():
            return self.detach()

    @data.setter
    def data(self, new):
        # Tensor.data = x copies only the C++ metadata; the CPU tensor behind it must follow.
        if not isinstance(new, SimTensor):
            raise RuntimeError(
                f"sim: cannot assign a tensor on {real_device(new)} as .data of a tensor on {real_device(self)}"
            )
        torch._C.TensorBase.data.__set__(self, new)
        self._data = new._data

    def __format__(self, spec: str) -> str:
        # Tensor.__format__ formats 0-dim values only for exact torch.Tensor; repr needs it here too.
        if self.dim() == 0 and not _traced(self._data):  # a traced one formats as its repr, as a FakeTensor does
            return self.detach().item().__format__(spec)
        return object.__format__(self, spec)

    def tolist(self):
        _counters.count_tolist(self)
        return self._data.tolist()

    def data_ptr(self) -> int:
        return self._data.data_ptr()

    def untyped_storage(self) -> torch.UntypedStorage:
        # The CPU storage holding the values, shared by views and aliases (.data, detach) as a device's storage is.
        # The wrapper's own storage has no data: copy.deepcopy of a module on sim crashed the process reading it.
        if DEVICE_MEMORY.on or _tracing():  # a GPU's answer: sim memory the host cannot read (not shared by views)
            # While torch.compile fakes a sim tensor it fakes `_data` too: one storage for both would make it
            # alias the two (meta_utils' set_ onto a meta storage, refused for a sim tensor).
            return torch.Tensor.untyped_storage(self)
        return self._data.untyped_storage()

    def numpy(self, *, force: bool = False):
        raise TypeError(
            f"can't convert {real_device(self)} device type tensor to numpy. "
            "Use Tensor.cpu() to copy the tensor to host memory first."
        )

    def __repr__(self, *, tensor_contents=None) -> str:  # type: ignore[override]  # Tensor.__repr__'s signature
        if torch.overrides.has_torch_function_unary(self):  # a TorchFunctionMode sees one __repr__ call
            return torch.overrides.handle_torch_function(  # type: ignore[call-arg]  # torch's stub takes no keywords
                SimTensor.__repr__, (self,), self, tensor_contents=tensor_contents)  # type: ignore[arg-type]  # nor this signature
        if _traced(self._data):  # no values to print (torch.compile's logs and errors print these)
            return f"tensor(..., device='{real_device(self)}', size={tuple(self.shape)}, dtype={self.dtype})"
        # PyTorch prefixes subclasses with their class name, and a parameter of one with "Parameter(": a device
        # tensor prints as tensor(...), a parameter as "Parameter containing:" and its tensor(...).
        text = torch._tensor_str._str(self, tensor_contents=tensor_contents)
        name = type(self).__name__
        parameter = text.startswith(f"Parameter({name}(")
        if parameter:
            text = text[len("Parameter("):-1]
        shown = "tensor(" + text[len(name) + 1:].replace("\n" + " " * (len(name) + 1), "\n" + " " * 7)
        return "Parameter containing:\n" + shown if parameter else shown

    def __reduce_ex__(self, proto):
        # Saved as PyTorch saves any storage-less PrivateUse1 tensor (a CPU copy and the device),
        # never as this class, so that weights_only loading and map_location="cpu" both work.
        return (
            torch._utils._rebuild_device_tensor_from_cpu_tensor,
            (self._data, self.dtype, str(real_device(self)), self.requires_grad),
        )


_tracing_context = torch._guards.TracingContext.try_get
_fake_mode_key = torch._C._TorchDispatchModeKey.FAKE


def _tracing() -> bool:
    """True while torch.compile (dynamo, AOTAutograd) traces, or a FakeTensorMode is active."""
    return _tracing_context() is not None or torch._C._get_dispatch_mode(_fake_mode_key) is not None


_UNVERSIONED_WRITES.sim_tensor_class = SimTensor  # the tensors an unversioned fault leaves unbumped


# Bound before the transfer wraps torch.Tensor._make_wrapper_subclass (device arguments shown as cuda): sim names
# its devices itself, on every op.
_make_wrapper_subclass = torch.Tensor._make_wrapper_subclass


def wrap(data: torch.Tensor, index: int) -> SimTensor:
    if data.layout is not torch.strided:
        return _wrap_unstrided(data, index)
    if data.is_nested:  # no sizes for a wrapper tensor to take: said, where PyTorch's own message is an internal error
        raise NotImplementedError(
            "sim: nested tensors are not supported on the sim device (nn.TransformerEncoder makes one in evaluation "
            "from src_key_padding_mask: build it with enable_nested_tensor=False to run it on sim)")
    if torch.is_inference_mode_enabled() and not data.is_inference():
        # a view of a normal tensor made in inference mode is a normal tensor, as the CPU's view ``data`` is: made
        # as an inference tensor, autograd refused to give it its base's version counter (every view failed)
        with torch.inference_mode(False):
            return wrap(data, index)
    tensor = _make_wrapper_subclass(
        SimTensor, data.size(), strides=data.stride(), storage_offset=data.storage_offset(),
        dtype=data.dtype, device=_DEVICES[index],
    )
    if data.is_conj():  # a conjugate or negative view says so, as a device's does (ifft's result, x.conj())
        torch._C._set_conj(tensor, True)
    if data.is_neg():
        torch._C._set_neg(tensor, True)
    tensor._data = data
    tensor._index = index
    MEMORY.track(tensor, data, index)
    return tensor


def _wrap_unstrided(data: torch.Tensor, index: int) -> SimTensor:
    """A sparse COO tensor: no strides nor storage of its own (its indices and values have theirs, which the device's
    memory statistics do not count). PyTorch's wrapper tensors take no compressed layout (CSR, CSC, BSR, BSC)."""
    if data.layout is not torch.sparse_coo:
        raise NotImplementedError(f"sim: tensors of layout {data.layout} are not supported on the sim device (the "
                                  "sparse COO layout is; convert with .to_sparse_coo())")
    tensor = _make_wrapper_subclass(SimTensor, data.size(), strides=data.stride(), dtype=data.dtype,
                                    device=_DEVICES[index], layout=data.layout)  # strides as the CPU's say: zeros
    tensor._data = data
    tensor._index = index
    tensor._storage_key = 0
    return tensor


def _sync_metadata(tensor: SimTensor) -> None:
    """After an op changed a tensor's sizes in place (t_, resize_, out= resizing), mirror them."""
    data = tensor._data
    if data.layout is not torch.strided:
        _sync_unstrided(tensor, data)
        return
    if (tensor.shape != data.shape or tensor.stride() != data.stride()
            or tensor.storage_offset() != data.storage_offset()):
        # The Meta kernel of set_ rewrites sizes/strides/offset of any TensorImpl, ours included.
        storage = torch.Tensor.untyped_storage(tensor)
        _set_metadata.redispatch(_META_KEYS, tensor, storage, data.storage_offset(), data.shape, data.stride())
        MEMORY.release(tensor.__dict__.get("_storage_key", 0))
        MEMORY.track(tensor, data, tensor._index)


def _sync_unstrided(tensor: SimTensor, data: torch.Tensor) -> None:
    """A sparse tensor written in place (a second backward's gradient accumulated into an ``Embedding(sparse=True)``'s,
    ``sparse_resize_``): its values and indices are its CPU tensor's, changed with it; only its sizes are mirrored.
    It has no strides nor storage of its own (``_wrap_unstrided``): none to compare, no memory to count again."""
    if tensor.shape != data.shape or tensor.stride() != data.stride():
        storage = torch.Tensor.untyped_storage(tensor)  # the wrapper's own, empty: the Meta kernel of set_ takes it
        _set_metadata.redispatch(_META_KEYS, tensor, storage, 0, data.shape, data.stride())


class _OpInfo:
    """What run_op needs to know of an op, computed once from its schema."""

    __slots__ = ("name", "mutated_args", "mutated_kwargs", "is_view", "mixed_ok", "launches", "decomposed",
                 "cpu_arguments", "cpu_result")

    def __init__(self, func) -> None:
        schema = func._schema
        self.name = schema.name
        self.mixed_ok = schema.name in _MIXED_DEVICE_OK
        names = _CPU_ARGUMENTS.get(schema.name, ())
        # (position, name) of the arguments that may be CPU tensors (empty: none may)
        self.cpu_arguments = tuple((i, a.name) for i, a in enumerate(schema.arguments) if a.name in names)
        self.cpu_result: int | None = _CPU_RESULTS.get(schema.name)  # the position of a result left on the CPU
        # Tensor.to reaches the device only under inference mode (elsewhere autograd's key decomposes it first): its
        # device is positional, and run as one kernel its host result was wrapped as a sim tensor. Run as torch
        # defines it, its _to_copy says where the result goes.
        self.decomposed = schema.name in _DECOMPOSED
        self.mutated_args: list = []  # positions
        self.mutated_kwargs: list = []  # names
        for position, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                (self.mutated_kwargs if arg.kwarg_only else self.mutated_args).append(
                    arg.name if arg.kwarg_only else position
                )
        self.is_view = any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns) or \
            schema.name in _UNANNOTATED_VIEWS
        self.launches = _counters.launches_kernel(schema.name, self.is_view)


_INFO: dict = {}
# Views whose schema does not say so (their outputs share the input's storage, with a version counter of their own):
# no kernel computes them (none is launched, none counted) and no fault poisons them: poisoned, the input behind them
# changed too, and a matmul's reshaped operands (_unsafe_view) turned nan before the tool's reference read them
_UNANNOTATED_VIEWS = frozenset({"aten::unsafe_split", "aten::unsafe_split_with_sizes", "aten::_unsafe_view"})


class _Unwrapped:
    """Arguments with sim tensors swapped for their CPU tensors, and what was seen on the way."""

    __slots__ = ("sim_index", "other_device", "pairs", "copy_back", "views_with_bits")

    def __init__(self) -> None:
        self.views_with_bits = False  # a conjugate or negative view among the CPU tensors (x.conj(), _neg_view)
        self.sim_index = None
        self.other_device = None  # a CPU tensor of dim > 0, or another sim device, seen beside sim tensors
        self.pairs: list = []  # (CPU tensor handed to the kernel, the caller's tensor it stands for)
        self.copy_back: list | None = None  # (CPU copy handed to the kernel, the traced sim tensor it stands for)

    def value(self, x):
        cls = type(x)
        if cls is SimTensor or (cls is not torch.Tensor and isinstance(x, SimTensor)):
            index = x._index
            if self.sim_index is None:
                self.sim_index = index
            elif index != self.sim_index:
                self.other_device = f"sim:{index}"
            data = x._data
            if data.is_conj() or data.is_neg():
                self.views_with_bits = True
            self.pairs.append((data, x))
            return data
        if cls is torch.Tensor or isinstance(x, torch.Tensor):
            if x.dim() and x.is_cpu:  # not Tensor.device, which DITORCH_SHOW_DEVICE_AS_CUDA may patch
                self.other_device = "cpu"
            elif cls is not torch.Tensor and real_device(x).type == "sim":
                return self.traced_factory_output(x)
            self.pairs.append((x, x))
            return x
        if cls is list or cls is tuple:
            return cls(self.value(v) for v in x)
        if cls is torch.device and x.type == "sim":
            return _CPU
        return x

    def traced_factory_output(self, x):
        """While torch.compile traces, a factory on sim (``torch.arange(n, device=idx.device)``) makes a fake
        tensor on sim, not a SimTensor: FakeTensorMode answers it before the PrivateUse1 fallback. Beside a
        SimTensor, whose fake holds a CPU fake, it stands for a sim tensor: the kernel takes its CPU copy (a
        ``_to_copy`` in the graph), and an op writing to it writes back (``copy_back``)."""
        if self.sim_index is None:
            self.sim_index = real_device(x).index or 0
        data = x.to(_CPU)
        if self.copy_back is None:  # made here only: every op builds an _Unwrapped
            self.copy_back = []
        self.copy_back.append((data, x))
        self.pairs.append((data, x))
        return data

    def dtypes(self, kwargs: dict) -> set:
        found = {tensor.dtype for _, tensor in self.pairs}
        if kwargs.get("dtype") is not None:
            found.add(kwargs["dtype"])
        return found


def _target_index(kwargs: dict, unwrapped: _Unwrapped):
    """The sim device index outputs go to, or None when they stay where the op put them."""
    device = kwargs.get("device")
    if device is not None:
        device = torch.device(device)
        if device.type != "sim":
            return None
        return DeviceSelection.check(device.index) if device.index is not None else DeviceSelection.current()
    if unwrapped.sim_index is not None:
        return unwrapped.sim_index
    return DeviceSelection.current()


_modes_on = torch._C._is_torch_function_mode_enabled
_no_torch_function = torch._C.DisableTorchFunction
# Dynamo's frame hook (what torch._dynamo.disable turns off), where this torch has one.
_set_eval_frame = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
_set_eval_frame = getattr(_set_eval_frame, "set_eval_frame", None)


def run_op(func, args, kwargs):
    """Run the aten op ``func`` as the sim device does. Its kernels' own torch calls are the device's work, not the
    program's: a ``TorchFunctionMode`` (an op_tools tool) must not see them, as it sees no CUDA kernel's, and dynamo
    must not compile them (after a graph break, a compiled region's eager code runs ops through here, and dynamo
    would trace sim's own Python as the program's)."""
    prior = _set_eval_frame(None) if _set_eval_frame is not None else None
    try:
        if _modes_on():
            with _no_torch_function():
                return _run_op(func, args, kwargs)
        return _run_op(func, args, kwargs)
    finally:
        if prior is not None:
            _set_eval_frame(prior)


def _cpu_only_where_allowed(info: _OpInfo, args: tuple, kwargs: dict) -> bool:
    """Whether every CPU tensor of dim > 0 among a call's arguments is one ``info.cpu_arguments`` names."""
    allowed = {position for position, _ in info.cpu_arguments}
    names = {name for _, name in info.cpu_arguments}
    others = [a for i, a in enumerate(args) if i not in allowed] + [v for k, v in kwargs.items() if k not in names]
    return not any(type(t) is torch.Tensor and t.dim() and t.is_cpu
                   for a in others for t in (a if isinstance(a, (list, tuple)) else (a,)))


def _run_op(func, args, kwargs):
    info = _INFO.get(func)
    if info is None:
        info = _INFO[func] = _OpInfo(func)
    if info.decomposed:
        return func.decompose(*args, **kwargs)
    unwrapped = _Unwrapped()
    value = unwrapped.value
    cpu_args = [value(a) for a in args]
    cpu_kwargs = {k: value(v) for k, v in kwargs.items()} if kwargs else kwargs
    if unwrapped.other_device is not None and unwrapped.sim_index is not None and not info.mixed_ok and not (
            unwrapped.other_device == "cpu" and info.cpu_arguments and _cpu_only_where_allowed(info, args, kwargs)):
        raise RuntimeError(
            "Expected all tensors to be on the same device, but found at least two devices, "
            f"sim:{unwrapped.sim_index} and {unwrapped.other_device}!"
        )
    index = _target_index(kwargs, unwrapped) if kwargs else (
        unwrapped.sim_index if unwrapped.sim_index is not None else DeviceSelection.current())
    active_faults = ()
    if _faults.TABLE.active:
        active_faults = _faults.TABLE.for_op(func)
        if active_faults:
            dtypes = unwrapped.dtypes(kwargs)
            _faults.TABLE.before(func, active_faults, dtypes, () if info.is_view else cpu_args)  # a view: no kernel
    kernel = _KERNELS.get(func, func)  # the device's own kernel, or the CPU's
    try:
        if unwrapped.views_with_bits:
            with _bit_fallbacks():
                out = kernel(*cpu_args, **cpu_kwargs)
        else:
            out = kernel(*cpu_args, **cpu_kwargs)
    except RuntimeError as error:
        # past the host's memory, so past the device's: a GPU's error, not the host allocator's
        device_error = MEMORY.host_out_of_memory(error, index) if index is not None else None
        if device_error is None:
            raise
        raise device_error from None
    _counters.charge(info.name, info.launches, _is_sim, args, kwargs, out)  # what a real device would charge
    if active_faults and out is None and (info.mutated_args or info.mutated_kwargs):
        # an in-place foreach op (an optimizer's) returns nothing: what it wrote is its output
        _faults.TABLE.after(active_faults, dtypes, _flat_tensors(
            [cpu_args[p] for p in info.mutated_args if p < len(cpu_args)] +
            [cpu_kwargs.get(n) for n in info.mutated_kwargs]))

    if unwrapped.copy_back and (info.mutated_args or info.mutated_kwargs):
        _write_back(unwrapped.copy_back, info, args, kwargs)
    if info.mutated_args:
        for position in info.mutated_args:
            if position < len(args):
                _sync_if_sim(args[position])
    if info.mutated_kwargs:
        for name in info.mutated_kwargs:
            _sync_if_sim(kwargs.get(name))
    if active_faults and not info.is_view:
        _faults.TABLE.after(active_faults, dtypes, _flat_tensors(out))
    if index is None:
        return out
    if info.cpu_result is not None:  # that result stays a CPU tensor, as the device's kernel returns it
        return tuple(o if i == info.cpu_result else _wrap_outputs(o, unwrapped.pairs, index) for i, o in enumerate(out))
    return _wrap_outputs(out, unwrapped.pairs, index)


_BIT_KEYS = (torch._C.DispatchKey.Conjugate, torch._C.DispatchKey.Negative)


@contextlib.contextmanager
def _bit_fallbacks():
    """The CPU's conjugate and negative fallbacks, which resolve a view's bit before a kernel reads it (or write
    through it), on for the kernel: __torch_dispatch__ runs with the keys above Python excluded, theirs among them,
    and a kernel would read a conjugate view's memory as it lies (torch.exp(x.conj()) giving exp(x))."""
    excluded = [torch._C._dispatch_tls_is_dispatch_key_excluded(key) for key in _BIT_KEYS]
    for key in _BIT_KEYS:
        torch._C._dispatch_tls_set_dispatch_key_excluded(key, False)
    try:
        yield
    finally:
        for key, was in zip(_BIT_KEYS, excluded):
            torch._C._dispatch_tls_set_dispatch_key_excluded(key, was)


def _write_back(copies, info: _OpInfo, args, kwargs) -> None:
    """An op wrote to the CPU copy of a traced tensor on sim (``_Unwrapped.traced_factory_output``): so does the
    tensor."""
    written = [args[p] for p in info.mutated_args if p < len(args)] + [kwargs.get(n) for n in info.mutated_kwargs]
    for data, traced in copies:
        if any(traced is w for w in written):
            traced.copy_(data)


def _is_sim(x) -> bool:
    return isinstance(x, SimTensor)


def _sync_if_sim(x) -> None:
    if isinstance(x, SimTensor):
        _sync_metadata(x)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _sync_if_sim(v)


def _flat_tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _flat_tensors(o)]
    return []


def _wrap_outputs(out, pairs, index):
    if isinstance(out, torch.Tensor):
        for data, tensor in pairs:
            if out is data:  # in-place or out=: hand back the caller's own tensor
                return tensor
        return wrap(out, index) if out.is_cpu else out
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap_outputs(o, pairs, index) for o in out)
    return out


def set_device_count(count: int) -> None:
    DeviceSelection.count = count
    _DEVICES[:] = [torch.device("sim", i) for i in range(count)]
