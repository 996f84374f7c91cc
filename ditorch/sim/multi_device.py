"""What sim needs to offer more than one device, as a node with one accelerator per rank does.

PyTorch asks a Python backend's device guard (``torch._C._acc.DeviceGuard``) two things Python cannot override: its
``deviceCount()`` is 1 and its ``getDevice()`` is index 0. Two consequences, each corrected here:

- The autograd engine keeps one ready queue per device index, as many as ``deviceCount()``, so a backward node on
  ``sim:1`` fails the engine's ``INTERNAL ASSERT`` ("device_ready_queues_.size()"). ``SimEngine`` runs every backward
  with autograd multithreading off: each node runs on the calling thread's CPU ready queue. Sim computes
  synchronously on the host, so no device thread is lost.
- ``Tensor.to("sim")`` fills the missing index from ``getDevice()`` before any kernel runs, so it lands on ``sim:0``
  whatever ``torch.sim.set_device`` chose; so do the functions that copy host data to the device in C++
  (``torch.tensor``, ``as_tensor``, ``asarray``, ``Tensor.new_tensor``, the sparse constructors: ``_DATA_FACTORIES``).
  Each gives a bare sim device the current index first, as ``Tensor.to("cuda")`` does on CUDA (``Module.to`` goes
  through it).

With one sim device, backward runs on the engine's device thread, as on hardware, and ``to`` is PyTorch's; unless the
process ran a backward before sim was registered: the engine then has no queue for any sim device, and ``SimEngine``
runs backward on the calling thread as well (``engine_has_a_queue_for_sim``). ``SimEngine`` is installed in any case,
to raise a user's hook's exception from backward (``device_guard``).
"""

from __future__ import annotations

import functools
import importlib

import torch
from torch.autograd.variable import Variable

from . import device_guard
from .fault_injection import TABLE
from .tensor import MEMORY, DeviceSelection


class SimEngine:
    """PyTorch's autograd engine, through which a backward that a user's hook failed raises the hook's exception
    (``device_guard``); with ``on_calling_thread``, each backward runs on the calling thread."""

    def __init__(self, engine, on_calling_thread: bool = False) -> None:
        self.engine = engine
        self.on_calling_thread = on_calling_thread

    def run_backward(self, *args, **kwargs):
        try:
            if not self.on_calling_thread:
                return self.engine.run_backward(*args, **kwargs)
            with torch.autograd.set_multithreading_enabled(False):
                return self.engine.run_backward(*args, **kwargs)
        except SystemError:  # "returned NULL without setting an exception": the guard took it
            if not device_guard.TAKEN.errors:
                raise
        device_guard.raise_taken()  # outside the handler: the user's exception, not chained to the SystemError

    def __getattr__(self, name: str):  # queue_callback, is_checkpoint_valid, ...: the engine's own
        return getattr(self.engine, name)


def _indexed(device):
    """``device`` with the current sim index when it is a bare sim device (``"sim"``, ``torch.device("sim")``)."""
    cls = type(device)  # not device.__class__, which torch 2.11's dynamo answers wrongly for a device
    if (cls is str and device == "sim") or (cls is torch.device and device.type == "sim" and device.index is None):
        return torch.device("sim", DeviceSelection.current())
    return device


def _to_current_device(to):
    @functools.wraps(to)
    def to_current(self, *args, **kwargs):
        if args:
            args = (_indexed(args[0]), *args[1:])
        if "device" in kwargs:
            kwargs["device"] = _indexed(kwargs["device"])
        return to(self, *args, **kwargs)

    to_current._ditorch_sim_to = True  # installed once
    return to_current


# Functions that build a tensor from data on the host and copy it to the device in C++, which fills a bare device's
# index from the guard's ``getDevice()`` (0) as ``Tensor.to`` does; each takes ``device`` by keyword only.
_DATA_FACTORIES = ((torch, "tensor"), (torch, "as_tensor"), (torch, "asarray"), (torch.Tensor, "new_tensor"),
                   (torch, "sparse_coo_tensor"), (torch, "sparse_compressed_tensor"), (torch, "sparse_csr_tensor"),
                   (torch, "sparse_csc_tensor"), (torch, "sparse_bsr_tensor"), (torch, "sparse_bsc_tensor"))


def _device_on_current(factory):
    """``factory`` placing a bare sim device given as ``device=`` on the current one, as CUDA does."""
    @functools.wraps(factory)
    def on_current(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _indexed(kwargs["device"])
        return factory(*args, **kwargs)

    on_current._ditorch_sim_to = True  # installed once
    return on_current


def engine_has_a_queue_for_sim() -> bool:
    """Whether the autograd engine can run a node on ``sim:0``. It sizes its device queues once, at the first
    backward of the process: one that ran before sim was registered (a CPU reference run) left none for sim."""
    faults, initialized, peak = TABLE.current(), DeviceSelection.initialized, MEMORY.peak.get(0)
    TABLE.set([])  # the probe is sim's own op: no injected fault applies to it, and it initialises no device
    try:
        _backward_on_sim()
    except RuntimeError as error:
        if "device_ready_queues_" not in str(error):
            raise
        return False
    finally:
        TABLE.set(faults)
        DeviceSelection.initialized = initialized
        MEMORY.restore_peak(0, peak)  # nor does it count in the memory statistics: a fresh process peaks at 0
    return True


def _backward_on_sim() -> None:
    probe = torch.zeros((), device=torch.device("sim", 0), requires_grad=True)
    torch.autograd.grad(probe * 2, probe)


def install_engine(on_calling_thread: bool = False) -> None:
    """Route every backward (``Tensor.backward``, ``torch.autograd.grad``, from any thread) through ``SimEngine``;
    ``on_calling_thread``: on the calling thread from now on. Idempotent."""
    engine = Variable._execution_engine
    if isinstance(engine, SimEngine):
        engine.on_calling_thread = engine.on_calling_thread or on_calling_thread
    else:
        Variable._execution_engine = SimEngine(engine, on_calling_thread)  # type: ignore[assignment]  # a proxy


def install() -> None:
    """What more than one sim device needs: ``install_engine()``, and ``Tensor.to`` placing a bare sim device on
    the current one. Idempotent."""
    install_engine(on_calling_thread=True)
    if not getattr(torch.Tensor.to, "_ditorch_sim_to", False):
        torch.Tensor.to = _to_current_device(torch.Tensor.to)  # type: ignore[method-assign]  # sim's own placement
    # `with torch.device(...)` recognises factories by identity in a cached set: fill it with the originals before
    # they are wrapped (else a model built under `with torch.device("meta")` makes its torch.tensor buffers on the
    # host, and FSDP2's meta-device init reads uninitialised memory)
    importlib.import_module("torch.utils._device")._device_constructors()
    for owner, name in _DATA_FACTORIES:
        factory = getattr(owner, name, None)
        if factory is not None and not getattr(factory, "_ditorch_sim_to", False):
            setattr(owner, name, _device_on_current(factory))


def refuse_data_parallel() -> None:
    """``nn.DataParallel`` on sim devices raises a NotImplementedError saying what to use. Its scatter, broadcast
    and gather are CUDA's C functions (``torch._C._scatter``), absent beside sim, even over one device: its first
    forward would fail with a bare AttributeError. Idempotent."""
    data_parallel = torch.nn.parallel.DataParallel
    if not getattr(data_parallel.__init__, "_ditorch_sim_refuses", False):
        data_parallel.__init__ = _refused(data_parallel.__init__)  # type: ignore[method-assign]


def _refused(init):
    @functools.wraps(init)
    def __init__(self, module, device_ids=None, *args, **kwargs):  # noqa: N807 - replaces DataParallel.__init__
        init(self, module, device_ids, *args, **kwargs)
        if self.device_ids and not hasattr(torch._C, "_scatter"):  # a build with CUDA has them: it works there
            raise NotImplementedError(
                "sim: nn.DataParallel is not supported on the sim device (its scatter and gather are CUDA's C "
                "functions). Use DistributedDataParallel under torchrun, one process per device "
                "(torchrun --nproc_per_node=N script.py); on one device, the module itself.")

    __init__._ditorch_sim_refuses = True  # installed once
    return __init__
