"""The simulated accelerator ``sim``: a PyTorch PrivateUse1 backend that computes on the CPU.

It stands in for a vendor device in tests and demos: tensors report ``device='sim:0'``, every aten
op works on them with the CPU's exact numbers, and faults can be injected (see ``faults``).

>>> import torch, ditorch.sim
>>> ditorch.sim.register()
>>> (torch.ones(2, device="sim") * 3).cpu()
tensor([3., 3.])
"""

from __future__ import annotations

import contextlib
import logging
import threading

import torch as _torch

if _torch.torch_version.TorchVersion(_torch.__version__) < "2.10":
    raise ImportError(f"ditorch.sim needs PyTorch >= 2.10 (its Python PrivateUse1 backend hooks); this is torch "
                      f"{_torch.__version__}")

from .attention import SdpaAlgorithm, get_sdpa_algorithm, sdpa_algorithm, set_sdpa_algorithm  # noqa: F401
from .fault_injection import (  # noqa: F401 - public API
    Fault,
    SimUnsupportedError,
    clear_faults,
    faults,
    inject_fault,
    parse_faults,
    set_faults,
)

NAME = "sim"
COUNT_VAR = "DITORCH_SIM_DEVICE_COUNT"
_lock = threading.Lock()
_libraries: list = []


def is_registered() -> bool:
    return bool(_libraries)


def _read(name: str):
    from ..env import read  # declared with every other variable ditorch reads

    return read(name)


def register() -> None:
    """Make ``sim`` a PyTorch device (PrivateUse1 renamed), with ``torch.sim`` as its module.

    Idempotent. Reads ``DITORCH_SIM_DEVICE_COUNT`` (else torchrun's ``LOCAL_WORLD_SIZE``), ``DITORCH_SIM_FAULTS``,
    ``DITORCH_SIM_TF32``, ``DITORCH_SIM_SDPA``, ``DITORCH_SIM_NUMERICS``, ``DITORCH_SIM_DEVICE_MEMORY``,
    ``DITORCH_SIM_TOTAL_MEMORY`` and ``DITORCH_SIM_ASYNC``; raises
    ``ValueError`` naming the variable when one is malformed, and ``RuntimeError`` when PrivateUse1 already belongs
    to another backend.
    """
    with _lock:
        if _libraries:
            return
        import torch

        from .. import pinned_memory
        from ..env import local_world_size
        from . import (
            async_completion,
            attention,
            autocast,
            batch_norm_kernels,  # noqa: F401 - registers SyncBatchNorm's statistics kernels
            composites,
            ddp,
            device_guard,
            device_module,
            foreach_path,
            gpu_numerics,
            multi_device,
            rnn_kernels,  # noqa: F401 - registers the fused RNN cells' kernels
            serialization,
            set_data,
            tensor,
            tf32,
        )
        from .device_counters import note_pinned
        from .fault_injection import load_from_env
        from .kernels import REGISTERED_PER_OP

        count = _read(COUNT_VAR) or local_world_size()
        tf32_families, sdpa = _read(tf32.ENV_VAR), _read(attention.ENV_VAR)
        numerics_mode = _read(gpu_numerics.ENV_VAR)
        tensor.DEVICE_MEMORY.on = _read(tensor.DEVICE_MEMORY.ENV_VAR)
        tensor.MEMORY.total = _read(tensor.MEMORY.TOTAL_VAR) or tensor.host_memory()
        async_completion.LAG.kernels = _read(async_completion.ENV_VAR)
        load_from_env()
        _check_beside_cuda(torch)
        taken = torch._C._get_privateuse1_backend_name()
        if taken not in ("privateuseone", NAME):
            raise RuntimeError(f"sim: PrivateUse1 is already the backend {taken!r}; cannot register the sim device")
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        _setup_privateuseone_for_python_backend(NAME, backend_module=device_module,
                                                device_guard=device_guard.SimDeviceGuard())
        tensor.set_device_count(count)
        factories = torch.library.Library("_", "IMPL")
        factories.fallback(tensor.never_compiled(_fallback, recursive=True), "PrivateUse1")
        # Paths that call ops with the Python key excluded (torch.tensor(data, device=...) copies its CPU tensor to
        # the device so) must reach per-op kernels: PyTorch hands a Python kernel to its per-op registration
        # trampoline when an argument has the Python key or a dispatch mode is active (a FakeTensorMode, while
        # torch.compile traces), and finds no such registration for a fallback ("func != nullptr INTERNAL ASSERT
        # FAILED ... python_dispatch.cpp"). The copy allocates its result with empty_strided.
        per_op = torch.library.Library("aten", "IMPL")
        copies = [getattr(torch.ops.aten, name).default for name in ("_copy_from", "_copy_from_and_resize", "copy_")]
        allocations = [torch.ops.aten.empty_strided.default, torch.ops.aten.empty.memory_format]
        for op in copies + allocations + REGISTERED_PER_OP:  # and the ops sim has its own kernels for
            per_op.impl(op, _per_op(op), "PrivateUse1")
        _libraries.extend([factories, per_op, *autocast.register(NAME), *attention.meta_kernels(),
                           composites.register()])
        pinned_memory.hold(note_pinned)  # for good, as the device; copies into pinned tensors do not synchronise
        serialization.install()
        foreach_path.install()
        set_data.install()
        ddp.install()
        multi_device.refuse_data_parallel()
        tf32.configure(tf32_families)
        attention.SELECTED.set(sdpa)
        gpu_numerics.NUMERICS.set(numerics_mode)
        if count > 1:
            multi_device.install()
        else:  # a user's hook's exception raised from backward (device_guard); on the calling thread where needed
            multi_device.install_engine(on_calling_thread=not multi_device.engine_has_a_queue_for_sim())


@contextlib.contextmanager
def numerics(mode: str = "gpu"):
    """Within the block, sim sums as a GPU's reduction kernels do (``"gpu"``) or as the CPU's (``"cpu"``); for the
    whole run, ``DITORCH_SIM_NUMERICS=gpu`` (``ditorch/sim/gpu_numerics.py`` says which ops and in which order).

    >>> import torch, ditorch.sim
    >>> ditorch.sim.register()
    >>> with ditorch.sim.numerics("gpu"):
    ...     total = torch.ones(1000, device="sim").sum()
    """
    from .gpu_numerics import NUMERICS

    previous = NUMERICS.mode
    NUMERICS.set(mode)
    try:
        yield
    finally:
        NUMERICS.set(previous)


@contextlib.contextmanager
def device_memory(on: bool = True):
    """Within the block, sim tensors' ``untyped_storage()`` is sim memory that the host cannot read, as a GPU
    tensor's is (``DITORCH_SIM_DEVICE_MEMORY=1`` for the whole run): host-side code takes its device-memory branches.

    >>> import torch, ditorch.sim
    >>> ditorch.sim.register()
    >>> with ditorch.sim.device_memory():
    ...     torch.ones(2, device="sim").untyped_storage().device
    device(type='sim', index=0)
    """
    from .tensor import DEVICE_MEMORY

    previous, DEVICE_MEMORY.on = DEVICE_MEMORY.on, on
    try:
        yield
    finally:
        DEVICE_MEMORY.on = previous


@contextlib.contextmanager
def total_memory(nbytes: int):
    """Within the block, each sim device has ``nbytes`` of memory (``DITORCH_SIM_TOTAL_MEMORY`` for the whole run):
    an allocation that would take a device's allocated bytes past it raises ``torch.OutOfMemoryError``.

    >>> import torch, ditorch.sim
    >>> ditorch.sim.register()
    >>> with ditorch.sim.total_memory(1 << 20):
    ...     try:
    ...         torch.empty(1 << 21, dtype=torch.uint8, device="sim")
    ...     except torch.OutOfMemoryError:
    ...         print("out of memory")
    out of memory
    """
    from .tensor import MEMORY

    if nbytes < 1:
        raise ValueError(f"ditorch.sim.total_memory({nbytes}): expected a positive number of bytes")
    previous, MEMORY.total = MEMORY.total, nbytes
    try:
        yield
    finally:
        MEMORY.total = previous


@contextlib.contextmanager
def asynchronous(lag: int = 64):
    """Within the block, sim's events complete and its non-blocking copies to the host land ``lag`` kernel launches
    late, as a GPU's do (``DITORCH_SIM_ASYNC=<lag>`` for the whole run): code that reads a non-blocking copy before
    waiting for an event after it reads NaN. The block's end lands every copy.

    >>> import torch, ditorch.sim
    >>> ditorch.sim.register()
    >>> with ditorch.sim.asynchronous(lag=8):
    ...     host = torch.ones(2, device="sim").to("cpu", non_blocking=True)
    ...     event = torch.sim.Event(); event.record()
    ...     early = host.tolist()          # not landed yet
    ...     event.synchronize()
    ...     late = host.tolist()
    >>> early, late
    ([nan, nan], [1.0, 1.0])
    """
    from . import async_completion as lagging

    if lag < 0:
        raise ValueError(f"ditorch.sim.asynchronous(lag={lag}): expected 0 or more kernel launches")
    previous, lagging.LAG.kernels = lagging.LAG.kernels, lag
    try:
        yield
    finally:
        lagging.LAG.kernels = previous
        lagging.synchronize_all()


# Why sim and CUDA autograd cannot share a process (PyTorch 2.8 and later, where the engine asks for the
# accelerator's streams): c10's flag "PrivateUse1 is registered" is set by renaming the key and never cleared,
# at::getAccelerator() then answers PrivateUse1, Node::stream() finds no input on that device type for a CUDA
# node, and the engine's TORCH_INTERNAL_ASSERT(opt_ready_stream && opt_parent_stream) fails.
_BESIDE_CUDA = (
    "once a PrivateUse1 device such as sim is registered, PyTorch takes it as the process's accelerator "
    "(at::getAccelerator) for good, and every backward over CUDA tensors in the process fails inside the "
    "autograd engine ('opt_ready_stream && opt_parent_stream INTERNAL ASSERT FAILED', pytorch/pytorch#161129)"
)


def _check_beside_cuda(torch) -> None:
    """Refuse to register where CUDA is already in use; say what breaks where CUDA could still be used."""
    if not torch.backends.cuda.is_built():
        return
    if getattr(torch.cuda, "_initialized", False):  # the module global: torch.cuda's functions may be mapped
        raise RuntimeError(
            f"sim: CUDA is already in use in this process, so the sim device is not registered: {_BESIDE_CUDA}. "
            "Use sim in a process that does not use CUDA (DITORCH_BACKEND=sim python script.py, or a subprocess)."
        )
    if torch._C._cuda_getDeviceCount() > 0:
        logging.getLogger("ditorch").warning(
            "sim: registered in a process that can use a CUDA GPU: %s. Run CUDA training in another process.",
            _BESIDE_CUDA)


def _fallback(op, *args, **kwargs):
    from .tensor import run_op

    return run_op(op, args, kwargs)


def _per_op(op):
    from .tensor import never_compiled, run_op

    @never_compiled(recursive=True)  # a device entry point, as SimTensor.__torch_dispatch__
    def kernel(*args, **kwargs):
        return run_op(op, args, kwargs)

    return kernel
