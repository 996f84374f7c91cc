"""The generic CUDA-to-device transfer: CUDA idioms in a script address the backend's device instead.

One table (``ROWS``) says which torch attributes are rewritten and how; ``apply`` wraps each of
them through a ``Patches`` record, so ``ditorch.deactivate()`` puts every original back. Device
arguments are rewritten at the Python boundary (``"cuda:1"`` becomes ``"sim:1"``): no global
``__torch_function__`` mode, so an op that takes no device argument costs nothing extra.

>>> import torch, ditorch                       # doctest: +SKIP  (DITORCH_BACKEND=sim)
>>> torch.ones(2, device="cuda").cpu()          # doctest: +SKIP
tensor([1., 1.])
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import threading
from typing import Callable

import torch

from . import after_import, cuda_api, distributed_adapters, host_rng, pinned_memory
from .class_forwarding import forwarding_class
from .compile import compile_prepare, fallback_backend, with_fallback
from .patches import Patches
from .show_as_cuda import real_device

logger = logging.getLogger("ditorch")

_DEVICE_KEYWORDS = ("device", "device_type")


class DeviceMap:
    """Rewrites CUDA device designations (``"cuda"``, ``"cuda:N"``, ``torch.device("cuda", N)``) to ``target``."""

    def __init__(self, target: str, device_module=None) -> None:
        self.target = target
        self.device_module = device_module
        self._strings: dict[str, str] = {"cuda": target}
        self._indexed = target != "cpu"  # the host is one device: "cuda:1" means "cpu" there

    def __call__(self, value):
        cls = type(value)  # not value.__class__: torch 2.11's dynamo, tracing this, answers it wrongly for a device
        if cls is str:
            mapped = self._strings.get(value)
            if mapped is not None:
                return mapped
            if value.startswith("cuda:"):
                mapped = self._strings[value] = self.target + value[4:] if self._indexed else self.target
                return mapped
        elif cls is torch.device and value.type == "cuda":
            return torch.device(self.target, value.index if self._indexed else None)
        return value

    def device_keyword(self, fn: Callable) -> Callable:
        """``fn`` with its ``device=`` keyword rewritten (factories take the device by keyword only)."""

        remap = self

        @functools.wraps(fn)
        def with_device_keyword(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = remap(kwargs["device"])
            return fn(*args, **kwargs)

        return with_device_keyword

    def device_anywhere(self, fn: Callable) -> Callable:
        """``fn`` with device strings and devices rewritten wherever they appear, positional or keyword."""
        remap = self

        device_class = torch.device

        @functools.wraps(fn)
        def with_device_arguments(*args, **kwargs):
            for arg in args:
                cls = type(arg)
                if cls is str or cls is device_class:
                    args = tuple(map(remap, args))  # DeviceMap leaves anything else as it is
                    break
            if kwargs:
                for key in _DEVICE_KEYWORDS:
                    if key in kwargs:
                        kwargs[key] = remap(kwargs[key])
            return fn(*args, **kwargs)

        return with_device_arguments

    def device_module_arguments(self, fn: Callable) -> Callable:
        """``fn`` of the device module answering ``torch.cuda.<name>``, with device arguments rewritten. On the host,
        which has one device but an ordinal per local rank (``set_device(local_rank)``), a CUDA device becomes its
        ordinal (``"cuda:1"`` is 1, ``"cuda"`` the current one), which the host module takes as CUDA's do."""
        if self._indexed:
            return self.device_anywhere(fn)

        def ordinal(value):
            if type(value) is str and (value == "cuda" or value.startswith("cuda:")):
                value = torch.device(value)
            if type(value) is torch.device and value.type == "cuda":
                return value.index
            return value

        @functools.wraps(fn)
        def with_ordinals(*args, **kwargs):
            args = tuple(map(ordinal, args))
            if "device" in kwargs:
                kwargs["device"] = ordinal(kwargs["device"])
            return fn(*args, **kwargs)

        return with_ordinals

    def ordinal(self, device) -> str | torch.device:
        """What ``Tensor.cuda(device)`` means: ``None`` the current device, an int that ordinal."""
        if isinstance(device, int) and self._indexed:
            return torch.device(self.target, device)
        if device is None or isinstance(device, int):
            index = self.device_module.current_device() if self._indexed else None
            return torch.device(self.target, index)  # type: ignore[arg-type]  # None: no index (the stub says int)
        return self(device)


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the transfer: the attributes ``names`` of ``owner`` are replaced by ``wrap(original, ctx)``."""

    owner: str
    names: tuple[str, ...]
    wrap: Callable
    what: str  # for the docs and for log lines
    when_imported: bool = False  # patched once the script imports ``owner`` (too heavy for `import ditorch`)

    @property
    def module(self) -> str:
        """The module ``owner`` is, or is in: its parts before the first class name (capitalised)."""
        parts = self.owner.split(".")
        classes = [i for i, part in enumerate(parts) if part[:1].isupper()]
        return ".".join(parts[:classes[0]] if classes else parts)


@dataclasses.dataclass(frozen=True)
class Context:
    backend: object
    remap: DeviceMap
    shows_as_cuda: bool = False
    live: threading.Event = dataclasses.field(default_factory=threading.Event)  # cleared when the transfer is undone


def _keyword(fn, ctx):
    if getattr(ctx.backend.adapter, "PINS_BY_COPY", False):  # pin_memory=True would reach an allocator it lacks
        fn = pinned_memory.pinned_by_copy(fn)
    return ctx.remap.device_keyword(fn)


def _anywhere(fn, ctx):
    return ctx.remap.device_anywhere(fn)


# Autocast state functions whose form without a device means CUDA's state in PyTorch: each is answered by the
# device form, for the backend's device: (the device form in torch._C, its CUDA form's argument count).
_AUTOCAST_CUDA_FORMS = {
    "is_autocast_enabled": ("is_autocast_enabled", 0),
    "set_autocast_enabled": ("set_autocast_enabled", 1),
    "get_autocast_gpu_dtype": ("get_autocast_dtype", 0),  # deprecated since torch 2.4, still called
    "set_autocast_gpu_dtype": ("set_autocast_dtype", 1),
}


def _autocast_state(fn, ctx):
    device_form_name, cuda_form_arity = _AUTOCAST_CUDA_FORMS[fn.__name__]
    with_devices = ctx.remap.device_anywhere(fn)
    if not hasattr(torch._C, "get_autocast_dtype"):
        return with_devices  # torch before 2.4: no device forms; the device module has its own autocast state
    device_form, target = getattr(torch._C, device_form_name), ctx.remap.target

    @functools.wraps(fn)
    def autocast_state(*args, **kwargs):
        # nn.MultiheadAttention's fast path asks torch.is_autocast_enabled(): under torch.autocast("cuda") it is True
        if len(args) + len(kwargs) == cuda_form_arity:
            return device_form(target, *args, **kwargs)
        return with_devices(*args, **kwargs)

    return autocast_state


def _static_anywhere(fn, ctx):
    # A classmethod, bound to its class: kept unbound on lookup from the class or an instance.
    return staticmethod(ctx.remap.device_anywhere(fn))


def _record_stream(fn, ctx):
    stream_class = torch.Stream

    @functools.wraps(fn)
    def record_stream(self, stream):
        if not isinstance(stream, stream_class):
            return None  # a device module's own Python stream (sim, the host): work is done when an op returns
        return fn(self, stream)

    return record_stream


def _tensor_cuda(fn, ctx):
    ordinal = ctx.remap.ordinal

    def cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        return self.to(ordinal(device), non_blocking=non_blocking, memory_format=memory_format)

    cuda.__doc__ = fn.__doc__
    return cuda


def _tensor_type(fn, ctx):
    """``Tensor.type``: a CUDA legacy type (``"torch.cuda.HalfTensor"``, ``torch.cuda.HalfTensor``) converts to the
    backend's (``torch.npu.HalfTensor``; the host's ``torch.HalfTensor``); where tensors show as cuda, a device
    tensor's own type reads as CUDA's (``torch.cuda.FloatTensor``), as its ``device`` does: an apex-era script's
    ``x.type() == "torch.cuda.HalfTensor"`` takes the branch it takes on CUDA."""
    target = ctx.remap.target
    prefix = "torch." if target == "cpu" else f"torch.{target}."
    legacy = type(torch.FloatTensor)  # torch.tensortype: the legacy types' metaclass

    def as_backend(dtype):
        if isinstance(dtype, legacy):  # torch.cuda.HalfTensor, torch.cuda.sparse.FloatTensor: their names
            dtype = f"{dtype.__module__}.{dtype.__name__}"
        if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
            return prefix + dtype[len("torch.cuda."):]
        return dtype

    @functools.wraps(fn)
    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is not None:
            return fn(self, as_backend(dtype), non_blocking, **kwargs)
        name = fn(self)
        if ctx.shows_as_cuda and name.startswith(prefix) and real_device(self).type == target:
            return "torch.cuda." + name[len(prefix):]
        return name

    return type_


def _storage_cuda(fn, ctx):
    ordinal = ctx.remap.ordinal

    def cuda(self, device=None, non_blocking=False):
        return self.to(device=ordinal(device), non_blocking=non_blocking)

    cuda.__doc__ = fn.__doc__
    return cuda


def _device_class(cls, ctx):
    """``torch.Stream`` or ``torch.Event`` taking a CUDA device (``device="cuda"``, a tensor's ``device`` shown as
    cuda) as the backend's. A subclass, not a forwarding class: torch subclasses them after import (dynamo's
    ``CpuInterface.Event``); ``isinstance`` still answers for the streams and events C++ makes. Calling it makes an
    instance of the class itself, not of the stand-in: C++ takes only that type's own instances as another argument
    (``Event.elapsed_time(other)`` refused a stand-in's "expected other to be a torch.Event object")."""
    remap = ctx.remap

    class StandInMeta(type(cls)):
        def __instancecheck__(self, instance) -> bool:
            return isinstance(instance, cls) if self is stand_in else type.__instancecheck__(self, instance)

        def __subclasscheck__(self, subclass) -> bool:
            return issubclass(subclass, cls) if self is stand_in else type.__subclasscheck__(self, subclass)

    def __new__(klass, *args, **kwargs):  # noqa: N807
        if args:
            args = (remap(args[0]), *args[1:])
        if "device" in kwargs:
            kwargs["device"] = remap(kwargs["device"])
        return cls(*args, **kwargs) if klass is stand_in else cls.__new__(klass, *args, **kwargs)

    stand_in = StandInMeta(cls.__name__, (cls,), {"__new__": __new__, "__doc__": cls.__doc__,
                                                  "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return stand_in


def _is_cuda(fn, ctx):
    target = ctx.remap.target
    return property(lambda self: real_device(self).type == target, doc="True for tensors on the backend's device.")


def _traced_is_cuda(fn, ctx):
    target = ctx.remap.target

    @functools.wraps(fn)
    def method_attr_is_cuda(self, tx):
        # Dynamo answers `x.is_cuda` from the traced tensor's real device, not through the property above: compiled
        # code would take the branch eager code does not. Guards on the tensor's device keep the answer valid.
        if self.device is not None and self.device.type == target and ctx.live.is_set():
            from torch._dynamo.variables.constant import ConstantVariable  # loaded by now: dynamo is tracing

            return ConstantVariable.create(True)
        return fn(self, tx)

    return method_attr_is_cuda


def _cudnn_is_acceptable(fn, ctx):
    target = ctx.remap.target

    @functools.wraps(fn)
    def is_acceptable(tensor: torch.Tensor) -> bool:
        # An RNN asks before it flattens its weights; a tensor shown as cuda would reach the check's warning that
        # this torch "was compiled without cuDNN/MIOpen support", where a CUDA run finds cuDNN and says nothing.
        if real_device(tensor).type == target:
            return False
        return fn(tensor)

    return is_acceptable


def _load(fn, ctx):
    remap = ctx.remap
    count = remap.device_module.device_count()
    # A checkpoint saved on CUDA names its storages "cuda:N": without a map_location they land here.
    default = {"cuda": remap.target, **{f"cuda:{i}": f"{remap.target}:{i}" for i in range(count)}}

    def device_keys(location: dict) -> dict:
        # The DDP tutorial's {"cuda:0": f"cuda:{rank}"}: storages saved from the device are tagged with its own name
        # ("npu:0", "sim:0"), the device the script saw as cuda:0. The key as written still matches a CUDA checkpoint.
        if remap.target == "cpu":  # every key would become "cpu"; the host saves as "cpu" whatever they say
            return {}
        return {remap(key): remap(value) for key, value in location.items()
                if isinstance(key, str) and remap(key) != key}

    def remap_location(location):
        if location is None:
            return default
        if isinstance(location, dict):  # locations it leaves out load where they were saved, as on CUDA
            return {**default, **device_keys(location), **{key: remap(value) for key, value in location.items()}}
        return remap(location)

    @functools.wraps(fn)
    def load(f, map_location=None, *args, **kwargs):
        return fn(f, remap_location(map_location), *args, **kwargs)

    return load


def _get_device_module(fn, ctx):
    remap, module = ctx.remap, ctx.backend.device_module

    @functools.wraps(fn)
    def get_device_module(device=None):
        if device is not None and remap(device) is not device:
            return module  # "cuda" means the backend's device: its module answers (the host's is not torch.cpu)
        return fn(device)

    return get_device_module


def _accelerator_is_available(fn, ctx):
    device_type, module = ctx.backend.device_type, ctx.backend.device_module
    accelerator = torch._C._accelerator_getAccelerator()
    # The compiled-in accelerator may not be the transfer's device (the host forced on a CUDA build):
    # torch.accelerator then speaks of that accelerator, so it is answered by that accelerator's own
    # check, taken now, before the transfer points torch.cuda at the backend's module.
    own_check = None
    if accelerator is not None and accelerator.type != device_type:
        own_check = getattr(getattr(torch, accelerator.type, None), "is_available", None)

    @functools.wraps(fn)
    def is_available() -> bool:
        if accelerator is None:
            return False
        if accelerator.type == device_type:
            return module.is_available()
        return bool(own_check()) if own_check is not None else fn()

    return is_available


def _accelerator_index(fn, ctx):
    device_type, module = ctx.backend.device_type, ctx.backend.device_module
    accelerator = torch._C._accelerator_getAccelerator()
    if accelerator is None or accelerator.type != device_type:
        return fn  # torch.accelerator speaks of another device (the host forced on a CUDA build): its own index

    def set_index(index: int) -> None:
        if index >= 0:  # negative: a no-op, as torch.accelerator.set_device_index documents
            module.set_device(index)

    def exchange(index: int) -> int:
        previous = module.current_device()
        module.set_device(index)
        return previous

    def maybe_exchange(index: int) -> int:
        previous = module.current_device()
        if 0 <= index < module.device_count():  # device_index's exit hands back -1 when it never exchanged
            module.set_device(index)
        return previous

    # C++ asks a device guard for the index, and a backend written in Python (sim) has one fixed at 0: the index
    # torch.accelerator sets and reads is the device module's, the one torch.cuda.set_device sets.
    answers = {"_accelerator_getDeviceIndex": module.current_device, "_accelerator_setDeviceIndex": set_index,
               "_accelerator_exchangeDevice": exchange, "_accelerator_maybeExchangeDevice": maybe_exchange}
    return functools.wraps(fn)(answers[fn.__name__])


def _grad_scaler_init(fn, ctx):
    remap = ctx.remap

    @functools.wraps(fn)
    def __init__(self, device="cuda", *args, **kwargs):  # noqa: N807 - replaces GradScaler.__init__
        fn(self, remap(device), *args, **kwargs)

    return __init__


def _generator(cls, ctx):
    remap = ctx.remap
    # A backend drawing from the host's generator (the sim device) gets host generators.
    generator_device = getattr(ctx.backend.adapter, "GENERATOR_DEVICE", None)

    def build(device="cpu"):
        device = remap(device)
        if generator_device is not None and torch.device(device).type == remap.target:
            device = generator_device
        return cls(device)

    return forwarding_class("Generator", cls, build)


def _ccl_name(backend: str | None, ccl: str, remap: DeviceMap) -> str | None:
    if not isinstance(backend, str):
        return backend
    parts = []
    for part in backend.split(","):
        device, _, name = part.rpartition(":")
        name = ccl if name.lower() == "nccl" else name
        parts.append(f"{remap(device)}:{name}" if device else name)
    return ",".join(parts)


def _process_group(fn, ctx):
    remap, ccl = ctx.remap, ctx.backend.ccl
    backend_is_first = fn.__name__ == "init_process_group"  # new_group takes it third, by keyword in practice

    @functools.wraps(fn)
    def with_backend(*args, **kwargs):
        if backend_is_first and args:
            args = (_ccl_name(args[0], ccl, remap), *args[1:])
        if "backend" in kwargs:
            kwargs["backend"] = _ccl_name(kwargs["backend"], ccl, remap)
        if "device_id" in kwargs:
            kwargs["device_id"] = remap(kwargs["device_id"])
            if remap.target == "cpu":  # the host is no accelerator: gloo binds no device, and c10d refuses a CPU one
                kwargs["device_id"] = None
        return fn(*args, **kwargs)

    return with_backend


def _device_as_shown(ctx) -> Callable:
    """``device`` as tensors show it: a device of the backend's type (``sim:1``; on the host ``cpu``, every tensor
    there showing the current ordinal) is ``cuda`` of that index, or of the current one."""
    target, module = ctx.remap.target, ctx.backend.device_module

    def as_shown(device):
        if not (ctx.live.is_set() and isinstance(device, torch.device) and device.type == target):
            return device
        index = device.index if device.index is not None and target != "cpu" else module.current_device()
        return torch.device("cuda", index)

    return as_shown


def _fsdp_device(fn, ctx):
    # FSDP2 takes its device from the mesh's type, the accelerator's by default (sim:N), while the parameters a
    # CUDA script moved show cuda:N: "Expects the parameter to already be moved to device sim:0 but got cuda:0".
    if not ctx.shows_as_cuda:
        return fn
    as_shown = _device_as_shown(ctx)

    @functools.wraps(fn)
    def device_from_mesh(*args, **kwargs):
        return as_shown(fn(*args, **kwargs))

    return device_from_mesh


def _fsdp_device_id(fn, ctx):
    # FSDP1 reads an ordinal device_id (torch.cuda.current_device()) as the accelerator's device (sim:N; on the
    # host, an error): a CUDA script means cuda:N, the device its parameters show.
    if not ctx.shows_as_cuda:
        return fn
    as_shown = _device_as_shown(ctx)

    @functools.wraps(fn)
    def device_from_device_id(device_id, *args, **kwargs):
        if isinstance(device_id, int) and ctx.live.is_set():
            device_id = torch.device("cuda", device_id)
        return as_shown(fn(device_id, *args, **kwargs))

    return device_from_device_id


def _fsdp_device_handle(fn, ctx):
    # As above, for the device module FSDP1 picks from device_id first (the host has no accelerator to read it by).
    if not ctx.shows_as_cuda:
        return fn

    @functools.wraps(fn)
    def init_device_handle(state, module, ignored_params, device_id):
        if isinstance(device_id, int) and ctx.live.is_set():
            device_id = torch.device("cuda", device_id)
        return fn(state, module, ignored_params, device_id)

    return init_device_handle


def _fsdp_compute_device(fn, ctx):
    # FSDP1's compute device is the parameters' (cuda:N, shown), else the accelerator's current one (sim:N); it
    # must equal device_id's, compared here as shown ("Inconsistent compute device and `device_id`").
    if not ctx.shows_as_cuda:
        return fn
    as_shown = _device_as_shown(ctx)

    @functools.wraps(fn)
    def compute_device(module, ignored_params, device_from_device_id, rank, device_handle):
        if not ctx.live.is_set():
            return fn(module, ignored_params, device_from_device_id, rank, device_handle)
        device = as_shown(fn(module, ignored_params, None, rank, device_handle))
        if device_from_device_id is not None and device != as_shown(device_from_device_id):
            raise ValueError(f"Inconsistent compute device and `device_id` on rank {rank}: "
                             f"{device} vs {device_from_device_id}")
        return device

    return compute_device


def _philox_state(cls, ctx):
    # DTensor's random ops read the device generator's state as CUDA's Philox (seed, offset) and move the offset
    # (torch/distributed/tensor/_random.py); a device drawing from the host's generator has a CPU-layout state.
    # A device module without get_rng_state (a vendor's stand-in) keeps DTensor's class: DTensor's random ops fail
    # there with or without ditorch, and an import of ditorch after DTensor's must not.
    if getattr(ctx.backend.device_module, "get_rng_state", None) is not host_rng.get_rng_state:
        return cls

    class PhiloxState(cls):
        """DTensor's view of a generator state; a CPU-layout one is read as ``host_rng.philox_state()``."""

        def __init__(self, state: torch.Tensor) -> None:
            if state.numel() != host_rng.PHILOX_STATE_BYTES and ctx.live.is_set():
                state = host_rng.philox_state()  # DTensor passes the device generator's: the host's, here
            super().__init__(state)

    PhiloxState.__qualname__ = PhiloxState.__name__ = cls.__name__
    return PhiloxState


def _compile(fn, ctx):
    adapter = ctx.backend.adapter
    fallback = fallback_backend(adapter)
    if fallback is None:
        return fn
    return with_fallback(fn, ctx.backend.name, fallback, compile_prepare(adapter))


def _profiler_init(fn, ctx):
    from torch.profiler import ProfilerActivity

    device_activity = getattr(ProfilerActivity, "PrivateUse1", None)
    supported = torch.profiler.supported_activities()
    replacement = device_activity if device_activity in supported else None

    @functools.wraps(fn)
    def __init__(self, *args, activities=None, use_cuda=None, **kwargs):  # noqa: N807
        if activities is not None:
            # CUDA activity means "the accelerator": profile the backend's device, or just the CPU.
            mapped = [replacement if a == ProfilerActivity.CUDA else a for a in activities]
            activities = list(dict.fromkeys(a for a in mapped if a is not None))
        fn(self, *args, activities=activities, **kwargs)

    return __init__


_FACTORIES = (
    "tensor", "as_tensor", "asarray", "empty", "empty_like", "empty_strided", "empty_permuted", "zeros",
    "zeros_like", "ones", "ones_like", "full", "full_like", "rand", "rand_like", "randn", "randn_like",
    "randint", "randint_like", "randperm", "arange", "range", "linspace", "logspace", "eye", "normal",
    "scalar_tensor", "tril_indices", "triu_indices", "sparse_coo_tensor", "sparse_csr_tensor",
    "bartlett_window", "blackman_window", "hamming_window", "hann_window", "kaiser_window", "from_file",
)

ROWS: tuple[Row, ...] = (
    Row("torch", _FACTORIES, _keyword, "factory functions: device=\"cuda\", \"cuda:N\", torch.device(\"cuda\")"),
    Row("torch.Tensor", ("new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full", "new_tensor"),
        _keyword, "Tensor.new_*(device=...)"),
    Row("torch.Tensor", ("to",), _anywhere, "Tensor.to(\"cuda\")"),
    Row("torch.Tensor", ("cuda",), _tensor_cuda, "Tensor.cuda(device=None)"),
    Row("torch.Tensor", ("is_cuda",), _is_cuda, "Tensor.is_cuda"),
    Row("torch.Tensor", ("type",), _tensor_type,
        "Tensor.type(\"torch.cuda.HalfTensor\"), Tensor.type(torch.cuda.HalfTensor); Tensor.type() reads "
        "torch.cuda.FloatTensor where tensors show as cuda"),
    Row("torch._dynamo.variables.tensor.TensorVariable", ("method_attr_is_cuda",), _traced_is_cuda,
        "Tensor.is_cuda inside torch.compile'd code (dynamo answers it from the real device)", when_imported=True),
    Row("torch.Tensor", ("_make_wrapper_subclass",), _static_anywhere,
        "tensor subclasses built on a device read from a tensor shown as cuda (DTensor, FSDP2 and tensor parallel)"),
    Row("torch.Tensor", ("record_stream",), _record_stream,
        "Tensor.record_stream(torch.cuda.Stream) with the device module's stream (FSDP1 frees its flat parameters)"),
    Row("torch.UntypedStorage", ("cuda",), _storage_cuda,
        "UntypedStorage.cuda(device=None), TypedStorage.cuda (torch.load's `map_location=lambda s, loc: s.cuda()`)"),
    Row("torch.UntypedStorage", ("_new_shared",), _static_anywhere,
        "shared-memory storages for DataLoader workers (`_new_shared(device=t.device)`, the device shown as cuda)"),
    Row("torch.nn.Module", ("to",), _anywhere, "Module.to(\"cuda\") (Module.cuda goes through Tensor.cuda)"),
    Row("torch.nn.Module", ("to_empty",), _keyword, "Module.to_empty(device=\"cuda\")"),
    Row("torch", ("load",), _load, "torch.load(map_location=\"cuda\"), and CUDA-saved checkpoints"),
    Row("torch.serialization", ("load",), _load, "torch.serialization.load, as torch.load"),
    Row("torch", ("Generator",), _generator, "torch.Generator(device=\"cuda\")"),
    Row("torch", ("set_default_device", "get_autocast_dtype", "set_autocast_dtype"), _anywhere,
        "torch.set_default_device(\"cuda\") and the autocast state queries for \"cuda\""),
    Row("torch", tuple(_AUTOCAST_CUDA_FORMS), _autocast_state,
        "the autocast state queries for \"cuda\" and without a device (CUDA's state in PyTorch): "
        "torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()"),
    Row("torch", ("Stream", "Event"), _device_class,
        "torch.Stream(device=\"cuda\"), torch.Event(device=x.device) (the device-generic classes, PyTorch >= 2.5)"),
    Row("torch", ("get_device_module",), _get_device_module,
        "torch.get_device_module(\"cuda\") is the backend's device module (fork_rng, checkpointing)"),
    Row("torch.accelerator", ("is_available",), _accelerator_is_available,
        "torch.accelerator.is_available() answers for the accelerator torch.accelerator speaks of"),
    Row("torch._C", ("_accelerator_getDeviceIndex", "_accelerator_setDeviceIndex", "_accelerator_exchangeDevice",
                     "_accelerator_maybeExchangeDevice"), _accelerator_index,
        "torch.accelerator.set_device_index, current_device_index and device_index(i) select the device "
        "torch.cuda.set_device selects"),
    Row("torch.accelerator", ("_get_device_index",), _anywhere,
        "torch.accelerator's device arguments: set_device_index(\"cuda:1\"), a device shown as cuda"),
    Row("torch.accelerator.memory", ("_get_device_index",), _anywhere, "as above, for torch.accelerator.memory_*"),
    Row("torch.amp", ("is_autocast_available",), _anywhere, "torch.amp.is_autocast_available(\"cuda\")"),
    Row("torch.nn.parallel._functions", ("_get_stream",), _anywhere,
        "DDP's copies of inputs to `device_ids[0]` (a device shown as cuda) take the backend's side stream"),
    Row("torch.utils._device.DeviceContext", ("__init__",), _anywhere, "with torch.device(\"cuda\"):"),
    Row("torch.amp.autocast_mode.autocast", ("__init__",), _anywhere,
        "torch.autocast(\"cuda\"), torch.cuda.amp.autocast"),
    Row("torch.amp.grad_scaler.GradScaler", ("__init__",), _grad_scaler_init,
        "torch.amp.GradScaler(\"cuda\"), torch.cuda.amp.GradScaler"),
    Row("torch.distributed", ("init_process_group", "new_group"), _process_group,
        "init_process_group(\"nccl\") uses the backend's collective library"),
    Row("torch.distributed.distributed_c10d", ("init_process_group", "new_group"), _process_group,
        "as above, for callers importing from distributed_c10d"),
    Row("torch.distributed.fsdp._fully_shard._fsdp_init", ("_get_device_from_mesh",), _fsdp_device,
        "FSDP2's device, from its mesh (the default mesh is the accelerator's), is cuda:N where tensors show as cuda",
        when_imported=True),
    Row("torch.distributed.fsdp._fully_shard._fully_shard", ("_get_device_from_mesh",), _fsdp_device,
        "as above, where fully_shard imported it by name", when_imported=True),
    Row("torch.distributed._composable.replicate_with_fsdp", ("_get_device_from_mesh",), _fsdp_device,
        "as above, for replicate", when_imported=True),
    Row("torch.distributed.fsdp._init_utils", ("_get_device_from_device_id",), _fsdp_device_id,
        "FSDP1's device_id=torch.cuda.current_device() is cuda:N where tensors show as cuda", when_imported=True),
    Row("torch.distributed.fsdp._init_utils", ("_init_device_handle",), _fsdp_device_handle,
        "FSDP1's device module, from device_id=torch.cuda.current_device(): cuda's where tensors show as cuda",
        when_imported=True),
    Row("torch.distributed.fsdp.fully_sharded_data_parallel", ("_init_device_handle",), _fsdp_device_handle,
        "as above, where FullyShardedDataParallel imported it by name", when_imported=True),
    Row("torch.distributed.fsdp._init_utils", ("_get_compute_device",), _fsdp_compute_device,
        "FSDP1's compute device, from the accelerator where the module is on the host, is cuda:N where tensors show "
        "as cuda", when_imported=True),
    Row("torch.distributed.tensor._random", ("_PhiloxState",), _philox_state,
        "DTensor's random ops (and meta-device init's reset_parameters under FSDP2) read the host generator's stream "
        "in CUDA's Philox layout (host_rng.philox_state), on sim and the host", when_imported=True),
    Row("torch.profiler.profile", ("__init__",), _profiler_init, "ProfilerActivity.CUDA profiles the device"),
    Row("torch.backends.cudnn", ("is_acceptable",), _cudnn_is_acceptable,
        "cuDNN's check of an RNN's tensors: the device's are not CUDA's (no cuDNN warning)"),
    Row("torch", ("compile",), _compile,
        "torch.compile's default (inductor) runs the adapter's COMPILE_FALLBACK where inductor cannot target the "
        "device (sim: \"aot_eager\"), said once on the `ditorch` logger"),
)


def _resolve(path: str):
    """``"torch.nn.Module"`` -> the class; the longest importable prefix is the module."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(path)


def _patch_row(row: Row, ctx: Context, patches: Patches, owner) -> None:
    for name in row.names:
        original = getattr(owner, name, None)
        if original is None:
            logger.debug("ditorch: %s.%s does not exist in this torch; not patched", row.owner, name)
            continue
        if getattr(original, "_ditorch_context", None) is ctx:
            continue  # imported by name from a module this transfer patched already (it does nothing once undone)
        wrapped = row.wrap(original, ctx)
        if row.when_imported and wrapped is not original:
            wrapped._ditorch_context = ctx
        patches.set(owner, name, wrapped)


def _patch_imported(row: Row, ctx: Context, patches: Patches, module) -> None:
    _patch_row(row, ctx, patches, module if row.owner == row.module else _resolve(row.owner))


def apply(backend, config, patches: Patches) -> None:
    """Rewrite every row of ``ROWS`` and map ``torch.cuda`` to the backend's device module."""
    ctx = Context(backend, DeviceMap(backend.device_type, backend.device_module), config.show_device_as_cuda)
    ctx.live.set()
    patches.on_undo(ctx.live.clear)  # a wrapper a module imported by name, and kept, does nothing more
    # `with torch.device(...)` recognises factories by identity in a cached set: fill it with the
    # originals before they are wrapped.
    importlib.import_module("torch.utils._device")._device_constructors()
    for row in ROWS:
        if row.owner.startswith("torch.distributed") and not torch.distributed.is_available():
            continue
        if row.when_imported:
            patch = functools.partial(_patch_imported, row, ctx, patches)
            patches.on_undo(after_import.when_imported(row.module, patch))
            continue
        try:
            owner = _resolve(row.owner)
        except (ImportError, AttributeError):
            logger.debug("ditorch: %s does not exist in this torch; not patched", row.owner)
            continue
        _patch_row(row, ctx, patches, owner)
    if getattr(backend.adapter, "PINS_BY_COPY", False):
        patches.on_undo(pinned_memory.hold())  # pin_memory() copies while the transfer is active
    cuda_api.apply(backend, ctx.remap, patches)
    distributed_adapters.apply(backend, patches)  # AVG and float32 reductions where the library lacks them
    if config.show_device_as_cuda:
        from . import show_as_cuda

        show_as_cuda.apply(backend, patches)
